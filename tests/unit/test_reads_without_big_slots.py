"""A group of one host without big slots (``PROCGROUP_SHM_BIG_SLOT=0``, a host's fifth group, a small /dev/shm) reads
its collectives above the arena's slot instead of sending messages (pass 24): all_reduce and reduce_scatter by
one-copy reads (``onecopy.allreduce_onecopy``, ``reduce_scatter_onecopy``: each rank reads its slice of every other
rank's buffer, reduces it in member order and, for all_reduce, reads the others' reduced slices back after a middle
exchange), broadcasts above ``ONECOPY_MIN['broadcast']`` and every all_gather (``bcast_direct``,
``allgather_direct``).

Ranks as threads over the shm transport, the selection's own tables (nothing patched), the compiled call
(``Arena.bind_reduce_read``) and the pure-Python protocol, and one rank on each in the same call; every dtype and op
with closed-form values, bit-identical on every rank; sizes that are not whole 64-byte lines and slices that are
empty; reduce_scatter into its own block of ``sendbuf`` and into a buffer overlapping another block; a rank that cannot
read sends every rank to the messages; a group with big slots keeps them.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, Iterator, List

import numpy as np
import pytest

from procgroup.algorithms import limits, onecopy, select
from procgroup.algorithms.comm import Comm, ScratchPool
from procgroup.config import ShmOptions
from procgroup.deadline import Deadline
from procgroup.ops import ReduceOp, finalize
from procgroup.transport import Transport, _cma
from procgroup.transport.shm import arena as shm_arena

from .test_algorithms import DTYPES, OPS, check_reduced, contrib, expected, kernel, valid
from .test_transport_conformance import _form, _segments, run_ranks

pytestmark = pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here")

#: the compiled call on every rank, the pure-Python protocol on every rank, or rank 0 on the Python one and the
#: others compiled (the two must meet in one call)
PATHS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not shm_arena.native_available(), reason="the compiled arena was not built"),
    ),
    "python",
    pytest.param(
        "mixed",
        marks=pytest.mark.skipif(not shm_arena.native_available(), reason="the compiled arena was not built"),
    ),
]


@pytest.fixture(params=PATHS)
def world(request: Any) -> Iterator[Callable[[int], List[Transport]]]:
    """A factory of shm worlds without big slots (ranks as threads), closed afterwards and checked for leaks."""
    job = f"rrd-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int) -> List[Transport]:
        ts = _form("shm", n, job, shm_options=ShmOptions(big_slot=0, native=request.param != "python"))
        made.extend(ts)
        return ts

    factory.path = request.param  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    assert _segments(job) == [], "shared memory segments leaked"


def _run(world: Any, ts: List[Transport], fn: Callable[[int, Callable[[int], Comm]], None]) -> None:
    """``fn(rank, make)`` on every rank of ``ts`` (``world``'s), rank 0 on the Python protocol in a "mixed" world."""
    p = len(ts)

    def body(t: Transport) -> None:
        a = t.arena(0, list(range(p)))
        assert a is not None and a.big is None
        if world.path == "mixed" and t.rank == 0:
            a.bind_reduce_read = lambda mode: None  # type: ignore[method-assign]
        pool = ScratchPool()

        def make(tag: int) -> Comm:
            return Comm(t, list(range(p)), t.rank, tag, Deadline.after(30.0), scratch=pool, arena=a)

        fn(t.rank, make)

    run_ranks(ts, body, 60.0)


def _count(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Calls that read (``select``'s allreduce_onecopy / reduce_scatter_onecopy returned True), that declined, and of
    the message algorithms, over all ranks."""
    seen = {"read": 0, "declined": 0, "messages": 0, "tree": 0, "scatter_gather": 0}
    for name in ("allreduce_onecopy", "reduce_scatter_onecopy"):
        real = getattr(select, name)

        def counted(*a: Any, real: Any = real) -> bool:
            got = real(*a)
            seen["read" if got else "declined"] += 1
            return bool(got)

        monkeypatch.setattr(select, name, counted)
    for name in ("allreduce_recursive_doubling", "allreduce_ring", "reduce_scatter_allreduce", "reduce_scatter_ring"):
        real = getattr(select, name)

        def msgs(*a: Any, real: Any = real) -> None:
            seen["messages"] += 1
            real(*a)

        monkeypatch.setattr(select, name, msgs)
    for name, key in (("reduce_binomial", "tree"), ("reduce_scatter_gather", "scatter_gather")):
        real = getattr(select, name)

        def red(*a: Any, real: Any = real, key: str = key) -> None:
            seen[key] += 1
            real(*a)

        monkeypatch.setattr(select, name, red)
    return seen


def _cases() -> List[Any]:
    """(dtype, op, elements): every dtype with SUM at sizes above the arena's slot (whole lines and not), every other
    valid op at one size."""
    cases = [(dt, ReduceOp.SUM, n) for dt in DTYPES for n in (33_000, 70_001)]
    return cases + [(dt, op, 40_003) for dt in DTYPES for op in OPS if op is not ReduceOp.SUM and valid(op, dt)]


def test_the_tables_read_only_where_the_big_slots_do_not_take_the_call() -> None:
    for coll in ("all_reduce", "reduce_scatter"):
        assert limits.ONECOPY_MIN[coll] == 0 and limits.ONECOPY_MIN_PAIR[coll] == 0
        assert coll not in limits.BIG_MIN_PAIR and limits.big_limit(coll, 2) >= 1 << 62  # big slots: every size
    assert select.ALGORITHMS["all_reduce"]["reads"] is select.allreduce_reads
    assert select.ALGORITHMS["reduce_scatter"]["reads"] is select.reduce_scatter_reads
    # a group with big slots reads its broadcasts and all_gathers only above BIG_LIMIT, where the reads overtake the
    # big slots: ONECOPY_MIN (below it) decides only for a group without them, between the reads and the messages
    for coll in ("broadcast", "all_gather"):
        assert limits.ONECOPY_MIN[coll] < limits.BIG_LIMIT[coll]
    assert limits.ONECOPY_MIN["all_gather"] == 0 and limits.ONECOPY_MIN["broadcast"] == 64 << 10


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_reduce_every_dtype_and_op_by_reads(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count(monkeypatch)
    ts = world(p)
    cases = _cases()
    got: List[List[bytes]] = [[] for _ in range(p)]
    reads: List[int] = [0] * p

    def body(r: int, make: Callable[[int], Comm]) -> None:
        nat = getattr(make(0).arena, "_nat", None)
        before = nat.rd_calls if nat is not None else 0
        for k, (dt, op, n) in enumerate(cases):
            buf = contrib(dt, op, r, n)
            select.all_reduce(make(k + 1), buf, kernel(op, dt))
            got[r].append(buf.tobytes())
            finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
            check_reduced(dt, op, p, buf, f"case {k} {dt} {op.name} n={n} rank {r}/{p}")
        reads[r] = (nat.rd_calls if nat is not None else 0) - before

    _run(world, ts, body)
    assert all(g == got[0] for g in got), "ranks disagree on the bits"
    assert seen == {"read": p * len(cases), "declined": 0, "messages": 0, "tree": 0, "scatter_gather": 0}
    if world.path == "native":  # the compiled call ran every case with a compiled kernel (f32/f64/i32/i64 sum...)
        assert all(n > 0 for n in reads)
    if world.path == "python":
        assert reads == [0] * p
    if world.path == "mixed":
        assert reads[0] == 0 and all(n > 0 for n in reads[1:])


def test_slices_of_odd_sizes_and_empty_ones(world: Any) -> None:
    """A buffer of fewer 64-byte lines than ranks leaves some slices empty; sizes that are not whole lines end in a
    short one.  (The arena's slot takes the small ones in select, so the protocol is called straight.)"""
    p = 4
    ts = world(p)
    sizes = [1, 3, 17, 16 * 3 + 1, 1001, 33_001]  # int32 elements

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, n in enumerate(sizes):
            buf = contrib("int32", ReduceOp.SUM, r, n)
            assert onecopy.allreduce_onecopy(make(k + 1), buf, kernel(ReduceOp.SUM, "int32"))
            check_reduced("int32", ReduceOp.SUM, p, buf, f"n={n} rank {r}")

    _run(world, ts, body)
    assert [onecopy.slice_bounds(100, 4, j) for j in range(4)] == [(0, 0), (0, 64), (64, 64), (64, 100)]


@pytest.mark.parametrize("where", ["apart", "own-block", "other-block"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_reduce_scatter_by_reads(world: Any, p: int, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a buffer of its own, into this rank's own block of ``sendbuf`` (the compiled call reduces it where it
    lies), or into a buffer that overlaps another rank's block (the compiled call refuses it: the Python protocol
    writes it once every rank has read ``sendbuf``)."""
    seen = _count(monkeypatch)
    ts = world(p)
    cases = [(dt, op, m) for (dt, op, m) in _cases()[::3]]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, op, m) in enumerate(cases):
            send = contrib(dt, op, r, p * m + 5)  # longer than p blocks: the tail is not part of the call
            if where == "apart":
                recv = np.zeros(m, send.dtype)
            elif where == "own-block":
                recv = send[r * m : (r + 1) * m]
            else:
                recv = send[((r + 1) % p) * m + 1 : ((r + 1) % p) * m + 1 + m]
            select.reduce_scatter(make(k + 1), send[: p * m], recv, kernel(op, dt))
            finalize(op, recv, p, dtype="bfloat16" if dt == "bfloat16" else None)
            want = expected(dt, op, p, p * m)[r * m : (r + 1) * m]
            check_reduced(dt, op, p, recv, f"case {k} {dt} {op.name} m={m} rank {r}/{p} {where}", want)

    _run(world, ts, body)
    assert seen == {"read": p * len(cases), "declined": 0, "messages": 0, "tree": 0, "scatter_gather": 0}


@pytest.mark.parametrize("p", [2, 3])
def test_a_rank_that_cannot_read_sends_every_rank_to_the_messages(
    world: Any, p: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _count(monkeypatch)
    ts = world(p)
    monkeypatch.setattr(ts[p - 1], "cma_pid", lambda rank: 0)  # the last rank cannot read: every rank falls back alike
    m = 20_000

    def body(r: int, make: Callable[[int], Comm]) -> None:
        buf = contrib("float32", ReduceOp.SUM, r, 2 * m)
        select.all_reduce(make(1), buf, kernel(ReduceOp.SUM, "float32"))
        check_reduced("float32", ReduceOp.SUM, p, buf, f"all_reduce rank {r}")
        send = contrib("int64", ReduceOp.MAX, r, p * m)
        recv = np.zeros(m, np.int64)
        select.reduce_scatter(make(2), send, recv, kernel(ReduceOp.MAX, "int64"))
        want = expected("int64", ReduceOp.MAX, p, p * m)[r * m : (r + 1) * m]
        check_reduced("int64", ReduceOp.MAX, p, recv, f"reduce_scatter rank {r}", want)

    _run(world, ts, body)
    assert seen == {"read": 0, "declined": 2 * p, "messages": 2 * p, "tree": 0, "scatter_gather": 0}


def test_a_group_with_big_slots_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reads are only the fallback of a group without big slots: with them, every size above the arena's slot
    takes the big slots (the reads lose to them on this VM: pass 24)."""
    from .test_bigarena import _run as run_big
    from .test_bigarena_oneway import shm_worlds

    seen = _count(monkeypatch)
    big: List[str] = []
    for name in ("allreduce_big", "reduce_scatter_big"):
        real = getattr(select, name)
        monkeypatch.setattr(select, name, lambda *a, real=real, name=name: (big.append(name), real(*a))[1])
    gen = shm_worlds(False, f"rrb-{uuid.uuid4().hex[:10]}")
    factory = next(gen)
    ts = factory(2)
    m = 40_000

    def body(r: int, make: Callable[[int], Comm]) -> None:
        buf = contrib("float64", ReduceOp.SUM, r, m)
        select.all_reduce(make(1), buf, kernel(ReduceOp.SUM, "float64"))
        check_reduced("float64", ReduceOp.SUM, 2, buf, f"rank {r}")
        recv = np.zeros(m, np.float64)
        select.reduce_scatter(
            make(2), contrib("float64", ReduceOp.SUM, r, 2 * m), recv, kernel(ReduceOp.SUM, "float64")
        )

    try:
        run_big(ts, body)
    finally:
        next(gen, None)
    assert seen["read"] == seen["declined"] == 0
    assert sorted(big) == ["allreduce_big"] * 2 + ["reduce_scatter_big"] * 2


@pytest.mark.parametrize("p", [3, 4])
def test_broadcasts_and_all_gathers_read_above_their_minimum(
    world: Any, p: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default tables: a broadcast above ``ONECOPY_MIN['broadcast']`` is read out of the root's buffer, one at
    it goes as messages; every all_gather above the arena's slot is read.  Closed-form values, every root."""
    seen = {"bcast": 0, "gather": 0, "messages": 0}
    for name, key in (("bcast_direct", "bcast"), ("allgather_direct", "gather")):
        real = getattr(select, name)
        monkeypatch.setattr(
            select, name, lambda *a, real=real, key=key: seen.__setitem__(key, seen[key] + 1) or real(*a)
        )
    real_choose = select.choose_broadcast
    monkeypatch.setattr(
        select, "choose_broadcast", lambda *a: seen.__setitem__("messages", seen["messages"] + 1) or real_choose(*a)
    )
    ts = world(p)
    edge = limits.ONECOPY_MIN["broadcast"]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        k = 0
        for n in (edge, edge + 8, 3 * edge + 1):
            for root in range(p):
                k += 1
                want = ((np.arange(n) * (root + 3) + k) % 251).astype(np.uint8)
                buf = want.copy() if r == root else np.zeros(n, np.uint8)
                select.broadcast(make(k), buf, root)
                assert buf.tobytes() == want.tobytes(), (n, root)
        for m in (40_000, 100_003):  # bytes a rank
            k += 1
            out = np.zeros(p * m, np.uint8)
            select.all_gather(make(k), ((np.arange(m) + 7 * r + k) % 253).astype(np.uint8), out)
            want = np.concatenate([((np.arange(m) + 7 * q + k) % 253).astype(np.uint8) for q in range(p)])
            assert out.tobytes() == want.tobytes(), m

    _run(world, ts, body)
    assert seen == {"bcast": p * 2 * p, "gather": p * 2, "messages": p * p}


def test_a_reduce_of_one_host_takes_the_tree_up_to_its_own_limit(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group without big slots sends its reduces as messages over shared memory: the binomial tree up to
    ``REDUCE_SMALL_SHM`` (above ``REDUCE_SMALL``, the limit between hosts), reduce-scatter + gather above it."""
    seen = _count(monkeypatch)
    p = 3
    ts = world(p)
    sizes = [select.REDUCE_SMALL + 8, select.REDUCE_SMALL_SHM, select.REDUCE_SMALL_SHM + 8]  # bytes of int64

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, nb in enumerate(sizes):
            for root in range(p):
                buf = contrib("int64", ReduceOp.SUM, r, nb // 8)
                mine = buf.tobytes()
                select.reduce(make(k * p + root + 1), buf, kernel(ReduceOp.SUM, "int64"), root)
                if r == root:
                    check_reduced("int64", ReduceOp.SUM, p, buf, f"{nb} bytes root {root}")
                else:
                    assert buf.tobytes() == mine

    _run(world, ts, body)
    assert seen["tree"] == 2 * p * p and seen["scatter_gather"] == p * p
