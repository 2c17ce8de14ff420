#!/bin/bash
# Run a Slurm client command (srun, sbatch, sinfo, squeue, scancel, ...) on the first host of the
# cluster made by slurm_up.sh, with SLURM_CONF pointing at its config.
# Usage: infra/slurmexec.sh srun -N3 -n6 hostname
. "$(dirname "$0")/common.sh"
[ -s "$STATE/slurm/slurm.conf" ] || { echo "$0: no cluster: run infra/slurm_up.sh first" >&2; exit 2; }
export SLURM_CONF=$STATE/slurm/slurm.conf
exec "$INFRA_DIR/hostexec.sh" "$(hosts_up | head -1)" "$@"
