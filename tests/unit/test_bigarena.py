"""Big-slot collectives (issue 14 item 1), ranks as threads, over the memory and the shm transport.

Every dtype x op (closed-form values, bit-identical on every rank), every
root, world sizes 2-4 (8 on memory), counts 0, 1, odd, and above the slot
size so that calls take several double-buffered steps; plus the waits'
guarantees: mismatched calls never complete together, deadlines, abort,
peer death, and no segment left in /dev/shm.
"""

from __future__ import annotations

import os
import threading
import time
import types
import uuid
from typing import Any, Callable, List

import numpy as np
import pytest

from procgroup.algorithms import bigarena as BIG
from procgroup.algorithms import select
from procgroup.algorithms.comm import Comm, ScratchPool
from procgroup.config import ShmOptions
from procgroup.deadline import Deadline
from procgroup.errors import ConfigError, DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.ops import ReduceOp, finalize
from procgroup.transport import Transport
from procgroup.transport.shm import layout
from procgroup.transport.shm.arena import set_streaming

from .test_algorithms import DTYPES, OPS, check_reduced, contrib, data, expected, garbage, kernel, storage, valid
from .test_transport_conformance import _form, _segments, run_ranks

SLOT = 64 << 10  # the shm minimum; the memory hub uses it too
#: elements: empty, tiny, odd, around and well above one slot of int8/float64 (several steps)
COUNTS = [0, 1, 7, 1001, SLOT + 3, 3 * SLOT // 8 + 5]


@pytest.fixture(params=["memory", "shm", "shm-stream"])
def world(request: Any) -> Any:
    """Transports of n ranks with big slots: in memory, over shm (PROCGROUP_SHM_STREAM's default, auto), and over
    shm with every copy into the slots streamed (always: the all_to_all and reduction copies too)."""
    job = f"big-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int) -> List[Transport]:
        if request.param == "memory":
            ts = _form("memory", n, job)
            ts[0].hub.big_slot = SLOT  # type: ignore[attr-defined]
        else:
            stream = "always" if request.param == "shm-stream" else "auto"
            ts = _form("shm", n, job, shm_options=ShmOptions(big_slot=SLOT, stream=stream))
        made.extend(ts)
        return ts

    factory.kind = request.param.split("-")[0]  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    set_streaming("auto")  # the process-wide setting back to the default
    assert _segments(job) == [], "shared memory segments leaked"


def _run(ts: List[Transport], fn: Callable[[int, Callable[[int], Comm]], None], timeout: float = 60.0) -> None:
    p = len(ts)

    def body(t: Transport) -> None:
        a = t.arena(0, list(range(p)))
        assert a is not None and a.big is not None and a.big.slot_bytes == SLOT
        pool = ScratchPool()

        def make(tag: int, deadline: float = 30.0) -> Comm:
            return Comm(t, list(range(p)), t.rank, tag, Deadline.after(deadline), scratch=pool, arena=a)

        fn(t.rank, make)

    run_ranks(ts, body, timeout)


def _red_cases() -> List[Any]:
    cases = [(dt, ReduceOp.SUM, n) for dt in DTYPES for n in COUNTS]
    cases += [(dt, op, 4099) for dt in DTYPES for op in OPS if op is not ReduceOp.SUM and valid(op, dt)]
    return cases


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_reduce_every_dtype_and_op_bit_identical(world: Any, p: int) -> None:
    ts = world(p)
    cases = _red_cases()
    got: List[List[bytes]] = [[] for _ in range(p)]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, op, n) in enumerate(cases):
            buf = contrib(dt, op, r, n)
            BIG.allreduce_big(make(k + 1), buf, kernel(op, dt))
            got[r].append(buf.tobytes())
            finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
            check_reduced(dt, op, p, buf, f"case {k} {dt} {op.name} n={n} rank {r}/{p}")

    _run(ts, body)
    assert all(g == got[0] for g in got), "ranks disagree on the bits"


