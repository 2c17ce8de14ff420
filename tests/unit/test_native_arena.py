"""The arena's compiled fast path (``_native``) and its pure-Python path, side by side.

The arena conformance tests of ``test_arena`` run again here over shm and the router with the compiled path
forced on and off (``ShmOptions(native=...)``, i.e. ``PROCGROUP_NATIVE``); the native leg skips where the
extension was not built.  Then the fused publish+reduce: every op and dtype the C code reduces, world sizes
2-4 and 8, sizes 0, 1, odd and a full slot, compared bit for bit with numpy's reduction in member order
(signed zeros and NaNs included), plus the fallbacks (misaligned buffers, ops it does not do).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, List

import numpy as np
import pytest

from procgroup.algorithms import arena as alg
from procgroup.config import ShmOptions, shm_options
from procgroup.deadline import Deadline
from procgroup.errors import ClosedError, DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.ops import ReduceOp, reducer
from procgroup.transport import Transport
from procgroup.transport.shm import ARENA_BYTES
from procgroup.transport.shm import arena as shm_arena

from . import test_arena as conf
from .test_transport_conformance import _form, _segments, run_ranks

NATIVE = shm_arena.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="the compiled arena extension was not built (no C compiler?)")
PATHS = [pytest.param(True, id="native", marks=needs_native), pytest.param(False, id="python")]


@pytest.fixture(params=[(k, n) for k in ("shm", "router") for n in (True, False)], ids=lambda p: f"{p[0]}-{p[1]}")
def world(request: Any) -> Any:
    kind, native = request.param
    if native and not NATIVE:
        pytest.skip("the compiled arena extension was not built (no C compiler?)")
    job = f"narena-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int) -> List[Transport]:
        ts = _form(kind, n, job, shm_options=ShmOptions(native=native))
        made.extend(ts)
        return ts

    factory.kind = kind  # type: ignore[attr-defined]
    factory.native = native  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    assert _segments(job) == [], "shared memory segments leaked"


# the conformance tests of test_arena, on both paths (they take this module's `world`)
for _name in (
    "test_exchange_returns_every_members_bytes_in_member_order",
    "test_a_fast_rank_never_overwrites_a_slot_a_slow_rank_reads",
    "test_missing_member_times_out_naming_it",
    "test_different_check_words_never_complete",
    "test_abort_wakes_a_waiting_member",
    "test_closed_or_dead_peer_fails_the_waiter",
    "test_exchange_after_close_raises",
    "test_payload_larger_than_a_slot_is_refused",
    "test_exchange_accepts_numpy_bytes",
):
    globals()[_name] = getattr(conf, _name)


def test_the_setting_selects_the_path(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = conf._members(world.kind, len(ts))
    for t in ts:
        if t.rank in members:
            a = t.arena(2, members)
            assert a is not None and a.native is world.native


def test_procgroup_native_0_is_parsed_once_into_the_options() -> None:
    assert shm_options({"PROCGROUP_NATIVE": "0"}).native is False
    assert shm_options({}).native is True


def test_without_the_extension_one_notice_and_the_python_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shm_arena, "_native", None)
    monkeypatch.setattr(shm_arena, "_noticed", False)
    job = f"narena-{uuid.uuid4().hex[:10]}"
    with caplog.at_level(logging.INFO, logger="procgroup.transport"):
        ts = _form("shm", 2, job)
        try:
            arenas = [t.arena(1, [0, 1]) for t in ts] + [t.arena(2, [0, 1]) for t in ts]
            assert all(a is not None and not a.native for a in arenas)

            def body(t: Transport) -> None:
                a = t.arena(1, [0, 1])
                assert a is not None
                x = np.full(3, t.rank + 1, np.float32)
                alg.allreduce_arena(_Comm(a, t.rank), x, reducer(ReduceOp.SUM, np.float32))
                assert x.tolist() == [3.0, 3.0, 3.0]

            run_ranks(ts, body)
        finally:
            for t in ts:
                t.close()
    notices = [r for r in caplog.records if "compiled arena fast path" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0].getMessage()
    assert _segments(job) == []


# -- fused publish + reduce -------------------------------------------------------------------------------------
class _Comm:
    """What the arena algorithms read of a Comm: the arena, rank (= member index here), check word, deadline."""

    def __init__(self, arena: Any, rank: int, check: int = 77) -> None:
        self.arena = arena
        self.rank = rank
        self._check = check
        self.deadline = Deadline.after(20)

    def check_word(self) -> int:
        return self._check


OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
DTYPES = ["float32", "float64", "int32", "int64"]


def _contrib(rank: int, n: int, dtype: str, rnd: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + rnd)
    if dtype.startswith("float"):
        x = rng.standard_normal(n).astype(dtype) * 3
        if n >= 8:  # signed zeros and NaNs in fixed places: ties and NaN propagation must match numpy's
            x[0] = -0.0 if rank % 2 else 0.0
            x[1] = np.nan if rank == 1 else 1.0
            x[2] = np.nan if rank in (0, 2) else -1.0
            x[3] = np.inf if rank == 0 else -np.inf
        return x
    info = np.iinfo(dtype)
    x = rng.integers(-1000, 1000, n).astype(dtype)
    if n >= 4:
        x[0] = info.max  # sums and products wrap as numpy's do
        x[1] = info.min
    return x


def _expected(op: ReduceOp, xs: List[np.ndarray]) -> np.ndarray:
    k = reducer(op, xs[0].dtype)
    out = xs[0].copy()
    for x in xs[1:]:
        k(out, x)
    return out


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_allreduce_and_reduce_match_numpy_bit_for_bit(native: bool, n: int) -> None:
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", n, job, shm_options=ShmOptions(native=native))
    members = list(range(n))
    fails: List[str] = []
    try:

        def body(t: Transport) -> None:
            a = t.arena(1, members)
            assert a is not None and a.native is native
            rnd = 0
            for dtype in DTYPES:
                isz = np.dtype(dtype).itemsize
                for size in (0, 1, 7, 1001, ARENA_BYTES // isz):
                    for op in OPS:
                        rnd += 1
                        xs = [_contrib(m, size, dtype, rnd) for m in members]
                        with np.errstate(all="ignore"):  # NaN, inf, overflow on purpose (numpy's state: per thread)
                            want = _expected(op, xs)
                            x = xs[t.rank].copy()
                            alg.allreduce_arena(_Comm(a, t.rank, rnd), x, reducer(op, dtype))
                            root = rnd % n
                            y = xs[t.rank].copy()
                            alg.reduce_arena(_Comm(a, t.rank, rnd + 5000), y, reducer(op, dtype), root)
                        if x.tobytes() != want.tobytes():
                            fails.append(f"all_reduce {op.name} {dtype} n={size} rank {t.rank}")
                        mine = want if t.rank == root else xs[t.rank]
                        if y.tobytes() != mine.tobytes():
                            fails.append(f"reduce {op.name} {dtype} n={size} root {root} rank {t.rank}")

        run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()
    assert not fails, fails[:10]
    assert _segments(job) == []


@pytest.mark.parametrize("native", PATHS)
def test_ops_and_buffers_the_c_code_does_not_reduce_fall_back_to_numpy(native: bool) -> None:
    """AVG's kernel sums; bool, uint8, complex, bfloat16, bitwise ops and a misaligned float64 take numpy."""
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 3, job, shm_options=ShmOptions(native=native))
    cases = [
        (ReduceOp.SUM, "uint8"),
        (ReduceOp.BXOR, "int32"),
        (ReduceOp.MAX, "bool"),
        (ReduceOp.SUM, "complex64"),
        (ReduceOp.AVG, "float32"),
        (ReduceOp.SUM, "bfloat16"),
        (ReduceOp.SUM, "misaligned"),
    ]
    fails: List[str] = []
    try:

        def body(t: Transport) -> None:
            a = t.arena(1, [0, 1, 2])
            assert a is not None
            for i, (op, dt) in enumerate(cases):
                if dt == "misaligned":
                    raw = np.zeros(8 * 9 + 1, np.uint8)
                    x = np.frombuffer(raw.data, np.float64, 9, offset=1)  # not 8-byte aligned
                    x[...] = np.arange(9) + t.rank
                    xs = [np.arange(9, dtype=np.float64) + m for m in range(3)]
                    kern = reducer(op, np.float64)
                elif dt == "bfloat16":
                    x = np.array([16256 + t.rank, 16384], np.uint16)  # bfloat16 bits of 1.0.. and 2.0
                    xs = [np.array([16256 + m, 16384], np.uint16) for m in range(3)]
                    kern = reducer(op, "bfloat16")
                else:
                    xs = [(np.arange(5) % 2 + m).astype(dt) for m in range(3)]
                    x = xs[t.rank].copy()
                    kern = reducer(op, dt)
                want = xs[0].copy()
                for y in xs[1:]:
                    kern(want, y)
                alg.allreduce_arena(_Comm(a, t.rank, i + 1), x, kern)
                if x.tobytes() != want.tobytes():
                    fails.append(f"{op.name} {dt} rank {t.rank}: {x} != {want}")

        run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()
    assert not fails, fails
    assert _segments(job) == []


