"""backend="mpi" across the network-namespace hosts h1..h3 with Open MPI's mpirun (2 ranks per host).

Run as root under the infra lock: ``flock /tmp/procgroup-infra.lock env PYTHONPATH=$PWD/src python -m pytest
tests/mpi/test_mpi_multihost.py``.  Each host's own name resolves to 127.0.1.1 there (Debian's /etc/hosts);
the mpirun on h1 starts orted on h2 and h3 through infra/rsh_hostexec.sh, and procgroup's store address
comes from mpi4py (rank 0 broadcasts the address of its interface that routes to the other hosts).  Skipped
where the namespaces cannot be made (not root) or Open MPI is missing.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from ..infra.fixtures import NetnsHosts, SlurmCluster, host_list, require_binaries
from ..infra.launch import INFRA, REPO, clean_env, launch, new_tag

pytestmark = [pytest.mark.infra, pytest.mark.timeout(300, method="signal")]

PER_NODE = 2


def _run(hosts: NetnsHosts, *args: str, timeout: float = 200.0, per_node: int = PER_NODE, program=None):
    require_binaries("mpirun", "orted", why="Open MPI mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install 'procgroup[mpi]'")
    tag = new_tag()
    fwd = ["PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "PROCGROUP_TIMEOUT", "MPI4PY_MPIABI"]
    cmd = hosts.cmd(
        hosts.names[0],
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-H",
        host_list(hosts.names, per_node),
        "--mca",
        "plm_rsh_agent",
        str(INFRA / "rsh_hostexec.sh"),
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "10.77.0.0/24",
        "--mca",
        "oob_tcp_if_include",
        "10.77.0.0/24",
        *[a for v in fwd for a in ("-x", v)],
        *(program or [sys.executable, "-m", "tests.mpi.workers"]),
        *args,
        tag,
    )
    env = clean_env({"MPI4PY_MPIABI": "openmpi"})
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
    return launch(cmd, env=env, timeout=timeout, tag=tag, netns=hosts.names)


def test_reference_collectives_across_three_hosts(netns_hosts: NetnsHosts):
    world = PER_NODE * len(netns_hosts.names)
    r = _run(netns_hosts, "collectives")
    ctx = r.report()
    assert not r.timed_out and r.returncode == 0 and not r.leftovers, ctx
    for rank in range(world):
        assert re.search(rf"rank {rank}: \d+ checks passed", r.stdout), ctx
    assert f"MASTER_ADDR={netns_hosts.addrs[netns_hosts.names[0]]}" in r.stderr, ctx


def test_procgroup_run_agents_across_three_hosts(netns_hosts: NetnsHosts):
    """`mpirun -H h1:1,h2:1,h3:1 procgroup run --nproc-per-node 2 ...` with no --nnodes/--node-rank/--master-addr:
    the agents take node rank and count from the MPI job and meet on mpirun's host; one world of 6 workers
    (backend="cpu": the workers are not MPI processes)."""
    require_binaries("mpirun", "orted", why="Open MPI mpirun")
    prog = [sys.executable, "-m", "procgroup", "run", "--nproc-per-node", str(PER_NODE), "-m", "tests.mpi.workers"]
    r = _run(netns_hosts, "agent_worker", "cpu", per_node=1, program=prog)
    world = PER_NODE * len(netns_hosts.names)
    ctx = r.report()
    assert not r.timed_out and not r.leftovers and r.returncode == 0, ctx
    for rank in range(world):
        assert re.search(rf"rank {rank}: agent worker ok on (cpu|gloo) \({world} ranks\)", r.stdout), ctx


def test_what_mpi_lacks_and_p2p_across_three_hosts(netns_hosts: NetnsHosts):
    """AVG, bfloat16, float16, bool, NaN, a subgroup of ranks 1..5, p2p beyond MPI's tag space."""
    world = PER_NODE * len(netns_hosts.names)
    r = _run(netns_hosts, "extras")
    ctx = r.report()
    assert not r.timed_out and r.returncode == 0 and not r.leftovers, ctx
    for rank in range(world):
        assert re.search(rf"rank {rank}: \d+ extra checks passed", r.stdout), ctx


# ``srun --mpi=pmix`` needs a per-node TmpFS (infra/slurm_up.sh sets ``TmpFS=.../tmp/%n``): the namespace hosts
# share /tmp, and slurmstepd's pmix plugin makes spmix_appdir_<uid>_<job>.<step> under TmpFS on every node, so with
# a shared /tmp the second node's step failed with EEXIST.  Debian's Open MPI has no Slurm PMI-2 support, so the
# pmi2 run uses MPICH, and the pmix run Open MPI.
@pytest.mark.parametrize("pmi, abi", [("pmi2", "mpich"), ("pmix", "openmpi")])
def test_srun_mpi(slurm_cluster: SlurmCluster, pmi: str, abi: str, tmp_path):
    """``srun --mpi=pmi2`` (MPICH) / ``--mpi=pmix`` (Open MPI) ``-N3 -n6``: the reference suite, Slurm wiring MPI up."""
    hosts = slurm_cluster.hosts
    world = PER_NODE * len(hosts.names)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install 'procgroup[mpi]'")
    tag = new_tag()
    cmd = slurm_cluster.cmd(
        "srun",
        f"--mpi={pmi}",
        "--kill-on-bad-exit=1",
        f"-N{len(hosts.names)}",
        f"-n{world}",
        sys.executable,
        "-m",
        "tests.mpi.workers",
        "collectives",
        tag,
    )
    extra = {"MPI4PY_MPIABI": abi, "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "10.77.0.0/24"}
    if abi == "mpich":
        from .conftest import mpich

        f = mpich(tmp_path)
        if f is None:
            pytest.skip("MPICH not installed")
        extra.update(f.env)
    env = slurm_cluster.env(clean_env(extra))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
    r = launch(cmd, env=env, timeout=200, tag=tag, netns=hosts.names)
    ctx = r.report()
    assert not r.timed_out and r.returncode == 0 and not r.leftovers, ctx
    for rank in range(world):
        assert re.search(rf"rank {rank}: \d+ checks passed", r.stdout), ctx
