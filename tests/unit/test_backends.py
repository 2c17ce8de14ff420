"""The backend registry, a backend added from outside the library, and create_group (no global state)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import procgroup as dist
from procgroup import backends
from procgroup.config import RuntimeConfig
from procgroup.errors import ConfigError
from procgroup.netutil import free_port
from procgroup.store import HashStore

from ..backends import tcp_only
from ..conftest import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_builtin_names_registered():
    names = backends.names()
    assert names[:4] == ["cpu", "gloo", "mpi", "nccl"]
    assert tcp_only.NAME in names
    assert backends.lookup("GLOO") is backends.lookup("cpu")


def test_unknown_backend_lists_available_and_install():
    with pytest.raises(ConfigError) as ei:
        backends.lookup("carrier")
    msg = str(ei.value)
    assert "backend='carrier' is not one of 'cpu' (alias 'gloo'), 'mpi', 'nccl'" in msg
    assert "available here: 'cpu'" in msg and "'tcp_only'" in msg
    assert "pip install torch" in msg
    if _mpi_missing():
        assert "pip install 'procgroup[mpi]'" in msg


def _mpi_missing() -> bool:
    """True where the registered mpi backend is unavailable (mpi4py not installed)."""
    from procgroup.backends.mpi import MpiBackend

    return MpiBackend().unavailable_reason() is not None


def test_mpi_without_mpi4py_says_what_to_install(monkeypatch):
    """The mpi backend is registered; where mpi4py is missing, asking for it names the package and the MPI."""
    from procgroup.backends.mpi import MpiBackend

    b = MpiBackend()
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert b.unavailable_reason() == "backend='mpi' needs mpi4py, which is not installed"
    assert "pip install 'procgroup[mpi]'" in b.install_hint() and "openmpi-bin" in b.install_hint()


@pytest.mark.parametrize(
    "name, phrase",
    [
        ("nccl", "backend='nccl' needs CUDA devices and an NCCL binding"),
    ],
)
def test_unavailable_backend_says_why(name, phrase):
    with pytest.raises(ConfigError) as ei:
        backends.lookup(name)
    assert phrase in str(ei.value) and "available here: 'cpu'" in str(ei.value)


def test_register_refuses_a_taken_name():
    class Other(backends.Backend):
        names = ("cpu",)

    with pytest.raises(ConfigError, match="backend name 'cpu' is already registered by CpuBackend"):
        backends.register(Other())
    with pytest.raises(ConfigError, match="has no names"):
        backends.register(backends.Backend())


def test_init_with_a_backend_from_tests(monkeypatch):
    """init_process_group(backend=...) finds a backend registered by a folder outside the library."""
    if dist.is_initialized():
        pytest.skip("another test left the default process group initialized")
    monkeypatch.setenv("PROCGROUP_SECRET", "s")
    dist.init_process_group(
        backend=tcp_only.NAME, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=20
    )
    try:
        assert dist.get_backend() == tcp_only.NAME
        x = np.arange(4.0)
        dist.all_reduce(x)
        assert np.array_equal(x, np.arange(4.0))
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


_TWO_RANKS = textwrap.dedent("""
    import sys
    import numpy as np
    import procgroup as dist
    from tests.backends import tcp_only
    dist.init_process_group(backend=tcp_only.NAME, timeout=30)
    w = dist.group.WORLD.world
    assert dist.get_backend() == tcp_only.NAME, dist.get_backend()
    x = np.full(3, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    assert np.array_equal(x, np.full(3, 3.0)), x
    print("kind", w.transport.kind)
    dist.destroy_process_group()
""")


def test_two_processes_over_the_test_backend():
    """Two ranks on one host: the cpu backend would use shm; the test backend forces TCP."""
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PROCGROUP_SECRET="s",
            PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _TWO_RANKS],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        outs.append(out)
        assert p.returncode == 0, out
    assert all("kind tcp" in o for o in outs), outs


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_create_group_without_global_state(transport):
    """Three worlds formed over one store by threads; every kind of call takes them as group=."""
    n = 3
    store = HashStore()
    cfg = RuntimeConfig(transport=transport, secret="s")

    def body(r):
        pg = backends.create_group(
            "cpu", store=store, rank=r, world_size=n, timeout=20, config=cfg, job_id=f"cg-{transport}"
        )
        try:
            assert not dist.is_initialized() and dist.get_rank(pg) == r and dist.get_world_size(pg) == n
            x = np.full(4, float(r))
            dist.all_reduce(x, group=pg)
            assert np.array_equal(x, np.full(4, 3.0))
            b = np.array([r * 10])
            dist.broadcast(b, src=1, group=pg)
            assert b[0] == 10
            objs = [None] * n
            dist.all_gather_object(objs, {"r": r}, group=pg)
            assert objs == [{"r": i} for i in range(n)]
            if r == 0:
                dist.send(np.arange(3), dst=2, group=pg)
                dist.send_object_list(["hi", r], dst=2, group=pg)
            elif r == 2:
                got = np.zeros(3, np.int64)
                assert dist.recv(got, src=0, group=pg) == 0
                assert np.array_equal(got, np.arange(3))
                lst = [None, None]
                dist.recv_object_list(lst, src=0, group=pg)
                assert lst == ["hi", 0]
            dist.barrier(group=pg)
            sub = dist.split_group(pg, color=r % 2)
            y = np.ones(1)
            dist.all_reduce(y, group=sub)
            assert y[0] == (2 if r % 2 == 0 else 1)
            dist.barrier(group=pg)
        finally:
            backends.destroy_group(pg)

    run_ranks(n, body, timeout=60)
    assert not dist.is_initialized()
