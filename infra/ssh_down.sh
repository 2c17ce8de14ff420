#!/bin/bash
# Stop the sshd daemons started by ssh_up.sh together with their live sessions and whatever those
# run (all descendants of each listener), then remove $PG_INFRA_STATE/ssh (keys, configs).
# Idempotent; always exits 0. Leaves ~/.ssh untouched (ssh_up.sh never writes there).
. "$(dirname "$0")/common.sh"
D=$STATE/ssh
listeners=""
for f in "$D"/sshd-*.pid; do listeners="$listeners $(pidfile_pid "$f" sshd)"; done
# shellcheck disable=SC2046,SC2086
stop_pids $listeners $(descendants $listeners)
rm -rf "$D"
rmdir "$STATE" 2>/dev/null
true
