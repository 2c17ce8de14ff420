#!/bin/bash
# Run CMD "on" host NAME created by netns_up.sh: in its network and UTS namespaces (so
# `hostname` prints NAME) and in a private mount namespace where /etc/hosts is NAME's.
# Everything else (PID namespace, filesystem, /dev/shm, users) is shared with the machine.
# Unlike `ip netns exec`, /sys is not remounted, so /sys/fs/cgroup stays visible (slurmd needs it).
# The environment and working directory are passed through unchanged.
# Usage: infra/hostexec.sh NAME CMD [ARG...]
set -e
. "$(dirname "$0")/common.sh"
[ $# -ge 2 ] || { echo "usage: $0 HOST CMD [ARG...]" >&2; exit 2; }
NAME=$1; shift
[ -e "/run/netns/$NAME" ] && [ -e "$STATE/uts/$NAME" ] || {
  echo "$0: no host '$NAME' (known: $(hosts_up | tr '\n' ' ')); run infra/netns_up.sh first" >&2; exit 2; }
exec nsenter --net="/run/netns/$NAME" --uts="$STATE/uts/$NAME" \
  unshare --mount --propagation private \
  sh -c 'mount --bind "/etc/netns/$0/hosts" /etc/hosts && exec "$@"' "$NAME" "$@"
