#!/bin/bash
# Regenerate the captured launcher environments in this directory (tests/data/env/*.env).
#
# Every task of a REAL launcher dumps its environment (env -0) and its `uname -n`; this
# script keeps only the identity-relevant variables (SLURM*, OMPI_*, PMIX_*, PMI_*, MPI_*,
# MPIR_*, HYDRA*, HYDI_*, I_MPI_*, HOSTNAME) and writes one file per launcher:
#
#     # header comments (tool, version, command)
#     [rank 0]
#     # hostname: vm            <- `uname -n` of the task (HOSTNAME is usually not exported)
#     OMPI_COMM_WORLD_RANK=0
#     ...
#     [rank 1]
#     ...
#
# Sections are ordered by the launcher's own rank variable.  tests/unit/test_identity.py
# loads them with load_env_capture().
#
# Usage (root; Debian packages openmpi-bin mpich slurmctld slurmd slurm-client munge):
#     tests/data/env/capture.sh [all|openmpi|mpich|slurm|slurm-netns]
#       openmpi      mpirun --allow-run-as-root --oversubscribe -np 4          -> openmpi.env
#       mpich        mpiexec.mpich -n 4; mpiexec.mpich -pmi-port -n 2         -> mpich.env, mpich-pmi-port.env
#       slurm        MODE=single cluster: srun -N1 -n4; sbatch -n4 batch shell -> slurm-single.env, slurm-sbatch.env
#       slurm-netns  3 "hosts" h1..h3 (netns, MODE=netns), two batch jobs:
#                    sbatch -N3 -n6: srun -N3 -n6 (placed 4,1,1), mpirun -np 6, mpirun --nolocal -np 2,
#                      mpiexec.mpich -n 6, mpirun -np 5   -> slurm-netns-N3n6-uneven.env, openmpi-in-slurm*.env, mpich-in-slurm.env
#                    sbatch -N3 --ntasks-per-node=2: srun -N3 -n6; srun -N2 -n3 -w h2,h3
#                                           -> slurm-netns-N3n6.env, slurm-netns-N2n3-subset.env
# Infra scripts come from $INFRA (default /work/shared/reference-infra).  Everything started
# here (slurm daemons, munged, network namespaces) is torn down on exit, also on failure.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
INFRA=${INFRA:-/work/shared/reference-infra}
WHAT=${1:-all}
WORK=$(mktemp -d /tmp/pg-envcap.XXXXXX)
chmod 755 "$WORK"
STARTED=""

cleanup() {
  case "$STARTED" in
    *netns*) "$INFRA/slurm_down.sh" >/dev/null 2>&1 || true; "$INFRA/netns_down.sh" 3 >/dev/null 2>&1 || true ;;
    *slurm*) "$INFRA/slurm_down.sh" >/dev/null 2>&1 || true ;;
  esac
  rm -rf "$WORK"
}
trap cleanup EXIT

# The command every task runs: dump env (NUL-separated) and host name into $DIR/<pid>.{env,host}.
TASK='uname -n > "$0/$$.host"; env -0 > "$0/$$.env"'

# combine DIR RANKVAR OUTFILE HEADER...: filter, order by RANKVAR, write OUTFILE.
combine() {
  python3 - "$@" <<'PY'
import os, re, sys
d, rankvar, out, *header = sys.argv[1:]
keep = re.compile(r"^(SLURM|OMPI_|PMIX_|PMI_|MPI_|MPIR_|HYDRA|HYDI_|I_MPI_|HOSTNAME$)")
tasks = []
for f in sorted(os.listdir(d)):
    if not f.endswith(".env"):
        continue
    raw = open(os.path.join(d, f), "rb").read().decode()
    env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    env = {k: v for k, v in env.items() if keep.match(k) and "\n" not in v}
    host = open(os.path.join(d, f[:-4] + ".host")).read().strip()
    tasks.append((int(env[rankvar]), host, env))
if not tasks:
    sys.exit(f"capture for {out}: no task wrote its environment (see the job output above)")
tasks.sort(key=lambda t: t[0])
with open(out, "w") as fh:
    for h in header:
        fh.write(f"# {h}\n")
    for rank, host, env in tasks:
        fh.write(f"\n[rank {rank}]\n# hostname: {host}\n")
        for k in sorted(env):
            fh.write(f"{k}={env[k]}\n")
print(f"wrote {out}: {len(tasks)} tasks")
PY
}

