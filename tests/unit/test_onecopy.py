"""One-copy reads (``algorithms.onecopy``, issue 14): all_to_all's pieces above the streams' limit and broadcasts above
the big slots' limit read straight out of their owners' buffers.

Ranks as threads over the shm transport (compiled and pure-Python arena): above ``BIG_LIMIT['all_to_all']`` every
rank reads its pieces from every sender's ``sendbuf`` with one process_vm_readv each (``Arena.reader``), and above
``BIG_LIMIT['broadcast']`` and ``ONECOPY_MIN['broadcast']`` (``ONECOPY_MIN_PAIR`` for two) every reader the root's
buffer, after one arena exchange of addresses (all_to_all: the headers offer them, where every sender wrote its
offer) and before one that ends the call; an all_gather above ``ONECOPY_MIN`` (``ONECOPY_MIN_PAIR`` for two ranks)
every other rank's part. Closed-form values for equal, uneven and zero splits, every dtype and every root; a rank
that cannot read the others (or CMA off) sends every rank to the message algorithms; two ranks split a broadcast
above ``PAIR_SPLIT_MIN`` between them (the root writes half into the other rank's buffer with process_vm_writev,
``Arena.writer``, while it reads the other half) and fall back where either cannot; the memory transport has no
reader; a read or write of a dead or unreadable peer is a named error.
"""

from __future__ import annotations

import errno
import time
import uuid
from typing import Any, Callable

import numpy as np
import pytest

from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms import limits, onecopy, select
from procgroup.algorithms.comm import Comm
from procgroup.errors import BrokenError, PeerFailureError, ProcGroupError
from procgroup.transport import _cma
from procgroup.transport.base import address_of
from procgroup.transport.shm import arena as shm_arena

from .test_algorithms import DTYPES
from .test_alltoall_shm import _check_a2a, _equal, _mixed, _select, _uneven
from .test_bigarena import _run
from .test_bigarena_oneway import shm_worlds
from .test_transport_conformance import _form

pytestmark = pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here")

LIMIT = 50_000  # bytes of a stream: longer ones are read directly