@pytest.mark.parametrize("p", [2, 3])
def test_reduce_every_root_leaves_the_others_unchanged(world: Any, p: int) -> None:
    ts = world(p)
    cases = [(root, dt, op, n) for root in range(p) for (dt, op, n) in _red_cases()[:: 3 + root]]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (root, dt, op, n) in enumerate(cases):
            buf = contrib(dt, op, r, n)
            before = buf.tobytes()
            BIG.reduce_big(make(k + 1), buf, kernel(op, dt), root)
            if r == root:
                finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
                check_reduced(dt, op, p, buf, f"case {k} root {root} {dt} {op.name} n={n}")
            else:
                assert buf.tobytes() == before, f"case {k}: rank {r}'s buffer changed"

    _run(ts, body)


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "own-block"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_reduce_scatter_every_dtype(world: Any, p: int, in_place: bool) -> None:
    """Into a buffer of its own, or into this rank's own block of sendbuf (a multi-leader all_reduce's host stage:
    members 0 and 1 reduce their own part where it lies, member 1 only with a ufunc kernel, the others copy it into
    the slot first); every dtype and op, in one step and in several."""
    ts = world(p)
    cases = [(dt, op, n) for (dt, op, n) in _red_cases() if n <= 3 * SLOT // 8 // p + 5]
    if in_place:
        cases = [(dt, op, m) for (dt, op, _) in _red_cases()[::4] for m in (1, 999, SLOT // 8 + 3)]
        cases += [(dt, op, 1001) for dt in DTYPES for op in OPS if valid(op, dt)]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, op, n) in enumerate(cases):
            send = contrib(dt, op, r, p * n)
            recv = send[r * n : (r + 1) * n] if in_place else garbage(dt, n)
            BIG.reduce_scatter_big(make(k + 1), send, recv, kernel(op, dt))
            finalize(op, recv, p, dtype="bfloat16" if dt == "bfloat16" else None)
            want = expected(dt, op, p, p * n)[r * n : (r + 1) * n]
            check_reduced(dt, op, p, recv, f"case {k} {dt} {op.name} n={n} rank {r}", want=want)

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_reduce_scatter_through_the_small_arena_every_dtype(world: Any, p: int) -> None:
    """reduce_scatter whose whole sendbuf fits an arena slot: one exchange, rank r reduces block r of every slot
    in member order (select picks it; closed-form values for every dtype and op, sizes 0, 1 and odd)."""
    from procgroup.algorithms.arena import reduce_scatter_arena
    from procgroup.transport.base import ARENA_BYTES

    ts = world(p)
    cases = [(dt, op, n) for (dt, op, n) in _red_cases() if n * p * np.dtype(storage(dt)).itemsize <= ARENA_BYTES]
    cases += [(dt, ReduceOp.SUM, n) for dt in ("float32", "int64") for n in (0, 1, 7)]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, op, n) in enumerate(cases):
            send = contrib(dt, op, r, p * n)
            before = send.tobytes()
            recv = garbage(dt, n)
            c = make(k + 1)
            assert select.ALGORITHMS["reduce_scatter"]["arena"] is reduce_scatter_arena
            select.reduce_scatter(c, send, recv, kernel(op, dt))
            finalize(op, recv, p, dtype="bfloat16" if dt == "bfloat16" else None)
            want = expected(dt, op, p, p * n)[r * n : (r + 1) * n]
            check_reduced(dt, op, p, recv, f"case {k} {dt} {op.name} n={n} rank {r}", want=want)
            assert send.tobytes() == before, f"case {k}: sendbuf changed"

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_broadcast_every_root(world: Any, p: int) -> None:
    ts = world(p)
    cases = [(root, dt, n) for root in range(p) for j, n in enumerate(COUNTS) for dt in DTYPES[j::3]]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (root, dt, n) in enumerate(cases):
            want = data(dt, root, n, k)
            buf = want.copy() if r == root else garbage(dt, n)
            BIG.bcast_big(make(k + 1), buf, root)
            assert buf.tobytes() == want.tobytes(), f"case {k} root {root} {dt} n={n} rank {r}"

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_gather(world: Any, p: int) -> None:
    ts = world(p)
    cases = [(dt, n) for j, n in enumerate(COUNTS) for dt in DTYPES[j::2]]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, n) in enumerate(cases):
            recv = garbage(dt, p * n)
            BIG.allgather_big(make(k + 1), data(dt, r, n, k), recv)
            want = np.concatenate([data(dt, i, n, k) for i in range(p)])
            assert recv.tobytes() == want.tobytes(), f"case {k} {dt} n={n} rank {r}"

    _run(ts, body)


