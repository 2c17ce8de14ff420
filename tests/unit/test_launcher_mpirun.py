"""``mpirun -n N procgroup run ...``: the agents of an MPI job form one job (procgroup.launcher.mpirun).

Before, each agent took itself for a one-node job: ``mpirun -n 2 procgroup run --nproc-per-node 2`` ran two
separate 2-rank worlds that both "succeeded".  Environments as Open MPI 4.1.4 and MPICH 4.0.2's Hydra set them.
"""

from __future__ import annotations

import pytest

from procgroup.errors import ConfigError
from procgroup.launcher.cli import parse_args
from procgroup.launcher.mpirun import detect_mpirun_agents

pytestmark = pytest.mark.timeout(30)


def ompi(rank: int, size: int, local_size: int, **extra: str) -> dict:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_MCA_ess_base_jobid": "189202433",
        "OMPI_MCA_orte_hnp_uri": "189202432.0;tcp://192.0.2.2:46233;tcp6://[fd00::2]:40483",
    }
    env.update(extra)
    return env


def hydra(rank: int, size: int, local_size: int) -> dict:
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(size),
        "MPI_LOCALRANKID": str(rank % local_size),
        "MPI_LOCALNRANKS": str(local_size),
        "PMI_FD": "6",
        "HYDI_CONTROL_FD": "7",
    }


def test_open_mpi_agents_on_one_host() -> None:
    a = detect_mpirun_agents(ompi(1, 2, 2))
    assert a is not None and (a.node_rank, a.nnodes, a.master_addr) == (1, 2, "127.0.0.1")
    assert a.master_port == detect_mpirun_agents(ompi(0, 2, 2)).master_port  # same port on every agent
    c = parse_args(["--nproc-per-node", "2", "train.py"], environ=ompi(1, 2, 2))
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (2, 1, "127.0.0.1", a.master_port)
    assert c.world_size == 4 and any("OMPI_COMM_WORLD_RANK=1" in n for n in c.notes)


def test_open_mpi_agents_on_several_hosts_meet_on_mpiruns_host() -> None:
    c = parse_args(["--nproc-per-node", "4", "train.py"], environ=ompi(2, 3, 1))
    assert (c.nnodes, c.node_rank, c.master_addr) == (3, 2, "192.0.2.2")


def test_exported_master_wins() -> None:
    env = ompi(0, 3, 1, MASTER_ADDR="h1", MASTER_PORT="31000")
    c = parse_args(["train.py"], environ=env)
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (3, 0, "h1", 31000)
    c = parse_args(["--master-addr", "h2", "--master-port", "32000", "train.py"], environ=ompi(0, 3, 1))
    assert (c.nnodes, c.master_addr, c.master_port) == (3, "h2", 32000)


def test_hydra_agents_on_one_host() -> None:
    c = parse_args(["--nproc-per-node", "2", "train.py"], environ=hydra(0, 2, 2))
    assert (c.nnodes, c.node_rank, c.master_addr) == (2, 0, "127.0.0.1")


def test_hydra_agents_on_several_hosts_without_a_master_say_what_to_pass() -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(["train.py"], environ=hydra(1, 2, 1))
    msg = str(e.value)
    assert "mpiexec (MPICH/Hydra)" in msg and "agent 1 of 2" in msg and "MASTER_ADDR" in msg and "--master-addr" in msg


def test_explicit_nnodes_or_node_rank_turn_detection_off() -> None:
    c = parse_args(["--nnodes", "2", "--node-rank", "0", "train.py"], environ=ompi(1, 2, 2))
    assert (c.nnodes, c.node_rank) == (2, 0)
    assert parse_args(["--standalone", "train.py"], environ=ompi(1, 2, 2)).nnodes == 1


def test_not_an_mpi_job_of_several() -> None:
    assert detect_mpirun_agents({}) is None
    assert detect_mpirun_agents(ompi(0, 1, 1)) is None  # mpirun -n 1: a one-node job, as before
    assert detect_mpirun_agents({**ompi(1, 2, 2), "RANK": "1", "WORLD_SIZE": "2"}) is None  # a worker's env
    assert parse_args(["train.py"], environ=ompi(0, 1, 1)).nnodes == 1
