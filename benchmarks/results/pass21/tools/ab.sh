#!/bin/bash
# Whole jobs alternating (passes 21 and 22): ./ab.sh ROUNDS NPROC OPS "label|ENV=.. ENV=.." ... [mpi]
# Each variant is one procgroup job (its ENV assignments exported); "mpi" runs the same calls through Open MPI.
# Every job has a 180 s limit, and any rank left behind is killed before the next one.
cd "$(dirname "$0")"
rounds=$1 n=$2 ops=$3; shift 3
for ((i = 1; i <= rounds; i++)); do
  for v in "$@"; do
    label=${v%%|*}
    if [ "$v" = mpi ]; then
      out=$(timeout -k 5 180 mpirun --allow-run-as-root -n $n --oversubscribe --mca btl vader,self python jobs.py --mpi $ops 2>&1 | grep RES)
    else
      envs=${v#*|}; [ "$envs" = "$v" ] && envs=""
      out=$(env $envs timeout -k 5 180 procgroup run --standalone --nproc-per-node $n jobs.py $ops 2>&1 | grep RES)
    fi
    pkill -9 -f "jobs.py" 2>/dev/null
    echo "$(date +%T) r$i $label: ${out#RES }"
  done
  echo "$(date +%T) r$i period: $(python ../../pass20/tools/coherence_probe.py | tr '\n' ' ')"
done
