#!/bin/bash
# Create N "hosts" h1..hN on this machine, each a network namespace with its own address
# 10.77.0.K/24 on eth0, linked by veth pairs to a Linux bridge that lives in a namespace of its
# own ("hsw"), so the root namespace is untouched. Each host also gets
#   * a UTS namespace (persisted under $PG_INFRA_STATE/uts/hK) whose hostname is hK;
#   * an /etc/hosts (/etc/netns/hK/hosts) in which its OWN name resolves to 127.0.1.1, as on a
#     stock Debian/Ubuntu machine, and the other hosts' names to their 10.77.0.x addresses.
#     This is the configuration that makes torch's gloo advertise 127.0.1.1 to its peers.
# Run commands "on" a host with infra/hostexec.sh hK CMD... (`ip netns exec hK` gives the network
# namespace and /etc/hosts but not the hostname, and it remounts /sys, which slurmd dislikes).
# Idempotent: calls netns_down.sh first. Takes ~0.2 s. Undo with infra/netns_down.sh.
# Usage: infra/netns_up.sh [N]   (default 3)
set -euo pipefail
. "$(dirname "$0")/common.sh"
N=${1:-3}
[[ "$N" =~ ^[1-9][0-9]?$ ]] && [ "$N" -le 250 ] || { echo "usage: $0 [N]  (1 <= N <= 250)" >&2; exit 2; }
need ip nsenter unshare
[ "$(id -u)" = 0 ] || { echo "$0: must run as root (creates network namespaces)" >&2; exit 1; }
"$INFRA_DIR/netns_down.sh" "$N" >/dev/null 2>&1 || true

mkdir -p "$STATE/netns" "$STATE/uts"
: > "$STATE/netns/hosts"
ip netns add "$SW"
ip -n "$SW" link set lo up
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
for i in $(seq 1 "$N"); do
  h=$P$i
  ip netns add "$h"
  echo "$h" >> "$STATE/netns/hosts"
  ip -n "$h" link set lo up
  ip -n "$SW" link add "v$i" type veth peer name eth0 netns "$h"
  ip -n "$SW" link set "v$i" master br0
  ip -n "$SW" link set "v$i" up
  ip -n "$h" addr add "$NET.$i/24" dev eth0
  ip -n "$h" link set eth0 up
  mkdir -p "/etc/netns/$h"
  {
    echo "127.0.0.1 localhost"
    echo "127.0.1.1 $h"        # Debian's self entry: the host's own name -> 127.0.1.1 (the trap)
    for j in $(seq 1 "$N"); do [ "$j" = "$i" ] || echo "$NET.$j $P$j"; done
  } > "/etc/netns/$h/hosts"
  touch "$STATE/uts/$h"
  unshare --uts="$STATE/uts/$h" hostname "$h"
done
echo "up: hosts $(tr '\n' ' ' < "$STATE/netns/hosts")($NET.1-$N); run commands with: $INFRA_DIR/hostexec.sh ${P}1 CMD..."
