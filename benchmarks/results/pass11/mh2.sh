#!/bin/bash
# usage: mh2.sh SCRIPT [env...]: run SCRIPT on 2 netns hosts x 1 rank (as root); prints rank 0's per-100 line
SCRIPT=$(realpath "$1"); shift
cd "$(dirname "$0")/../../.."
export PG_INFRA_PREFIX=pgl PG_INFRA_NET=10.79.0 PG_INFRA_STATE=/run/pgl-infra
ip netns list | grep -q pgl1 || infra/netns_up.sh 2 >/dev/null
export PROCGROUP_SECRET=abc123abc123abc123 PYTHONPATH="$PWD/src"
PORT=$((29700 + RANDOM % 200))
for k in 0 1; do env "$@" infra/hostexec.sh pgl$((k+1)) procgroup run --nnodes 2 --node-rank $k --master-addr pgl1 --master-port $PORT --nproc-per-node 1 $SCRIPT > ${TMPDIR:-/tmp}/mh2.$k.log 2>&1 & done; wait
grep "per-100" ${TMPDIR:-/tmp}/mh2.0.log
