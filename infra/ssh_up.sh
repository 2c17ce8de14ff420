#!/bin/bash
# Start one key-auth-only sshd on port 22 in each host made by netns_up.sh, so that `ssh h2 CMD`
# from any host works as it would on a real cluster (for mpirun / mpiexec / `procgroup run` over ssh).
# Keys and configs are generated fresh under $PG_INFRA_STATE/ssh (tmpfs, removed by ssh_down.sh):
#   ssh_config   client config: root, the generated key, no host-key checks, BatchMode
#   ssh          wrapper `ssh -F ssh_config "$@"`: use it as mpirun's plm_rsh_agent or Hydra's
#                -launcher-exec (e.g. `mpirun --mca plm_rsh_agent $PG_INFRA_STATE/ssh/ssh ...`)
# ~/.ssh is never touched. Idempotent: calls ssh_down.sh first. Takes ~1-3 s.
# Usage: infra/ssh_up.sh          (needs: netns_up.sh; Debian openssh-server, openssh-client)
set -euo pipefail
. "$(dirname "$0")/common.sh"
need sshd ssh ssh-keygen
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
"$INFRA_DIR/ssh_down.sh" >/dev/null 2>&1 || true
hosts=$(hosts_up)
[ -n "$hosts" ] || { echo "$0: no hosts: run infra/netns_up.sh first" >&2; exit 1; }
D=$STATE/ssh
mkdir -p "$D" /run/sshd            # /run/sshd: sshd's privilege-separation directory on Debian
chmod 700 "$D"; chmod 755 /run/sshd
ssh-keygen -q -t ed25519 -N '' -C procgroup-infra-host -f "$D/ssh_host_ed25519_key"
ssh-keygen -q -t ed25519 -N '' -C procgroup-infra-client -f "$D/id_ed25519"
cp "$D/id_ed25519.pub" "$D/authorized_keys"; chmod 600 "$D/authorized_keys"
cat > "$D/sshd_config" <<CONF
Port 22
ListenAddress 0.0.0.0
HostKey $D/ssh_host_ed25519_key
AuthorizedKeysFile $D/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
AcceptEnv *
Subsystem sftp internal-sftp
LogLevel ERROR
CONF
cat > "$D/ssh_config" <<CONF
Host *
  User root
  IdentityFile $D/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 10
CONF
printf '#!/bin/sh\nexec ssh -F %s "$@"\n' "$D/ssh_config" > "$D/ssh"; chmod 755 "$D/ssh"
for h in $hosts; do
  "$INFRA_DIR/hostexec.sh" "$h" "$SSHD" -f "$D/sshd_config" -o "PidFile=$D/sshd-$h.pid"
done
first=$(echo "$hosts" | head -1)
wait_ssh() {  # wait_ssh HOST: until `ssh HOST true` from the first host works (10 s)
  for _ in $(seq 100); do
    "$INFRA_DIR/hostexec.sh" "$first" "$D/ssh" "$1" true 2>/dev/null && return 0
    sleep 0.1
  done
  echo "$0: sshd on $1 does not answer ssh from $first" >&2; return 1
}
waits=""
for h in $hosts; do wait_ssh "$h" & waits="$waits $!"; done
for w in $waits; do wait "$w"; done    # set -e: any failure fails the script
echo "up: sshd on $(echo $hosts) port 22; from a host: $D/ssh $first hostname   (client config: $D/ssh_config)"