@pytest.mark.parametrize("native", PATHS)
def test_a_payload_larger_than_a_slot_is_refused_by_the_fused_path(native: bool) -> None:
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(native=native))
    try:
        a = ts[0].arena(1, [0, 1])
        assert a is not None
        big = np.zeros(ARENA_BYTES // 4 + 1, np.float32)
        with pytest.raises(Exception, match="exceeds the slot size"):
            if not a.exchange_reduce(big, 0, 0, 5, Deadline.after(5)):
                a.exchange(memoryview(big).cast("B"), 5, Deadline.after(5))
        assert a.calls == 0  # nothing was published
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


# -- fused publish + copy (broadcast, all_gather) ---------------------------------------------------------------
@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_broadcast_and_all_gather_copy_every_members_bytes(native: bool, n: int) -> None:
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", n, job, shm_options=ShmOptions(native=native))
    members = list(range(n))
    fails: List[str] = []
    try:

        def body(t: Transport) -> None:
            a = t.arena(1, members)
            assert a is not None and a.native is native
            rnd = 0
            for dtype in ("uint8", "float16", "int64", "complex64"):
                isz = np.dtype(dtype).itemsize
                for size in (0, 1, 7, 1001, ARENA_BYTES // isz):
                    for root in members:
                        rnd += 1
                        src = (np.arange(size) * (root + 3) % 251).astype(dtype)
                        b = src.copy() if t.rank == root else np.zeros(size, dtype)
                        alg.bcast_arena(_Comm(a, t.rank, rnd), b, root)
                        if b.tobytes() != src.tobytes():
                            fails.append(f"broadcast {dtype} n={size} root {root} rank {t.rank}")
                    rnd += 1
                    mine = (np.arange(size) + 7 * t.rank).astype(dtype)
                    out = np.full(n * size, 99, dtype)
                    alg.allgather_arena(_Comm(a, t.rank, rnd), mine, out)
                    want = np.concatenate([(np.arange(size) + 7 * m).astype(dtype) for m in members])
                    if out.tobytes() != want.tobytes():
                        fails.append(f"all_gather {dtype} n={size} rank {t.rank}")
            # an output the C copy does not take (non-contiguous) falls back to numpy's copies
            rnd += 1
            out2 = np.zeros(2 * 3 * n, np.int32)[::2]
            alg.allgather_arena(_Comm(a, t.rank, rnd), np.full(3, t.rank, np.int32), out2)
            if out2.tolist() != [m for m in members for _ in range(3)]:
                fails.append(f"strided all_gather rank {t.rank}: {out2}")

        run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()
    assert not fails, fails[:10]
    assert _segments(job) == []


# -- the fused calls keep exchange's failure semantics -----------------------------------------------------------
def _fused_call(a: Any, which: str, check: int, deadline: Deadline) -> None:
    x = np.ones(4, np.float32)
    if which == "reduce":
        done = a.exchange_reduce(x, 0, 0, check, deadline)
    elif which == "copy":
        done = a.exchange_copy(None, x, 1, check, deadline)
    else:
        done = a.exchange_copy(x, np.zeros(4 * len(a.members), np.float32), -1, check, deadline)
    if not done:  # the Python path: the plain exchange
        a.exchange(memoryview(x).cast("B"), check, deadline)


FUSED = ["reduce", "copy", "gather"]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("which", FUSED)
def test_fused_calls_time_out_naming_the_missing_member(native: bool, which: str) -> None:
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(native=native))
    try:
        a = ts[0].arena(3, [0, 1])
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError) as ei:
            _fused_call(a, which, 5, Deadline.after(0.5))
        assert 0.4 < time.monotonic() - t0 < 5.0
        assert "[1]" in str(ei.value) and "rank 0" in str(ei.value) and "call 1 " in str(ei.value)
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("which", FUSED)
def test_fused_calls_with_different_check_words_never_complete(native: bool, which: str) -> None:
    job = f"narena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(native=native))
    errs: List[BaseException] = []
    try:

        def body(t: Transport) -> None:
            try:
                _fused_call(t.arena(4, [0, 1]), which, 100 + t.rank, Deadline.after(0.6))
            except DistTimeoutError as e:
                errs.append(e)

        run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()
    assert len(errs) == 2
    assert _segments(job) == []


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("which", FUSED)
@pytest.mark.parametrize("how", ["abort", "peer closes", "own close", "own close mid-spin"])
def test_fused_calls_wake_on_abort_close_and_a_dead_peer(native: bool, which: str, how: str) -> None:
    """'own close mid-spin': a 1 s spin, so the close (and the unmapping) comes while the C call spins."""
    job = f"narena-{uuid.uuid4().hex[:10]}"
    spin = 1e6 if how == "own close mid-spin" else None
    ts = _form("shm", 2, job, shm_options=ShmOptions(native=native, spin_us=spin))
    try:
        t = ts[0]
        a = t.arena(5, [0, 1])
        if how == "abort":
            act, err = (lambda: t.abort(ProcGroupError("aborted by the test"))), ProcGroupError
        elif how == "peer closes":
            act, err = ts[1].close, PeerFailureError
        else:  # our own transport closes (another thread) while this one waits in the arena
            act, err = t.close, (ClosedError, ProcGroupError)
        threading.Timer(0.3, act).start()
        t0 = time.monotonic()
        with pytest.raises(err) as ei:
            _fused_call(a, which, 1, Deadline.after(20))
        assert time.monotonic() - t0 < 5.0
        if how == "peer closes":
            assert ei.value.peer == 1  # type: ignore[union-attr]
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("spin_us", [None, 40.0], ids=["default", "spin-set"])
def test_a_spanning_groups_host_slots_barely_spin(native: bool, spin_us: Any) -> None:
    """One host's members of a group spanning hosts wait for the stage between hosts: their slots spin only
    ARENA_SPIN_SPANNING before they sleep, unless PROCGROUP_SHM_SPIN_US (ShmOptions.spin_us) says how long every
    wait spins; exchanges still complete through the sleep path, and results are right."""
    job = f"span-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(native=native, spin_us=spin_us))
    try:
        own = [t.arena(1, [0, 1]) for t in ts]
        host = [t.arena(2, [0, 1], spanning=True) for t in ts]
        for a, h in zip(own, host):
            assert a is not None and h is not None and h.big is not None
            want = 40e-6 if spin_us is not None else shm_arena.ARENA_SPIN_SPANNING
            assert h._spin == pytest.approx(want) and h.big._spin == pytest.approx(want)
            if spin_us is None:
                assert a._spin > want and a.big._spin > want

        def body(t: Any) -> None:
            h = host[t.rank]
            for k in range(20):
                if t.rank == 1:
                    time.sleep(0.002)  # rank 0 arrives first and must sleep, then be woken
                got = h.exchange(memoryview(bytes([t.rank, k])), 100 + k, Deadline.after(10))
                assert [bytes(x[:2]) for x in got] == [bytes([0, k]), bytes([1, k])]

        run_ranks(ts, body)
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == [], "shared memory segments leaked"
