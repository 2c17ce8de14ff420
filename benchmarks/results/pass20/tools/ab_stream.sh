#!/bin/bash
# PROCGROUP_SHM_STREAM=never against auto, job by job, with Open MPI and the period (coherence_probe.py) beside
# each round (pass 20): ./ab_stream.sh SECONDS > log
cd "$(dirname "$0")"
end=$(( $(date +%s) + ${1:-600} ))
pg() { PROCGROUP_SHM_STREAM=$1 procgroup run --standalone --nproc-per-node 4 $2 2>&1 | grep -A5 MC | grep -v RES | grep -v MC | awk '{print $3}' | tr '\n' ' '; }
mp() { mpirun --allow-run-as-root -n 4 --oversubscribe --mca btl vader,self python $1 2>&1 | grep MPIRES | awk '{print $3,$5,$7,$9}'; }
while [ $(date +%s) -lt $end ]; do
  a=$(pg never ops.py); b=$(pg auto ops.py); m=$(mp ops_mpi.py)
  a2=$(pg never ops2.py); b2=$(pg auto ops2.py); m2=$(mp ops2_mpi.py)
  xc=$(python coherence_probe.py | tr "\n" " ")
  echo "$(date +%T) never: $a $a2| auto: $b $b2| mpi: $m $m2 | xcopy $xc"
done
