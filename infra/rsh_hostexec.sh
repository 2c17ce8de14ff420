#!/bin/bash
# An ssh stand-in for MPI launchers on the hosts made by netns_up.sh: no sshd needed.
# Called like ssh (`rsh_hostexec.sh [ssh options] [user@]HOST COMMAND...`), it ignores the options,
# joins COMMAND with spaces and runs it with `sh -c` on HOST through hostexec.sh, as sshd would.
# Unlike ssh the command inherits the caller's environment and working directory.
#   Open MPI: mpirun --mca plm_rsh_agent /path/to/infra/rsh_hostexec.sh -H h1:2,h2:2 ...
#   MPICH:    mpiexec.mpich -launcher ssh -launcher-exec /path/to/infra/rsh_hostexec.sh -hosts h1:2,h2:2 ...
HERE=$(cd "$(dirname "$0")" && pwd)
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;     # ssh options that take an argument
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "usage: $0 [ssh options] HOST COMMAND..." >&2; exit 255; }
host=${1#*@}; shift
exec "$HERE/hostexec.sh" "$host" sh -c "$*"
