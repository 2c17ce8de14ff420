#!/bin/bash
# Tear down what netns_up.sh created: kill every process still inside the hosts' network
# namespaces (SIGTERM, 5 s, SIGKILL), delete the namespaces h1..hN and the switch namespace,
# unmount the UTS namespaces, remove /etc/netns/hK and the state under $PG_INFRA_STATE/netns.
# Idempotent; always exits 0.  Stop Slurm/sshd first (slurm_down.sh, ssh_down.sh) for a clean
# shutdown, although the process sweep here also catches them.
# Usage: infra/netns_down.sh [N]   (N: also remove h1..hN if no state was recorded; default 3)
. "$(dirname "$0")/common.sh"
N=${1:-3}
hosts=$(hosts_up)
[ -n "$hosts" ] || hosts=$(seq -f "$P%g" 1 "$N")
pids=""
for h in $hosts; do
  [ -e "/run/netns/$h" ] && pids="$pids $(ip netns pids "$h" 2>/dev/null | tr '\n' ' ')"
done
# shellcheck disable=SC2086
stop_pids $pids
for h in $hosts; do
  ip netns del "$h" 2>/dev/null
  rm -rf "/etc/netns/$h"
  if [ -e "$STATE/uts/$h" ]; then umount "$STATE/uts/$h" 2>/dev/null; rm -f "$STATE/uts/$h"; fi
done
ip netns del "$SW" 2>/dev/null
rmdir /etc/netns 2>/dev/null
rm -rf "$STATE/netns" "$STATE/uts"
rmdir "$STATE" 2>/dev/null
true