@pytest.fixture(params=["native", "python"])
def world(request: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    if request.param == "native" and not shm_arena.native_available():
        pytest.skip("the compiled arena was not built")
    monkeypatch.setitem(select.BIG_LIMIT, "all_to_all", LIMIT)
    monkeypatch.setitem(select.BIG_LIMIT, "broadcast", LIMIT)
    monkeypatch.setitem(select.BIG_LIMIT, "all_gather", LIMIT)
    monkeypatch.setitem(select.ONECOPY_MIN, "broadcast", LIMIT)
    monkeypatch.setitem(select.ONECOPY_MIN, "all_gather", LIMIT)
    monkeypatch.setitem(select.ONECOPY_MIN_PAIR, "all_gather", LIMIT)
    yield from shm_worlds(request.param == "native", f"a2ad-{uuid.uuid4().hex[:10]}")


def _count(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Counters of the direct reads' outcomes and of the message path, over all ranks."""
    seen = {"offered": 0, "direct": 0, "declined": 0, "messages": 0}
    real_offered, real_direct, real_msgs = A2A._offered_reads, A2A._direct_reads, A2A._messages

    def offered(*a: Any) -> bool:  # the reads the headers offered (no exchange of addresses); else the next
        ok = real_offered(*a)
        seen["offered"] += ok
        return ok

    def direct(*a: Any) -> bool:
        ok = real_direct(*a)
        seen["direct" if ok else "declined"] += 1
        return ok

    def msgs(*a: Any) -> None:
        seen["messages"] += 1
        real_msgs(*a)

    monkeypatch.setattr(A2A, "_offered_reads", offered)
    monkeypatch.setattr(A2A, "_direct_reads", direct)
    monkeypatch.setattr(A2A, "_messages", msgs)
    return seen


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pieces_above_the_limit_are_read_from_the_senders(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count(monkeypatch)
    ts = world(p)
    cases = [_equal(p, 40_000), _uneven(p, 30_000), _mixed(p), _equal(p, 7)]  # the last one inline

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, C in enumerate(cases):
            for dt in ("int8", "float64"):
                _check_a2a(r, make(2 * k + (dt == "int8") + 1), dt, C, k, _select)

    _run(ts, body)
    seen["offered"] += _compiled_reads(ts)
    assert seen["messages"] == 0 and seen["declined"] == 0 and seen["direct"] == 0, seen
    # every rank takes the same path: a multiple of p; the float64 cases are all above the limit; every stream is
    # offered in the headers (no exchange of addresses), a mixed call's (some streams inline) too: every rank offers
    assert seen["offered"] >= p * 3 and seen["offered"] % p == 0, seen


def _compiled_reads(ts: Any) -> int:
    """Calls that read out of other ranks' memory inside the compiled arena (``Slots.rd_calls``), over all ranks."""
    return sum(a._nat.rd_calls for t in ts for a in t._arenas if a._nat is not None)


def test_every_dtype(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count(monkeypatch)
    p = 3
    ts = world(p)

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, dt in enumerate(DTYPES):
            _check_a2a(r, make(k + 1), dt, _uneven(p, 20_000), k, _select)

    _run(ts, body)
    seen["offered"] += _compiled_reads(ts)
    assert seen["offered"] + seen["direct"] == p * len(DTYPES) and seen["messages"] == 0, seen


@pytest.mark.parametrize("how", ["one rank cannot read", "cma off"])
def test_a_rank_that_cannot_read_sends_every_rank_to_the_messages(
    world: Any, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _count(monkeypatch)
    p = 3
    ts = world(p, cma=how != "cma off")
    if how == "one rank cannot read":
        monkeypatch.setattr(ts[1], "cma_pid", lambda rank: 0)

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, C in enumerate([_equal(p, 40_000), _uneven(p, 30_000)]):
            _check_a2a(r, make(k + 1), "int16", C, k, _select)

    _run(ts, body)
    assert seen == {"offered": 0, "direct": 0, "declined": 2 * p, "messages": 2 * p}, seen


def test_the_memory_transport_has_no_reader() -> None:
    ts = _form("memory", 2, "x")
    assert ts[0].arena(0, [0, 1]).reader() is None  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["read", "write"])
def test_a_failed_read_or_write_is_a_named_error(world: Any, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ts = world(2)
    a = ts[0].arena(0, [0, 1])
    assert a is not None
    move = a.reader() if how == "read" else a.writer()
    assert move is not None
    buf = memoryview(bytearray(64))
    call = "process_vm_readv" if how == "read" else "process_vm_writev"
    with pytest.raises(BrokenError, match=f"{call} failed.*PROCGROUP_SHM_CMA=0"):
        move(1, buf, 8)  # an address that is not mapped: EFAULT

    def dead(*a: Any) -> None:
        raise OSError(errno.ESRCH, "No such process")

    monkeypatch.setattr(shm_arena._cma, how, dead)
    words = "reading 64 bytes of" if how == "read" else "writing 64 bytes to"
    with pytest.raises(PeerFailureError, match=f"{words} rank 1: rank 1 died") as ei:
        move(1, buf, 8)
    assert ei.value.peer == 1
    monkeypatch.setattr(shm_arena._cma, "can_write", lambda: False)  # forbidden here: no writer, the reader stays
    assert a.writer() is None and a.reader() is not None


def _count_bcast(monkeypatch: pytest.MonkeyPatch, name: str = "bcast_direct") -> Any:
    """Counters of ``select``'s calls of ``onecopy.<name>``: done, or declined (a rank could not read)."""
    seen = {"direct": 0, "declined": 0}
    real = getattr(onecopy, name)

    def counted(*a: Any) -> bool:
        ok = real(*a)
        seen["direct" if ok else "declined"] += 1
        return ok

    monkeypatch.setattr(select, name, counted)
    return seen


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_broadcast_above_the_limit_is_read_from_the_root(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_bcast(monkeypatch)
    ts = world(p)
    dts = ["int8", "float64", "float16", "int64"]

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for n in (LIMIT + 1, 3 * LIMIT + 7):
            for root in range(p):
                for dt in dts:
                    k += 1
                    want = ((np.arange(n) * (root + 3) + k) % 113).astype(dt)
                    buf = want.copy() if r == root else np.full(n, 77, dt)
                    select.broadcast(make(k), buf, root)
                    assert buf.tobytes() == want.tobytes(), (n, root, dt)

    _run(ts, body)
    # every rank's calls above the limit (int8 included: n > LIMIT bytes); a pair's only up to its split
    # (PAIR_SPLIT_MIN: above it the root writes half, bcast_pair), ONECOPY_MIN_PAIR['broadcast']
    sizes = [n * np.dtype(dt).itemsize for n in (LIMIT + 1, 3 * LIMIT + 7) for dt in dts]
    calls = p * p * sum(1 for b in sizes if p > 2 or b <= limits.PAIR_SPLIT_MIN)
    assert seen == {"direct": calls, "declined": 0}, seen


def test_a_broadcast_falls_back_when_a_rank_cannot_read(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_bcast(monkeypatch)
    p = 3
    ts = world(p)
    monkeypatch.setattr(ts[2], "cma_pid", lambda rank: 0)

    def body(r: int, make: Callable[..., Comm]) -> None:
        for root in range(p):
            want = np.arange(2 * LIMIT, dtype=np.int32) * (root + 1)
            buf = want.copy() if r == root else np.zeros_like(want)
            select.broadcast(make(root + 1), buf, root)
            assert np.array_equal(buf, want), root

    _run(ts, body)
    assert seen == {"direct": 0, "declined": p * p}, seen


def test_a_pairs_broadcast_is_split_between_root_and_reader(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, above the pair's limits: the root writes the second half (from a page boundary) into the other
    rank's buffer while that one reads the first half; odd sizes, every root and dtype; called directly, sizes up to
    a page (all written by the root)."""
    seen = _count_bcast(monkeypatch, "bcast_pair")
    monkeypatch.setattr(limits, "PAIR_SPLIT_MIN", 1000)
    monkeypatch.setitem(select.BIG_LIMIT_PAIR, "broadcast", 1000)
    ts = world(2)
    dts = ["uint8", "float64", "float16", "int32", "complex128"]
    sizes = (LIMIT + 1, 2 * LIMIT + 4099, 3 * LIMIT + 7)  # bytes above the arena's slot, odd tails

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for nbytes in sizes:
            for root in range(2):
                for dt in dts:
                    k += 1
                    n = -(-nbytes // np.dtype(dt).itemsize)
                    want = ((np.arange(n) * (root + 5) + k) % 97).astype(dt)
                    buf = want.copy() if r == root else np.full(n + 3, 11, dt)[:n]  # 3 spare elements after
                    select.broadcast(make(k), buf, root)
                    assert buf.tobytes() == want.tobytes(), (nbytes, root, dt)
                    if r != root:
                        assert np.all(buf.base[n:] == 11), "a byte past the buffer was written"
        for nbytes in (1, 1001, 4096, 4097):  # below the arena's slot, called directly: up to a page, all written
            k += 1
            want = (np.arange(nbytes) + k).astype(np.uint8)
            buf = want.copy() if r == 1 else np.zeros(nbytes, np.uint8)
            assert onecopy.bcast_pair(make(k), buf, 1)
            assert buf.tobytes() == want.tobytes(), nbytes

    _run(ts, body)
    assert seen == {"direct": 2 * len(sizes) * 2 * len(dts), "declined": 0}, seen
    for k in (0, 1):  # the flag words are whole aligned u64s (one store each): every slot payload is 8-aligned
        assert all(address_of(v) % 8 == 0 for v in ts[k].arena(0, [0, 1]).last_slots())  # type: ignore[union-attr]


def test_a_pairs_broadcast_falls_back_when_the_root_cannot_write(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A root whose arena has no writer (process_vm_writev forbidden) sends both ranks to the other algorithm, with
    nothing moved first; the other root, which can write, still splits."""
    seen = _count_bcast(monkeypatch, "bcast_pair")
    monkeypatch.setattr(limits, "PAIR_SPLIT_MIN", 1000)
    monkeypatch.setitem(select.BIG_LIMIT_PAIR, "broadcast", 1000)
    ts = world(2)
    real = shm_arena.ShmArena.writer
    monkeypatch.setattr(shm_arena.ShmArena, "writer", lambda self: None if self.t.rank == 0 else real(self))

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, root in enumerate((0, 1, 0, 1)):
            want = np.arange(3 * LIMIT, dtype=np.int32) * (root + 1) + k
            buf = want.copy() if r == root else np.zeros_like(want)
            select.broadcast(make(k + 1), buf, root)
            assert np.array_equal(buf, want), root

    _run(ts, body)
    assert seen == {"direct": 2 * 2, "declined": 2 * 2}, seen


def _per_rank(monkeypatch: pytest.MonkeyPatch, name: str, rank: int, wrap: Callable[..., Any]) -> None:
    """``ShmArena.<name>`` replaced on rank ``rank`` only by ``wrap(real, arena, *args)`` (ranks are threads)."""
    real = getattr(shm_arena.ShmArena, name)

    def patched(self: Any, *a: Any) -> Any:
        return wrap(real, self, *a) if self.t.rank == rank else real(self, *a)

    monkeypatch.setattr(shm_arena.ShmArena, name, patched)


def _pair_failure(world: Any, monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> Any:
    """Rank 1 (the reader) fails its read (``delay`` seconds into it); both ranks' outcomes, the times they left and
    rank 1's buffer."""
    monkeypatch.setattr(limits, "PAIR_SPLIT_MIN", 1000)
    monkeypatch.setitem(select.BIG_LIMIT_PAIR, "broadcast", 1000)
    ts = world(2)

    def failing_read(real: Any, arena: Any) -> Any:
        def read(i: int, out: memoryview, addr: int) -> None:
            time.sleep(delay)
            raise RuntimeError("injected read failure")

        return read

    _per_rank(monkeypatch, "reader", 1, failing_read)
    out: dict = {}
    n = 4 * LIMIT

    def body(r: int, make: Callable[..., Comm]) -> None:
        buf = np.full(n, 7, np.uint8) if r == 0 else np.zeros(n, np.uint8)
        t0 = time.monotonic()
        try:
            select.broadcast(make(1, 2.0), buf, 0)
            out[r] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test's assertions
            out[r] = e
        out[f"t{r}"] = time.monotonic() - t0
        out[f"buf{r}"] = buf

    _run(ts, body)
    return out


def test_a_pair_root_never_writes_once_the_reader_left(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader fails and leaves before the root reached its write: the root sees the reader's "gone", writes
    nothing and names the rank that left; the reader did not wait."""

    def late(real: Any, arena: Any, data: Any, check: int, deadline: Any) -> Any:
        views = real(arena, data, check, deadline)
        if data is not None:  # the first exchange: the root is slow to go on
            time.sleep(0.3)
        return views

    _per_rank(monkeypatch, "exchange", 0, late)
    out = _pair_failure(world, monkeypatch)
    assert isinstance(out[1], RuntimeError) and out["t1"] < 0.25, out
    assert isinstance(out[0], BrokenError) and "rank 1: that rank left the call" in str(out[0]), out[0]
    assert not out["buf1"].any(), "the root wrote into a buffer whose owner had left the call"


def test_a_pair_reader_leaving_early_waits_for_the_roots_write(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader fails while the root is writing: it leaves only once the root's write is done (never a write into
    a buffer after the call returned), and the root's call then ends at its deadline."""

    def slow_writer(real: Any, arena: Any) -> Any:
        write = real(arena)

        def slow(i: int, data: memoryview, addr: int) -> None:
            time.sleep(0.4)
            write(i, data, addr)

        return slow

    _per_rank(monkeypatch, "writer", 0, slow_writer)
    out = _pair_failure(world, monkeypatch, delay=0.1)  # fails once the root said "writing"
    assert isinstance(out[1], RuntimeError) and out["t1"] >= 0.35, out
    half = (4 * LIMIT // 2) & ~4095
    assert np.all(out["buf1"][half:] == 7) and not out["buf1"][:half].any(), "the reader left before the write ended"
    assert isinstance(out[0], ProcGroupError), out[0]  # the closing exchange: the reader never came


@pytest.mark.parametrize("p", [2, 3, 4])
def test_an_all_gather_above_the_limit_reads_every_part(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_bcast(monkeypatch, "allgather_direct")
    ts = world(p)
    dts = ["int8", "float32", "complex64", "int64"]

    def part(q: int, n: int, dt: str, k: int) -> np.ndarray:
        return ((np.arange(n) * (q + 2) + k) % 101).astype(dt)

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for n in (LIMIT + 1, 2 * LIMIT + 3):
            for dt in dts:
                k += 1
                want = np.concatenate([part(q, n, dt, k) for q in range(p)])
                out = np.full(p * n + 2, 5, dt)  # 2 spare elements: must stay untouched
                select.all_gather(make(k), part(r, n, dt, k), out)
                assert out[: p * n].tobytes() == want.tobytes() and np.all(out[p * n :] == 5), (n, dt)
                k += 1
                inplace = np.zeros(p * n, dt)  # sendbuf is this rank's part of recvbuf
                inplace[r * n : (r + 1) * n] = part(r, n, dt, k)
                select.all_gather(make(k), inplace[r * n : (r + 1) * n], inplace)
                want = np.concatenate([part(q, n, dt, k) for q in range(p)])
                assert inplace.tobytes() == want.tobytes(), ("in place", n, dt)

    _run(ts, body)
    calls = p * 2 * len(dts) * 2
    assert seen == {"direct": calls, "declined": 0}, seen  # two ranks too (ONECOPY_MIN_PAIR)
