"""Per-process mode across 3 hosts: one launcher process per rank, ``init_process_group()`` with no arguments.

The hosts are network namespaces h1..h3 (see tests/infra/fixtures.py) on which a host's own name
resolves to 127.0.1.1, the configuration that breaks torch's gloo.  Each test starts
tests/infra/scripts/allreduce_worker.py as 6 ranks, 2 per host, with a real launcher:

* Slurm:    ``srun -N3 -n6`` (slurmctld on h1, one slurmd per host)
* Open MPI: ``mpirun -H h1:2,h2:2,h3:2`` from h1; the remote orted daemons are started either
  through hostexec (``--mca plm_rsh_agent infra/rsh_hostexec.sh``) or over real ssh (sshd_hosts)
* MPICH:    ``mpiexec.mpich -hosts h1:2,h2:2,h3:2`` from h1, Hydra's proxies started the same two ways

and checks every rank's line (rank, world size, local rank, node rank, host, all_reduce results),
the launcher's exit status, and that no process of the launch is left anywhere afterwards.

Master address: Slurm and Open MPI give procgroup enough to derive it (first node of the step;
mpirun's host from OMPI_MCA_orte_hnp_uri), so those runs set nothing.  Hydra exports no host at
all, and without mpi4py (not a test dependency) procgroup cannot learn rank 0's address, so the
MPICH runs pass ``-genv MASTER_ADDR h1`` -- the name, which on h1 itself resolves to 127.0.1.1.

mpi4py: under mpirun/mpiexec without MASTER_ADDR procgroup asks mpi4py, when importable, for rank
0's address.  So that results do not depend on what happens to be installed, the tests above hide
mpi4py from the ranks (the no-mpi4py path, the one CI runs); test_openmpi_mpirun_mpi4py_master
runs the mpi4py path when an Open MPI build of mpi4py is installed.
"""

from __future__ import annotations

import pytest

from .fixtures import NetnsHosts, SlurmCluster, SshHosts, host_list, python_for_hosts, require_binaries
from .launch import INFRA, check_world, clean_env, launch, mpi4py_library, new_tag, worker_cmd

pytestmark = [pytest.mark.infra, pytest.mark.timeout(240, method="signal")]

PER_NODE = 2
LAUNCH_TIMEOUT = 150.0


def _expect(hosts: NetnsHosts):
    return len(hosts.names) * PER_NODE, list(hosts.names)


def test_srun(slurm_cluster: SlurmCluster):
    hosts = slurm_cluster.hosts
    world, names = _expect(hosts)
    tag = new_tag()
    cmd = slurm_cluster.cmd(
        "srun",
        "--kill-on-bad-exit=1",
        f"-N{len(names)}",
        f"-n{world}",
        *worker_cmd(python_for_hosts(), tag, world, PER_NODE, names),
    )
    r = launch(cmd, env=slurm_cluster.env(clean_env(hide_mpi4py=True)), timeout=LAUNCH_TIMEOUT, tag=tag, netns=names)
    check_world(r, world, PER_NODE, names)


@pytest.fixture(params=["hostexec", "ssh"])
def remote_agent(request, netns_hosts: NetnsHosts) -> str:
    """The command MPI launchers use instead of ssh to start their daemons on h2, h3."""
    if request.param == "hostexec":
        return str(INFRA / "rsh_hostexec.sh")
    sshd: SshHosts = request.getfixturevalue("sshd_hosts")
    return str(sshd.ssh)


