#!/bin/bash
# Tear down everything the infra scripts may have started, in dependency order:
# Slurm (+ private munged), sshd, then the namespace hosts (killing anything still inside them).
# Idempotent; always exits 0. The test fixtures' watchdog runs this if pytest dies mid-session.
# Usage: infra/down_all.sh [N]
HERE=$(cd "$(dirname "$0")" && pwd)
"$HERE/slurm_down.sh"
"$HERE/ssh_down.sh"
"$HERE/netns_down.sh" "${1:-3}"
true
