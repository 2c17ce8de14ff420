#!/bin/bash
# Install the Debian/Ubuntu packages the infra scripts and tests/infra need (as root).
# The same list as .ci/run. Takes ~40-60 s on a fresh machine.
#   openmpi-bin libopenmpi-dev   Open MPI's mpirun/orted          (tests: mpirun modes)
#   mpich                         MPICH's Hydra mpiexec.mpich      (tests: mpiexec modes)
#   slurmctld slurmd slurm-client munge                             (slurm_up.sh)
#   openssh-server                sshd (openssh-client comes with it)  (ssh_up.sh)
#   iproute2                      ip netns                          (netns_up.sh)
#   procps psmisc                 ps (the scripts find daemons' children with it)
# nsenter/unshare/mount/runuser come from util-linux and mount, which every Debian has.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "$0: run as root (apt-get install)" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends \
  openmpi-bin libopenmpi-dev mpich slurmctld slurmd slurm-client munge openssh-server iproute2 procps psmisc