def _openmpi_mpirun_cmd(hosts: NetnsHosts, agent: str, worker: list) -> list:
    # ssh starts a clean env; XDG_CONFIG_HOME: the hosts share a home, so they share the per-user secret file
    # (tests/conftest.py points it away from the real ~/.config)
    fwd = ["PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "PROCGROUP_TIMEOUT", "XDG_CONFIG_HOME"]
    return hosts.cmd(
        hosts.names[0],
        "mpirun",
        "--allow-run-as-root",
        "-H",
        host_list(hosts.names, PER_NODE),
        "--mca",
        "plm_rsh_agent",
        agent,
        *[a for v in fwd for a in ("-x", v)],
        *worker,
    )


def test_openmpi_mpirun(netns_hosts: NetnsHosts, remote_agent: str):
    require_binaries("mpirun", "orted", why="Open MPI mpirun")
    world, names = _expect(netns_hosts)
    tag = new_tag()
    cmd = _openmpi_mpirun_cmd(netns_hosts, remote_agent, worker_cmd(python_for_hosts(), tag, world, PER_NODE, names))
    r = launch(cmd, env=clean_env(hide_mpi4py=True), timeout=LAUNCH_TIMEOUT, tag=tag, netns=names)
    check_world(r, world, PER_NODE, names)


def test_mpich_mpiexec(netns_hosts: NetnsHosts, remote_agent: str):
    require_binaries("mpiexec.mpich", "hydra_pmi_proxy", why="MPICH mpiexec")
    world, names = _expect(netns_hosts)
    tag = new_tag()
    cmd = netns_hosts.cmd(
        names[0],
        "mpiexec.mpich",
        "-hosts",
        host_list(names, PER_NODE),
        "-launcher",
        "ssh",
        "-launcher-exec",
        remote_agent,
        "-genv",
        "MASTER_ADDR",
        names[0],
        *worker_cmd(python_for_hosts(), tag, world, PER_NODE, names),
    )
    r = launch(cmd, env=clean_env(hide_mpi4py=True), timeout=LAUNCH_TIMEOUT, tag=tag, netns=names)
    check_world(r, world, PER_NODE, names)


def test_mpich_mpiexec_without_master_addr_says_what_to_set(netns_hosts: NetnsHosts):
    """Hydra across hosts names no host: without mpi4py, init must fail at once saying what to set, not hang
    until its timeout (PROCGROUP_TIMEOUT=60 here)."""
    require_binaries("mpiexec.mpich", "hydra_pmi_proxy", why="MPICH mpiexec")
    world, names = _expect(netns_hosts)
    tag = new_tag()
    cmd = netns_hosts.cmd(
        names[0],
        "mpiexec.mpich",
        "-hosts",
        host_list(names, PER_NODE),
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(INFRA / "rsh_hostexec.sh"),
        *worker_cmd(python_for_hosts(), tag, world, PER_NODE, names),
    )
    r = launch(cmd, env=clean_env(hide_mpi4py=True), timeout=LAUNCH_TIMEOUT, tag=tag, netns=names)
    ctx = r.report()
    assert not r.timed_out and not r.leftovers, ctx
    assert r.returncode != 0 and r.elapsed < 45, ctx
    assert "MASTER_ADDR" in r.stderr and "ConfigError" in r.stderr, ctx
    assert "PGW " not in r.stdout, ctx


def test_openmpi_mpirun_mpi4py_master(netns_hosts: NetnsHosts):
    """With an Open MPI mpi4py importable, rank 0 MPI-broadcasts its real address (not 127.0.1.1)."""
    require_binaries("mpirun", "orted", why="Open MPI mpirun")
    lib = mpi4py_library()
    if lib is None or "Open MPI" not in lib:
        pytest.skip(f"needs mpi4py built for Open MPI (installed: {lib or 'none'})")
    world, names = _expect(netns_hosts)
    tag = new_tag()
    cmd = _openmpi_mpirun_cmd(
        netns_hosts, str(INFRA / "rsh_hostexec.sh"), worker_cmd(python_for_hosts(), tag, world, PER_NODE, names)
    )
    r = launch(cmd, env=clean_env(), timeout=LAUNCH_TIMEOUT, tag=tag, netns=names)
    check_world(r, world, PER_NODE, names)
    assert f"MASTER_ADDR={netns_hosts.addrs[names[0]]} (rank 0's address, MPI-broadcast)" in r.stderr, r.report()
