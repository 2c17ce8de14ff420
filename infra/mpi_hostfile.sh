#!/bin/bash
# Print a hostfile (or a -H / -hosts list) for the hosts made by netns_up.sh, SLOTS slots each.
# Usage: infra/mpi_hostfile.sh [SLOTS] [openmpi|mpich|list]     (default: 2 openmpi)
#   openmpi  "h1 slots=2" lines   -> mpirun --hostfile FILE
#   mpich    "h1:2" lines         -> mpiexec.mpich -f FILE
#   list     "h1:2,h2:2,h3:2"     -> mpirun -H LIST / mpiexec.mpich -hosts LIST
. "$(dirname "$0")/common.sh"
SLOTS=${1:-2}
FORMAT=${2:-openmpi}
hosts=$(hosts_up)
[ -n "$hosts" ] || { echo "$0: no hosts: run infra/netns_up.sh first" >&2; exit 1; }
case "$FORMAT" in
  openmpi) for h in $hosts; do echo "$h slots=$SLOTS"; done ;;
  mpich) for h in $hosts; do echo "$h:$SLOTS"; done ;;
  list) for h in $hosts; do printf '%s:%s\n' "$h" "$SLOTS"; done | paste -sd, ;;
  *) echo "usage: $0 [SLOTS] [openmpi|mpich|list]" >&2; exit 2 ;;
esac
