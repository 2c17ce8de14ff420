"""The compiled one-copy reads (``Arena.bind_read``, ``_native_read.c``; all_to_all's in ``_native_a2a.c``), ranks as
threads over the shm transport: one C call offers, reads and closes, with the slots and check words of the Python
protocol (``algorithms.onecopy.read_directly``), so a rank on the compiled path and one on the Python path meet in
the same call; a rank that cannot read sends every rank of an all_gather or broadcast to the big slots; a read that
fails inside the C call is a named error on the reader, and its peers time out naming it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Any, Callable, Dict

import numpy as np
import pytest

from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms import onecopy, select
from procgroup.algorithms.comm import Comm
from procgroup.errors import DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.transport import _cma
from procgroup.transport.shm import _native as native_mod  # type: ignore[attr-defined]
from procgroup.transport.shm import arena as shm_arena

from .test_bigarena import _run
from .test_bigarena_oneway import shm_worlds

pytestmark = [
    pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here"),
    pytest.mark.skipif(not shm_arena.native_available(), reason="the compiled arena was not built"),
]

LIMIT = 50_000


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(select.BIG_LIMIT, "broadcast", LIMIT)
    monkeypatch.setitem(select.BIG_LIMIT, "all_gather", LIMIT)
    monkeypatch.setitem(select.BIG_LIMIT, "all_to_all", LIMIT)
    monkeypatch.setitem(select.ONECOPY_MIN, "broadcast", LIMIT)
    monkeypatch.setitem(select.ONECOPY_MIN, "all_gather", LIMIT)
    yield from shm_worlds(True, f"ocn-{uuid.uuid4().hex[:10]}")


def _part(q: int, n: int, dt: str, k: int) -> np.ndarray:
    return ((np.arange(n) * (q + 2) + k) % 97).astype(dt)


def _reads(ts: Any) -> Dict[int, int]:
    """Compiled calls that read, per rank (``Slots.rd_calls``)."""
    return {t.rank: sum(a._nat.rd_calls for a in t._arenas if a._nat is not None) for t in ts}


def test_the_compiled_call_uses_the_python_protocols_closing_salt() -> None:
    assert native_mod.END_SALT == onecopy.END_SALT


@pytest.mark.parametrize("p", [2, 3])
def test_a_compiled_and_a_python_rank_read_in_the_same_call(world: Any, p: int) -> None:
    ts = world(p)

    def body(r: int, make: Callable[..., Comm]) -> None:
        if r == 1:  # this rank runs onecopy's protocol in Python; the others the compiled call
            make(0).arena.bind_read = lambda mode: None  # type: ignore[method-assign]
        k = 0
        for n in (LIMIT + 1, 3 * LIMIT + 5):
            for dt in ("int8", "float64"):
                k += 1
                want = np.concatenate([_part(q, n, dt, k) for q in range(p)])
                out = np.full(p * n, 3, dt)
                select.all_gather(make(k), _part(r, n, dt, k), out)
                assert out.tobytes() == want.tobytes(), (n, dt)
                if p > 2:  # a pair's broadcast has its own split (onecopy.bcast_pair); three or more read the root
                    for root in range(p):
                        k += 1
                        buf = _part(root, n, dt, k) if r == root else np.zeros(n, dt)
                        if r == root:
                            buf.flags.writeable = False  # the root only offers its buffer: read-only will do
                        select.broadcast(make(k), buf, root)
                        assert buf.tobytes() == _part(root, n, dt, k).tobytes(), (n, dt, root)

    _run(ts, body)
    got = _reads(ts)
    assert got[1] == 0 and all(got[r] > 0 for r in range(p) if r != 1), got


@pytest.mark.parametrize("p", [2, 3])
def test_a_group_that_cannot_read_takes_the_big_slots(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = world(p)
    monkeypatch.setattr(ts[1], "cma_pid", lambda rank: 0)  # rank 1 cannot read the others: all must fall back alike
    big = {"allgather_big": 0, "bcast_big": 0}
    for name in big:
        real = getattr(select, name)

        def counted(*a: Any, real: Any = real, name: str = name) -> None:
            big[name] += 1
            real(*a)

        monkeypatch.setattr(select, name, counted)
    sizes = (40_000, 200_001)  # above BIG_LIMIT / ONECOPY_MIN (and a pair's): the reads, or every rank falls back

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, n in enumerate(sizes, 1):
            out = np.zeros(p * n, np.int32)
            select.all_gather(make(k), _part(r, n, "int32", k), out)
            assert out.tobytes() == np.concatenate([_part(q, n, "int32", k) for q in range(p)]).tobytes(), n
            if p > 2:  # a broadcast among three or more above BIG_LIMIT: the reads' turn too (a pair splits it)
                buf = _part(0, n, "int32", k) if r == 0 else np.zeros(n, np.int32)
                select.broadcast(make(10 + k), buf, 0)
                assert buf.tobytes() == _part(0, n, "int32", k).tobytes(), n

    _run(ts, body)
    assert big == {"allgather_big": p * len(sizes), "bcast_big": p * len(sizes) if p > 2 else 0}, big
    assert not any(_reads(ts).values()), _reads(ts)


@pytest.mark.parametrize("op", ["all_gather", "all_to_all"])
def test_a_failed_compiled_read_is_named_and_the_peer_times_out(world: Any, op: str) -> None:
    ts = world(2)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer exists: reading it fails with ESRCH inside the C call
    errors: Dict[int, BaseException] = {}
    n = 3 * LIMIT

    def body(r: int, make: Callable[..., Comm]) -> None:
        c = make(1, deadline=2.0)
        if r == 0:  # this rank's reads go to a dead process
            c.arena._nat.set_pids([os.getpid(), gone.pid])
        try:
            if op == "all_gather":
                select.all_gather(c, np.ones(n, np.int8), np.zeros(2 * n, np.int8))
            else:
                A2A.alltoall_shm(c, np.ones(n, np.int8), [n // 2] * 2, np.zeros(n, np.int8), [n // 2] * 2, None, LIMIT)
        except ProcGroupError as e:
            errors[r] = e

    _run(ts, body)
    assert isinstance(errors.get(0), PeerFailureError) and errors[0].peer == 1, errors
    assert "reading of rank 1: rank 1 died" in str(errors[0]), errors[0]
    assert isinstance(errors.get(1), DistTimeoutError), errors  # the closing exchange: rank 0 never came
