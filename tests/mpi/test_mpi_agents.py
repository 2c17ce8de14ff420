"""`mpirun -n 2 procgroup run ...`: one procgroup agent per node under MPI (issue 13 item B).

The agents are MPI processes, their workers are not and cannot become ones with Debian's MPIs (docs/mpi.md,
"Workers of procgroup run under mpirun"): a worker that asks for backend="mpi" fails at once with a
ConfigError saying what to do, and backend="cpu" works across the agents.  Under Open MPI and MPICH.
"""

from __future__ import annotations

import re
import sys

import pytest

from procgroup.netutil import free_port

from ..infra.launch import Launch, clean_env, launch, new_tag

#: each agent's node rank is its MPI rank (Open MPI's mpirun / MPICH's Hydra)
_AGENT = (
    'exec "$0" -m procgroup run --nnodes 2 --nproc-per-node 2 --node-rank "${OMPI_COMM_WORLD_RANK:-$PMI_RANK}" '
    '--master-addr 127.0.0.1 --master-port "$1" -m tests.mpi.workers agent_worker "$2" "$3"'
)


def _agents(flavour, backend: str) -> Launch:
    tag = new_tag()
    cmd = [*flavour.argv, "-n", "2", "sh", "-c", _AGENT, sys.executable, str(free_port()), backend, tag]
    env = clean_env(flavour.env)
    return launch(cmd, env=env, timeout=100, tag=tag)


@pytest.mark.timeout(120)
def test_mpi_backend_in_workers_of_agents_under_mpi_fails_at_once(flavour):
    """Every worker raises ConfigError naming the agent's inherited MPI rank and the fix, within seconds
    (before: Open MPI aborted each worker inside MPI_Init_thread, with no Python error)."""
    r = _agents(flavour, "mpi")
    assert not r.timed_out and not r.leftovers, r.report()
    got = re.findall(r"rank (\d): ConfigError after ([\d.]+)s: (.*)", r.stdout)
    assert got, r.report()
    for _rank, secs, msg in got:
        assert "runs under an MPI launcher" in msg and "is the agent's MPI rank" in msg, r.report()
        assert "Use backend='cpu'" in msg and "mpirun -np N python train.py" in msg, r.report()
        assert float(secs) < 5.0, r.report()
    assert r.returncode != 0, r.report()


@pytest.mark.timeout(120)
def test_cpu_backend_in_workers_of_agents_under_mpi(flavour):
    """The same agents, workers on backend="cpu": one world of 4 ranks, closed-form results."""
    r = _agents(flavour, "cpu")
    assert not r.timed_out and not r.leftovers and r.returncode == 0, r.report()
    for rank in range(4):
        # get_backend() says "gloo" for the cpu backend (torch.distributed's name)
        assert re.search(rf"rank {rank}: agent worker ok on (cpu|gloo) \(4 ranks\)", r.stdout), r.report()


@pytest.mark.timeout(120)
def test_agents_under_mpi_form_one_job_with_no_flags(flavour):
    """`mpirun -n 2 procgroup run --nproc-per-node 2 ...` with no --nnodes/--node-rank/--master-addr: the agents
    take their node rank and count from the MPI job (one world of 4). Before: two separate 2-rank jobs that both
    "succeeded"."""
    tag = new_tag()
    cmd = [
        *flavour.argv,
        "-n",
        "2",
        sys.executable,
        "-m",
        "procgroup",
        "run",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.mpi.workers",
        "agent_worker",
        "cpu",
        tag,
    ]
    # MASTER_PORT only to keep parallel jobs apart (Hydra has no job id to derive one from)
    env = clean_env({**flavour.env, "MASTER_PORT": str(free_port())})
    r = launch(cmd, env=env, timeout=100, tag=tag)
    assert not r.timed_out and not r.leftovers and r.returncode == 0, r.report()
    for rank in range(4):
        assert re.search(rf"rank {rank}: agent worker ok on (cpu|gloo) \(4 ranks\)", r.stdout), r.report()
    assert "node rank 0 of 2 agents" in r.stdout + r.stderr, r.report()


def test_which_processes_are_workers_of_an_agent_under_mpi():
    """The worker of an agent launcher (run id and RANK) with an MPI launcher's rank variable; not an MPI rank
    itself (no run id), nor a worker of an agent that no MPI started."""
    from procgroup.config import mpi_rank_of_agent

    worker = {"PROCGROUP_RUN_ID": "j", "RANK": "3"}
    assert mpi_rank_of_agent({**worker, "OMPI_COMM_WORLD_RANK": "1"}) == "OMPI_COMM_WORLD_RANK=1"
    assert mpi_rank_of_agent({**worker, "PMI_RANK": "0"}) == "PMI_RANK=0"
    assert mpi_rank_of_agent({**worker, "PMIX_RANK": "2"}) == "PMIX_RANK=2"
    assert mpi_rank_of_agent({"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "PMI_RANK": "1"}) == "PMI_RANK=1"
    assert mpi_rank_of_agent(worker) is None
    assert mpi_rank_of_agent({"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1"}) is None
    assert mpi_rank_of_agent({"PROCGROUP_RUN_ID": "j", "OMPI_COMM_WORLD_RANK": "1"}) is None
