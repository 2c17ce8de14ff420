#!/bin/bash
# usage: mh_loop.sh SCRIPT [env...]: run SCRIPT on 3 netns hosts x 2 ranks; prints rank 0's output
SCRIPT=$(realpath "$1"); shift
cd "$(dirname "$0")/../../.."
export PG_INFRA_PREFIX=pgl PG_INFRA_NET=10.79.0 PG_INFRA_STATE=/run/pgl-infra
ip netns list | grep -q pgl1 || infra/netns_up.sh 3 >/dev/null
export PROCGROUP_SECRET=abc123abc123abc123 PYTHONPATH="$PWD/src"
PORT=$((29700 + RANDOM % 200))
pids=()
for k in 0 1 2; do
  env "$@" infra/hostexec.sh pgl$((k+1)) procgroup run --nnodes 3 --node-rank $k --master-addr pgl1 --master-port $PORT --nproc-per-node 2 $SCRIPT > ${TMPDIR:-/tmp}/mhl.$k.log 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
grep -v "^procgroup run\|rank  host\|  ok$\|OMP_NUM" ${TMPDIR:-/tmp}/mhl.0.log | head -30
