"""A group of two ranks of one host reads where its big slots' stores would meet the VM's slow mode (pass 23):
its broadcast from the arena's slot up to ``BIG_MIN_PAIR`` (the big slots above it, up to ``BIG_LIMIT_PAIR``), and
every all_to_all stream that is not inline in its header (``BIG_LIMIT_PAIR['all_to_all']`` is 0; the list form keeps
``BIG_LIMIT``).  Ranks as threads over the shm transport, the selection's own tables (nothing patched), the
compiled and the pure-Python arena; closed-form values for every root and several dtypes; a pair that cannot read
takes the big slots on both ranks; the host stages of a group spanning hosts keep the big slots.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict

import numpy as np
import pytest

from procgroup.algorithms import limits, select
from procgroup.algorithms.comm import Comm
from procgroup.transport import _cma
from procgroup.transport.shm import arena as shm_arena

from .test_bigarena import _run
from .test_bigarena_oneway import PATHS, shm_worlds

pytestmark = pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here")

FLOOR = limits.BIG_MIN_PAIR["broadcast"]


@pytest.fixture(params=PATHS)
def world(request: Any) -> Any:
    yield from shm_worlds(request.param, f"prd-{uuid.uuid4().hex[:10]}")


def _part(q: int, n: int, dt: str, k: int) -> np.ndarray:
    return ((np.arange(n) * (q + 3) + k) % 101).astype(dt)


def _count(monkeypatch: pytest.MonkeyPatch, *names: str) -> Dict[str, int]:
    """Calls of ``select``'s ``names`` (for bcast_direct: only the ones that read; a declined read counts as
    ``declined``)."""
    seen = {n: 0 for n in names}
    seen["declined"] = 0
    for name in names:
        real = getattr(select, name)

        def counted(*a: Any, real: Any = real, name: str = name) -> Any:
            got = real(*a)
            seen[name if got is not False else "declined"] += 1
            return got

        monkeypatch.setattr(select, name, counted)
    return seen


def test_the_tables_say_what_the_pair_does() -> None:
    assert select.BIG_MIN_PAIR is limits.BIG_MIN_PAIR and select.BIG_LIMIT is limits.BIG_LIMIT  # one table each
    assert 32 << 10 < FLOOR < limits.big_limit("broadcast", 2) <= limits.big_limit("broadcast", 3)
    assert limits.big_limit("all_to_all", 2) == 0 < limits.big_limit("all_to_all", 3)
    assert limits.ONECOPY_MIN_PAIR["broadcast"] == 0


def test_a_pairs_broadcast_is_read_below_the_floor_and_big_above(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count(monkeypatch, "bcast_direct", "bcast_big")
    ts = world(2)
    sizes = [40_000, 100_003, FLOOR, FLOOR + 4, 3 * FLOOR + 1]  # bytes (int8), then as many elements of float64

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for n in sizes:
            for dt in ("int8", "float64"):
                for root in (0, 1):
                    k += 1
                    want = _part(root, n, dt, k)
                    buf = want.copy() if r == root else np.full(n, 7, dt)
                    select.broadcast(make(k), buf, root)
                    assert buf.tobytes() == want.tobytes(), (n, dt, root)

    _run(ts, body)
    nbytes = [n * np.dtype(dt).itemsize for n in sizes for dt in ("int8", "float64")]
    reads = sum(2 * 2 for b in nbytes if b <= FLOOR)  # two roots, two ranks each
    big = sum(2 * 2 for b in nbytes if FLOOR < b <= limits.big_limit("broadcast", 2))  # above: the split
    assert seen == {"bcast_direct": reads, "bcast_big": big, "declined": 0}, seen
    assert reads == 3 * 4 and big == 6 * 4, (reads, big)  # both sides of the floor, each more than once


def test_a_pair_that_cannot_read_takes_the_big_slots_on_both_ranks(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count(monkeypatch, "bcast_direct", "bcast_big")
    ts = world(2)
    monkeypatch.setattr(ts[1], "cma_pid", lambda rank: 0)  # rank 1 cannot read rank 0: both must fall back alike

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, n in enumerate((40_000, FLOOR), 1):
            want = _part(0, n, "int32", k)
            buf = want.copy() if r == 0 else np.zeros(n, np.int32)
            select.broadcast(make(k), buf, 0)
            assert buf.tobytes() == want.tobytes(), n

    _run(ts, body)
    # 40_000 int32 is 160 KB (below the floor: the reads' turn, declined, then the big slots); FLOOR int32 is above
    assert seen == {"bcast_direct": 0, "bcast_big": 4, "declined": 2}, seen


def _rd_calls(ts: Any) -> int:
    return sum(a._nat.rd_calls for t in ts for a in t._arenas if getattr(a, "_nat", None) is not None)


@pytest.mark.parametrize("per_rank", [64 << 10, 256 << 10, 1 << 20])
def test_a_pairs_all_to_all_reads_every_stream_beyond_its_header(world: Any, per_rank: int) -> None:
    ts = world(2)
    n = per_rank // 4
    turns: Dict[int, int] = {}

    def body(r: int, make: Callable[..., Comm]) -> None:
        c = make(1)
        before = c.arena.big.turn
        for k in range(3):
            send = _part(r, n, "float32", k)
            out = np.full(n, -1, np.float32)
            select.all_to_all(make(k + 1), send, [n // 2] * 2, out, [n // 2] * 2)
            want = np.concatenate([_part(q, n, "float32", k)[r * (n // 2) : (r + 1) * (n // 2)] for q in (0, 1)])
            assert out.tobytes() == want.tobytes(), (per_rank, k)
        turns[r] = c.arena.big.turn - before

    _run(ts, body)
    assert turns == {0: 0, 1: 0}, turns  # no call went through the big slots
    if shm_arena.native_available() and all(getattr(t._arenas[0], "_nat", None) is not None for t in ts):
        assert _rd_calls(ts) == 2 * 3, _rd_calls(ts)  # each rank read in every call, inside the compiled call


def test_the_list_form_keeps_the_big_slots_on_a_pair(world: Any) -> None:
    ts = world(2)
    n = (64 << 10) // 4
    turns: Dict[int, int] = {}

    def body(r: int, make: Callable[..., Comm]) -> None:
        c = make(1)
        before = c.arena.big.turn
        send = _part(r, n, "float32", 5)
        out = np.full(n, -1, np.float32)
        select.all_to_all(make(2), send, [n // 2] * 2, out, [n // 2] * 2, lists=True)
        want = np.concatenate([_part(q, n, "float32", 5)[r * (n // 2) : (r + 1) * (n // 2)] for q in (0, 1)])
        assert out.tobytes() == want.tobytes()
        turns[r] = c.arena.big.turn - before

    _run(ts, body)
    assert turns[0] > 0 and turns[0] == turns[1], turns
