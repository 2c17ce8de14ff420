#!/bin/bash
# usage: [HOSTS=3] [PER=2] mh_loop.sh SCRIPT [VAR=value...] (as root): run SCRIPT with procgroup run on HOSTS netns
# hosts (pgl1..) x PER ranks each, VAR=value in the ranks' environment; prints rank 0's output.  The hosts stay up
# (PG_INFRA_PREFIX=pgl PG_INFRA_NET=10.79.0 PG_INFRA_STATE=/run/pgl-infra infra/netns_down.sh removes them).
SCRIPT=$(realpath "$1"); shift
HOSTS=${HOSTS:-3} PER=${PER:-2}
cd "$(dirname "$0")/../../.."
export PG_INFRA_PREFIX=pgl PG_INFRA_NET=10.79.0 PG_INFRA_STATE=/run/pgl-infra
ip netns list | grep -q "pgl$HOSTS" || infra/netns_up.sh "$HOSTS" >/dev/null
export PROCGROUP_SECRET=abc123abc123abc123 PYTHONPATH="$PWD/src"
PORT=$((29700 + RANDOM % 200))
pids=()
for ((k = 0; k < HOSTS; k++)); do
  env "$@" infra/hostexec.sh "pgl$((k + 1))" procgroup run --nnodes "$HOSTS" --node-rank $k --master-addr pgl1 \
    --master-port $PORT --nproc-per-node "$PER" "$SCRIPT" > "${TMPDIR:-/tmp}/mhl.$k.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
grep -v "^procgroup run\|rank  host\|  ok$\|OMP_NUM" "${TMPDIR:-/tmp}/mhl.0.log" | head -30