newdir() { local d="$WORK/$1"; mkdir -p "$d"; chmod 777 "$d"; echo "$d"; }

cap_openmpi() {
  local d; d=$(newdir openmpi)
  timeout 120 mpirun --allow-run-as-root --oversubscribe -np 4 sh -c "$TASK" "$d"
  combine "$d" OMPI_COMM_WORLD_RANK "$HERE/openmpi.env" \
    "Open MPI $(mpirun --version | head -1 | awk '{print $NF}') (Debian openmpi-bin), one host, captured by capture.sh:" \
    "mpirun --allow-run-as-root --oversubscribe -np 4 sh -c 'env'"
}

cap_mpich() {
  local d; d=$(newdir mpich)
  timeout 120 mpiexec.mpich -n 4 sh -c "$TASK" "$d"
  combine "$d" PMI_RANK "$HERE/mpich.env" \
    "MPICH Hydra $(mpiexec.mpich --version | awk '/Version:/{print $2; exit}') (Debian mpich), one host, captured by capture.sh:" \
    "mpiexec.mpich -n 4 sh -c 'env'   (default PMI_FD mode: no host, no job id in the environment)"
  d=$(newdir mpich-pmi-port)
  timeout 120 mpiexec.mpich -pmi-port -n 2 sh -c "$TASK" "$d"
  combine "$d" PMI_ID "$HERE/mpich-pmi-port.env" \
    "MPICH Hydra, one host, captured by capture.sh:" \
    "mpiexec.mpich -pmi-port -n 2 sh -c 'env'   (PMI_PORT mode: PMI_ID instead of PMI_RANK, and NO PMI_SIZE;" \
    "PMI_PORT is the host:port of this node's hydra_pmi_proxy, not of a shared host)"
}

wait_job() {  # wait until job $1 has left the queue
  local pre=$2
  for _ in $(seq 300); do
    [ -z "$($pre squeue -h -j "$1" 2>/dev/null)" ] && return 0; sleep 0.2
  done
  echo "job $1 did not finish" >&2; return 1
}

cap_slurm() {
  STARTED="$STARTED slurm"
  MODE=single "$INFRA/slurm_up.sh" >/dev/null
  local v; v=$(srun --version | awk '{print $2}')
  local d; d=$(newdir slurm-single)
  timeout 120 srun -N1 -n4 sh -c "$TASK" "$d"
  combine "$d" SLURM_PROCID "$HERE/slurm-single.env" \
    "Slurm $v, MODE=single (one node 'localhost', CPUs=8) from reference-infra/slurm_up.sh, captured by capture.sh:" \
    "srun -N1 -n4 sh -c 'env'"
  d=$(newdir slurm-sbatch)
  local job
  job=$(sbatch --parsable -n4 -o /dev/null --wrap "sh -c '$TASK' $d")
  wait_job "$job" ""
  combine "$d" SLURM_PROCID "$HERE/slurm-sbatch.env" \
    "Slurm $v, MODE=single, captured by capture.sh: the BATCH SHELL of  sbatch -n4 --wrap 'env'" \
    "(one process, not a task of a step: SLURM_PROCID=0 and SLURM_NTASKS=4 but no SLURM_STEP_ID)"
  "$INFRA/slurm_down.sh" >/dev/null 2>&1 || true
  STARTED=${STARTED/ slurm/}
}

