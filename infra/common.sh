# Shared settings for the infra/*.sh scripts (sourced, not run).
#
#   PG_INFRA_PREFIX  host name prefix                      (default h  -> hosts h1..hN)
#   PG_INFRA_NET     first three octets of the host subnet (default 10.77.0 -> hK = 10.77.0.K/24)
#   PG_INFRA_STATE   state directory: pid files, configs, keys, logs (default /run/procgroup-infra)
#
# Everything the scripts start or write lives under $PG_INFRA_STATE, except what Linux or the tools
# insist on: the namespaces themselves (/run/netns/$P*), /etc/netns/$P*/ (read by `ip netns exec`).
P=${PG_INFRA_PREFIX:-h}
NET=${PG_INFRA_NET:-10.77.0}
STATE=${PG_INFRA_STATE:-/run/procgroup-infra}
INFRA_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SW="${P}sw"

# alive PID: running and not a zombie (orphans are reaped late here, so `kill -0` is not enough)
alive() { [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" != Z ]; }

# stop_pids PID...: SIGTERM, wait up to 5 s, then SIGKILL whatever is left
stop_pids() {
  local p left
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 50); do
    left=""; for p in "$@"; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -KILL $left 2>/dev/null || true
  for _ in $(seq 20); do
    left=""; for p in "$@"; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  return 0
}

# pidfile_pid FILE COMM: the pid in FILE if that process is alive and its name (/proc/PID/comm) is COMM;
# guards against killing an unrelated process that reused the pid of a daemon that died long ago
pidfile_pid() {
  local p
  [ -s "$1" ] || return 0
  p=$(tr -dc '0-9' < "$1")
  [ -n "$p" ] && alive "$p" && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] && echo "$p"
  true
}

# stop_pidfile FILE COMM: stop the process named in FILE (if it is a COMM) and remove FILE
stop_pidfile() {
  # shellcheck disable=SC2046
  stop_pids $(pidfile_pid "$1" "$2")
  rm -f "$1"
}

# hosts_up: the host names netns_up.sh recorded (empty when none)
hosts_up() { [ -s "$STATE/netns/hosts" ] && cat "$STATE/netns/hosts"; true; }

# need CMD...: fail with the package to install when a command is missing
need() {
  local c
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || [ -x "/sbin/$c" ] || {
      echo "$(basename "$0"): '$c' not found; install the Debian packages with infra/install_debian.sh" >&2; exit 127; }
  done
}

# descendants PID...: all descendants of the given pids (children first-level and deeper), one ps call
descendants() {
  [ $# -gt 0 ] || return 0
  ps -e -o pid=,ppid= | awk -v roots="$*" '
    { kids[$2] = kids[$2] " " $1 }
    END { n = split(roots, q, " "); for (i = 1; i <= n; i++) seen[q[i]] = 1
          while (n > 0) { p = q[n--]; m = split(kids[p], k, " ")
            for (j = 1; j <= m; j++) if (!(k[j] in seen)) { seen[k[j]] = 1; print k[j]; q[++n] = k[j] } } }'
}