def test_eight_ranks_and_a_lagging_rank_mixing_ops() -> None:
    """p = 8 (memory); one rank lags at every call, ops alternate: the double buffers are never overwritten early."""
    p = 8
    ts = _form("memory", p, "x")
    ts[0].hub.big_slot = 4096  # type: ignore[attr-defined]

    def body(t: Transport) -> None:
        r = t.rank
        a = t.arena(0, list(range(p)))
        pool = ScratchPool()
        for k in range(30):
            c = Comm(t, list(range(p)), r, k + 1, Deadline.after(30), scratch=pool, arena=a)
            if r == k % p:
                time.sleep(0.002)
            n = 3001 + k
            if k % 3 == 0:
                buf = np.arange(n, dtype=np.int64) * (r + 1)
                BIG.allreduce_big(c, buf, kernel(ReduceOp.SUM, "int64"))
                assert np.array_equal(buf, np.arange(n) * (p * (p + 1) // 2)), k
            elif k % 3 == 1:
                buf = np.arange(n, dtype=np.int32) + k if r == k % p else np.zeros(n, np.int32)
                BIG.bcast_big(c, buf, k % p)
                assert np.array_equal(buf, np.arange(n) + k), k
            else:
                recv = np.empty(p * n, np.int16)
                BIG.allgather_big(c, np.full(n, r + k, np.int16), recv)
                assert np.array_equal(recv, np.repeat(np.arange(p) + k, n).astype(np.int16)), k

    run_ranks(ts, body)


def test_select_uses_the_big_slots_above_the_arena_and_within_big_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    p = 2
    ts = _form("memory", p, "x")
    calls: List[str] = []
    monkeypatch.setattr(select, "allreduce_big", lambda *a: calls.append("big") or BIG.allreduce_big(*a))
    monkeypatch.setitem(select.BIG_LIMIT, "all_reduce", 1 << 20)

    def body(t: Transport) -> None:
        a = t.arena(0, [0, 1])
        for k, n in enumerate([1000, 10000, 200000, 300000]):  # float32: 4 KB, 40 KB, 800 KB, 1.2 MB
            c = Comm(t, [0, 1], t.rank, k + 1, Deadline.after(30), arena=a)
            buf = np.ones(n, np.float32)
            select.all_reduce(c, buf, kernel(ReduceOp.SUM, "float32"))
            assert np.all(buf == 2)

    run_ranks(ts, body)
    assert calls == ["big"] * 4, calls  # 40 KB and 800 KB on both ranks; 4 KB: arena; 1.2 MB: above BIG_LIMIT


def test_mismatched_calls_never_complete_and_time_out_naming_the_missing(world: Any) -> None:
    ts = world(2)

    def body(r: int, make: Callable[[int], Comm]) -> None:
        buf = np.ones(50000, np.float32)
        c = make(5, 1.0)
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError, match="did not arrive") as ei:
            if r == 0:
                BIG.allreduce_big(c, buf, kernel(ReduceOp.SUM, "float32"))
            else:
                BIG.bcast_big(c, buf, 0)  # same sequence number, another op: the check words differ
        assert time.monotonic() - t0 < 10, ei.value

    _run(ts, body)


def test_a_dead_peer_fails_the_waiter(world: Any) -> None:
    ts = world(2)
    t1 = ts[1]
    a = ts[0].arena(0, [0, 1])
    c = Comm(ts[0], [0, 1], 0, 1, Deadline.after(30), arena=a)
    t1.close()
    ts[0].mark_peer_failed(1, "rank 1 was killed (test)")
    t0 = time.monotonic()
    with pytest.raises((PeerFailureError, ProcGroupError)):
        BIG.allreduce_big(c, np.ones(50000, np.float32), kernel(ReduceOp.SUM, "float32"))
    assert time.monotonic() - t0 < 10


def test_abort_wakes_a_waiting_member(world: Any) -> None:
    ts = world(2)
    a = ts[0].arena(0, [0, 1])
    c = Comm(ts[0], [0, 1], 0, 1, Deadline.after(60), arena=a)

    class Boom(ProcGroupError):
        pass

    import threading

    threading.Timer(0.3, lambda: ts[0].abort(Boom("aborted by the test"))).start()
    t0 = time.monotonic()
    with pytest.raises(Boom):
        BIG.bcast_big(c, np.ones(50000, np.float32), 1)
    assert time.monotonic() - t0 < 10


def test_no_big_slots_is_a_clear_error_and_select_falls_back() -> None:
    ts = _form("memory", 2, "x")
    ts[0].hub.big_slot = 0  # type: ignore[attr-defined]
    a = ts[0].arena(0, [0, 1])
    assert a is not None and a.big is None
    with pytest.raises(ConfigError, match="big slots"):
        BIG.allreduce_big(Comm(ts[0], [0, 1], 0, 1, Deadline.after(5), arena=a), np.ones(9), np.add)


def test_big_slot_setting() -> None:
    assert layout.choose_big_slot(4, 0) == 0
    assert layout.choose_big_slot(4, 1 << 20) == 1 << 20
    assert layout.choose_big_slot(1, None) == 0  # no local peers: nothing to share
    assert layout.choose_big_slot(2, None) in (0, layout.DEFAULT_BIG_SLOT) or layout.choose_big_slot(2, None) >= (
        layout.MIN_BIG_SLOT
    )
    for bad in (4096, (64 << 10) + 1):
        with pytest.raises(ConfigError, match="PROCGROUP_SHM_BIG_SLOT"):
            layout.choose_big_slot(2, bad)
    from procgroup.config import ENV, shm_options

    assert shm_options({ENV.SHM_BIG_SLOT: "131072"}).big_slot == 131072
    with pytest.raises(ConfigError):
        shm_options({ENV.SHM_BIG_SLOT: "-1"})
    assert storage("float32") == np.dtype("float32")


@pytest.mark.parametrize("p", [2, 3])
def test_reduce_scatter_into_its_own_block_of_sendbuf(world: Any, p: int) -> None:
    ts = world(p)

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, m in enumerate([1, 999, SLOT // 4 + 3]):
            send = np.arange(p * m, dtype=np.float64) + r
            recv = send[r * m : (r + 1) * m]  # in place: the result overwrites this rank's block
            BIG.reduce_scatter_big(make(k + 1), send, recv, kernel(ReduceOp.SUM, "float64"))
            want = p * np.arange(r * m, (r + 1) * m, dtype=np.float64) + p * (p - 1) / 2
            assert np.array_equal(recv, want), (k, r)

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_gather_from_its_own_block_of_the_output(world: Any, p: int) -> None:
    """sendbuf = this rank's block of recvbuf (in place): that block stays as it is, the others arrive; one step and
    several, and a member that arrives late (the others' copy after the wait)."""
    ts = world(p)
    cases = [(dt, n) for j, n in enumerate(COUNTS) for dt in DTYPES[j::3]]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        for k, (dt, n) in enumerate(cases):
            recv = garbage(dt, p * n)
            mine = recv[r * n : (r + 1) * n]
            mine[...] = data(dt, r, n, k)
            if k % 5 == 4 and r == p - 1:
                time.sleep(0.05)
            BIG.allgather_big(make(k + 1), mine, recv)
            want = np.concatenate([data(dt, i, n, k) for i in range(p)])
            assert recv.tobytes() == want.tobytes(), f"case {k} {dt} n={n} rank {r}"

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_bound_split_matches_the_split_every_member(world: Any, p: int) -> None:
    """bind_split (a plan's multi-leader host stages in one compiled step each) against allreduce_big_split, members
    on either path in the same call (rotating): reduce-scatter in place, ``between`` on each member's block, then
    all-gather; every member, the compiled reductions' dtypes and ops, closed-form results.  Without the compiled
    big slots (the memory hub) nothing binds."""
    ts = world(p)
    cases = [
        (dt, op, m)
        for dt in ("float32", "float64", "int32", "int64")
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT)
        for m in (1, 1001, SLOT // 8 // p)
    ]
    bound_calls = [0]

    def body(r: int, make: Callable[[int], Comm]) -> None:
        c0 = make(1)
        big = c0.arena.big
        for k, (dt, op, m) in enumerate(cases):
            kern = kernel(op, dt)
            fn = BIG.bind_split(big, p * m, np.dtype(dt), p, r, kern)
            if world.kind == "memory":
                assert fn is None
            elif r == 0:
                assert fn is not None, (dt, op, m)
                bound_calls[0] += 1
            buf = contrib(dt, op, r, p * m)

            f = 1 if op is ReduceOp.PRODUCT else 3  # the stage between hosts, stood in for: block * f

            def between(block: np.ndarray, f: int = f) -> None:
                block[...] = block * f

            comm = make(k + 2)
            if fn is not None and (r + k) % 2 == 0:
                fn(comm, buf, between)
            else:
                assert BIG.allreduce_big_split(comm, buf, kern, between)
            want = expected(dt, op, p, p * m) * f
            check_reduced(dt, op, p, buf, f"case {k} {dt} {op.name} m={m} rank {r}", want=want)

    _run(ts, body)
    assert world.kind == "memory" or bound_calls[0] == len(cases)


def test_two_groups_run_big_slot_collectives_at_once_from_two_threads(world: Any) -> None:
    """Big slots are per group: the world and a second group (same members) at once never mix their data."""
    import threading

    ts = world(2)

    def rank(t: Transport) -> None:
        errs: List[BaseException] = []

        def loop(key: int) -> None:
            try:
                a = t.arena(key, [0, 1])
                assert a is not None and a.big is not None
                pool = ScratchPool()
                for k in range(40):
                    c = Comm(t, [0, 1], t.rank, 1000 * key + k + 1, Deadline.after(30), scratch=pool, arena=a)
                    n = 20000 + 17 * k + key
                    buf = np.full(n, (key + 1) * (t.rank + 1), np.int64)
                    BIG.allreduce_big(c, buf, kernel(ReduceOp.SUM, "int64"))
                    assert (buf == 3 * (key + 1)).all(), (key, k)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)

        th = [threading.Thread(target=loop, args=(key,)) for key in (0, 1)]
        for x in th:
            x.start()
        for x in th:
            x.join(60)
        if errs:
            raise errs[0]

    run_ranks(ts, rank, 90)


def _burn_on(cpu: int, stop: threading.Event) -> None:
    """Keep ``cpu`` busy (numpy releases the GIL) until ``stop``: a compute thread beside the collective."""
    os.sched_setaffinity(0, {cpu})  # this thread only
    a = np.ones(1 << 16, np.float64)
    while not stop.is_set():
        a *= 1.0000001


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs per-thread CPU affinity (Linux)")
def test_a_long_yield_ends_the_spin_beside_a_busy_thread() -> None:
    """A waiter whose yield let another thread have its CPU for a time slice stops spinning and sleeps.

    Before, the spin yielded for its whole length (here 3 s), handing the busy thread one slice per yield: a big
    all_reduce beside DDP's compute thread took 20x longer.  Now the first long yield ends the spin, and the
    missing member's deadline error comes at the deadline (1 s), not after the spin.
    """
    job = f"big-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(big_slot=SLOT, spin_us=3_000_000))
    stop = threading.Event()
    cpu = min(os.sched_getaffinity(0))
    burner = threading.Thread(target=_burn_on, args=(cpu, stop), daemon=True)
    old = os.sched_getaffinity(0)
    try:
        a = ts[0].arena(0, [0, 1])
        assert a is not None and a.big is not None
        burner.start()
        os.sched_setaffinity(0, {cpu})  # the waiter shares the busy thread's CPU
        c = Comm(ts[0], [0, 1], 0, 1, Deadline.after(1.0), arena=a)
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError):
            BIG.allreduce_big(c, np.ones(50000, np.float32), kernel(ReduceOp.SUM, "float32"))  # rank 1 never comes
        took = time.monotonic() - t0
    finally:
        os.sched_setaffinity(0, old)
        stop.set()
        burner.join(10)
        for t in ts:
            t.close()
    assert _segments(job) == [], "shared memory segments leaked"
    assert took < 2.5, f"the waiter spun for {took:.2f}s beside a busy thread (its deadline was 1 s)"


def test_poll_stops_after_a_long_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure-Python path's poll: a yield that kept it off the CPU past LONG_YIELD ends the poll."""
    from procgroup.transport.shm import arena as A

    yields: List[float] = []
    monkeypatch.setattr(A, "_sched_yield", lambda: (yields.append(1.0), time.sleep(2 * A.LONG_YIELD)))
    t0 = time.monotonic()
    assert A.poll(lambda: False, 5.0, True) is False
    assert time.monotonic() - t0 < 1.0 and len(yields) == 1
    # short yields (nobody else wanted the CPU) keep polling until ready; poll's clock advances 1 us a reading, so
    # that a preemption of this thread on a loaded machine (a parallel suite) cannot pass for a long yield
    calls = iter(range(1000))
    ticks = iter(range(1 << 20))
    monkeypatch.setattr(A, "_sched_yield", lambda: None)
    monkeypatch.setattr(A, "time", types.SimpleNamespace(monotonic=lambda: next(ticks) * 1e-6))
    assert A.poll(lambda: next(calls) >= 50, 5.0, True) is True


def test_pipelined_steps_two_members_whole_and_more_members_in_parts() -> None:
    """Broadcast / all_gather steps (``_pipe_elems``): two members copy a message of up to STEP_MAX in one step,
    more members in PIPE_PARTS steps (at least PIPE_MIN); never more than a buffer or STEP_MAX."""
    mib = 1 << 20
    assert BIG._pipe_elems(256 << 10, 4, mib, 2) * 4 == 256 << 10  # one step
    assert BIG._pipe_elems(256 << 10, 4, mib, 4) * 4 == (256 << 10) // BIG.PIPE_PARTS
    assert BIG._pipe_elems(96 << 10, 4, mib, 3) * 4 == BIG.PIPE_MIN
    for members in (2, 3, 8):
        assert BIG._pipe_elems(16 * mib, 8, mib, members) * 8 == BIG.STEP_MAX
        assert BIG._pipe_elems(16 * mib, 8, 256 << 10, members) * 8 == 256 << 10  # a buffer smaller than STEP_MAX