cap_slurm_netns() {
  STARTED="$STARTED netns"
  "$INFRA/netns_up.sh" 3 >/dev/null
  MODE=netns NNODES=3 "$INFRA/slurm_up.sh" >/dev/null
  local X="$INFRA/hostexec.sh h1"
  local v; v=$($X srun --version | awk '{print $2}')
  local hdr="Slurm $v, MODE=netns: 3 hosts h1..h3 (network + UTS namespaces, 10.77.0.1-3, one slurmd each, CPUs=8) from reference-infra"
  # Job A: sbatch -N3 -n6 -> Slurm packs the 8-CPU nodes unevenly: tasks per node 4,1(x2).
  local a1 a2 a3 a4 a5; a1=$(newdir A-srun); a2=$(newdir A-mpirun); a3=$(newdir A-nolocal); a4=$(newdir A-hydra)
  a5=$(newdir A-np5)
  cat > "$WORK/jobA.sh" <<EOF
#!/bin/sh
srun -N3 -n6 sh -c '$TASK' $a1
mpirun --allow-run-as-root --oversubscribe -np 6 sh -c '$TASK' $a2
mpirun --allow-run-as-root --oversubscribe --nolocal -np 2 sh -c '$TASK' $a3
mpiexec.mpich -n 6 sh -c '$TASK' $a4
mpirun --allow-run-as-root --oversubscribe -np 5 sh -c '$TASK' $a5
EOF
  # Job B: sbatch -N3 --ntasks-per-node=2 -> 2(x3); then a step on a subset of the nodes.
  local b1 b2; b1=$(newdir B-srun); b2=$(newdir B-subset)
  cat > "$WORK/jobB.sh" <<EOF
#!/bin/sh
srun -N3 -n6 sh -c '$TASK' $b1
srun -N2 -n3 -w h2,h3 sh -c '$TASK' $b2
EOF
  chmod 755 "$WORK/jobA.sh" "$WORK/jobB.sh"
  local job
  job=$($X sbatch --parsable -N3 -n6 -o "$WORK/jobA.out" "$WORK/jobA.sh"); wait_job "$job" "$X"
  job=$($X sbatch --parsable -N3 --ntasks-per-node=2 -o "$WORK/jobB.out" "$WORK/jobB.sh"); wait_job "$job" "$X"
  cat "$WORK/jobA.out" "$WORK/jobB.out" >&2 || true
  local in="captured by capture.sh inside  sbatch -N3 -n6 jobA.sh"
  combine "$a1" SLURM_PROCID "$HERE/slurm-netns-N3n6-uneven.env" "$hdr" \
    "$in:  srun -N3 -n6 sh -c 'env'   (Slurm placed the tasks 4,1,1)"
  combine "$a2" OMPI_COMM_WORLD_RANK "$HERE/openmpi-in-slurm.env" "$hdr" \
    "$in:  mpirun --allow-run-as-root --oversubscribe -np 6 sh -c 'env'" \
    "(mpirun starts its orted daemons on h2,h3 with srun: tasks there carry the DAEMON step's SLURM_*," \
    " e.g. rank 4 has SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2; tasks on h1 carry the batch shell's SLURM_*)"
  combine "$a3" OMPI_COMM_WORLD_RANK "$HERE/openmpi-in-slurm-nolocal.env" "$hdr" \
    "$in:  mpirun --allow-run-as-root --oversubscribe --nolocal -np 2 sh -c 'env'" \
    "(no rank runs on mpirun's host h1)"
  combine "$a5" OMPI_COMM_WORLD_RANK "$HERE/openmpi-in-slurm-np5.env" "$hdr" \
    "$in:  mpirun --allow-run-as-root --oversubscribe -np 5 sh -c 'env'" \
    "(ranks on h1 and h2 only: 4+1 of the 4,1,1 slots; h3 is allocated but runs no rank)"
  combine "$a4" PMI_RANK "$HERE/mpich-in-slurm.env" "$hdr" \
    "$in:  mpiexec.mpich -n 6 sh -c 'env'   (Hydra starts its proxies with srun)"
  in="captured by capture.sh inside  sbatch -N3 --ntasks-per-node=2 jobB.sh"
  combine "$b1" SLURM_PROCID "$HERE/slurm-netns-N3n6.env" "$hdr" "$in:  srun -N3 -n6 sh -c 'env'"
  combine "$b2" SLURM_PROCID "$HERE/slurm-netns-N2n3-subset.env" "$hdr" \
    "$in:  srun -N2 -n3 -w h2,h3 sh -c 'env'" \
    "(a step on a SUBSET of the job's nodes: STEP_NODELIST != JOB_NODELIST, tasks per node 2,1)"
}

case "$WHAT" in
  openmpi) cap_openmpi ;;
  mpich) cap_mpich ;;
  slurm) cap_slurm ;;
  slurm-netns) cap_slurm_netns ;;
  all) cap_openmpi; cap_mpich; cap_slurm; cap_slurm_netns ;;
  *) echo "usage: $0 [all|openmpi|mpich|slurm|slurm-netns]" >&2; exit 2 ;;
esac
