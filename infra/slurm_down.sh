#!/bin/bash
# Stop what slurm_up.sh started: the slurmd daemons (with their slurmstepd children and job tasks),
# slurmctld, then the private munged, each by pid file (SIGTERM, 5 s, SIGKILL); remove
# $PG_INFRA_STATE/slurm and $PG_INFRA_STATE/munge. Set PG_INFRA_KEEP_LOGS=1 to copy the logs to
# /tmp/procgroup-infra-logs first. Idempotent; always exits 0.
. "$(dirname "$0")/common.sh"
S=$STATE/slurm
M=$STATE/munge
if [ "${PG_INFRA_KEEP_LOGS:-0}" = 1 ] && [ -d "$S/log" ]; then
  mkdir -p /tmp/procgroup-infra-logs && cp -r "$S/log/." "$M"/*.log /tmp/procgroup-infra-logs/ 2>/dev/null
fi
daemons=""
for f in "$S"/slurmd-*.pid; do daemons="$daemons $(pidfile_pid "$f" slurmd)"; done
daemons="$daemons $(pidfile_pid "$S/slurmctld.pid" slurmctld)"
# shellcheck disable=SC2046,SC2086
stop_pids $(descendants $daemons) $daemons
stop_pidfile "$M/munged.pid" munged
rm -rf "$S" "$M"
rmdir "$STATE" 2>/dev/null
true
