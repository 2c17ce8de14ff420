"""The shared-memory all_to_all (issue 14 item 1), ranks as threads, over the memory and the shm transport.

Closed-form values (every rank's piece for every other rank is distinct), bit-identical to what the message
algorithms deliver: equal and uneven splits, zero pieces, counts 0, 1, odd, inline (header + stream within
the arena slot), just above it, and several big-slot rounds; streams of some ranks inline and others not;
the message fallback above BIG_LIMIT and without big slots; every dtype; world sizes 2-4 (8 on memory);
count mismatches fail loudly on every rank (never a hang); mismatched calls never complete together;
deadlines, a dead peer, abort; no segment left in /dev/shm.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, List

import numpy as np
import pytest

from procgroup.algorithms import alltoall as MSG
from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms import select
from procgroup.algorithms.comm import Comm
from procgroup.config import ShmOptions
from procgroup.deadline import Deadline
from procgroup.errors import DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.transport import Transport
from procgroup.transport.shm.arena import set_streaming

from .test_algorithms import DTYPES, data, garbage, storage
from .test_bigarena import SLOT, _run
from .test_transport_conformance import _form, _segments, run_ranks

ARENA = 32 << 10  # transport.base.ARENA_BYTES


@pytest.fixture(params=["memory", "shm", "shm-stream", "shm-python"])
def world(request: Any) -> Any:
    """Transports of n ranks (threads) with big slots of SLOT bytes (shm: the compiled arena path where it was
    built, shm-stream: the same with every copy into the slots streamed, shm-python: the pure-Python one); checks
    /dev/shm is clean afterwards."""
    job = f"a2a-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int) -> List[Transport]:
        if request.param == "memory":
            ts = _form("memory", n, job)
            ts[0].hub.big_slot = SLOT  # type: ignore[attr-defined]
        else:
            opts = ShmOptions(
                big_slot=SLOT,
                native=request.param != "shm-python",
                stream="always" if request.param == "shm-stream" else "auto",
            )
            ts = _form("shm", n, job, shm_options=opts)
        made.extend(ts)
        return ts

    factory.kind = request.param  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    set_streaming("auto")  # the process-wide setting back to the default
    assert _segments(job) == [], "shared memory segments leaked"


def _pieces(dt: str, C: List[List[int]], r: int, salt: int) -> List[np.ndarray]:
    """Rank r's pieces for every rank (piece j: C[r][j] elements, distinct per (r, j, salt))."""
    return [data(dt, r, C[r][j], salt * 31 + j) for j in range(len(C))]


def _check_a2a(r: int, c: Comm, dt: str, C: List[List[int]], salt: int, algo: Callable[..., None]) -> None:
    p = len(C)
    send = np.concatenate(_pieces(dt, C, r, salt)) if p else np.zeros(0)
    recv = garbage(dt, sum(C[i][r] for i in range(p)) + 3)  # 3 spare elements: must stay untouched
    tail = recv[-3:].copy()
    algo(c, send, C[r], recv, [C[i][r] for i in range(p)])
    want = np.concatenate([_pieces(dt, C, i, salt)[r] for i in range(p)]).astype(storage(dt), copy=False)
    got = recv[:-3]
    assert got.tobytes() == want.tobytes(), f"rank {r} {dt} C={C}"
    assert recv[-3:].tobytes() == tail.tobytes(), "wrote past the received pieces"


def _equal(p: int, n: int) -> List[List[int]]:
    return [[n] * p for _ in range(p)]


def _uneven(p: int, base: int) -> List[List[int]]:
    """Uneven counts with zero pieces (r + j divisible by 3), some pieces large when base is."""
    return [[0 if (r + j) % 3 == 0 else base * (1 + r) + 7 * j + 1 for j in range(p)] for r in range(p)]


def _mixed(p: int) -> List[List[int]]:
    """Rank 0's stream well above a slot (several rounds), rank 1's just above the arena, the others' inline."""
    C = [[5 + r + j for j in range(p)] for r in range(p)]
    C[0] = [SLOT + 11 * j + 3 for j in range(p)]
    C[1] = [ARENA // (p - 1) + 1] * p
    return C


def _cases(p: int) -> List[Any]:
    cases = [_equal(p, n) for n in (0, 1, 7, 1001, ARENA // 8, SLOT + 3, 3 * SLOT // 8 + 5)]
    cases += [_uneven(p, b) for b in (0, 3, 900, SLOT // 2)]
    cases.append(_mixed(p))
    return cases


def _select(c: Comm, s: np.ndarray, sc: Any, r: np.ndarray, rc: Any) -> None:
    select.all_to_all(c, s, sc, r, rc)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_equal_uneven_and_zero_splits_int8_and_float64(world: Any, p: int) -> None:
    ts = world(p)
    cases = _cases(p)

    def body(r: int, make: Callable[..., Comm]) -> None:
        arena = make(0).arena
        if world.kind == "shm-python":  # type: ignore[attr-defined]
            assert not arena.native  # type: ignore[union-attr]
        for k, C in enumerate(cases):
            for dt in ("int8", "float64"):
                _check_a2a(r, make(2 * k + (dt == "int8") + 1), dt, C, k, A2A.alltoall_shm)

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3])
def test_every_dtype_through_the_selection(world: Any, p: int) -> None:
    ts = world(p)
    counts = [_equal(p, 1), _uneven(p, 5), _equal(p, 3001), _uneven(p, 5000)]

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for dt in DTYPES:
            for C in counts:
                k += 1
                _check_a2a(r, make(k), dt, C, k, _select)

    _run(ts, body)


def test_eight_ranks_memory_with_a_lagging_rank() -> None:
    p = 8
    ts = _form("memory", p, "x")
    ts[0].hub.big_slot = 4096  # type: ignore[attr-defined]
    cases = [_equal(p, 0), _equal(p, 9), _uneven(p, 300), _equal(p, 2000), _mixed(p)]

    def body(t: Transport) -> None:
        a = t.arena(0, list(range(p)))
        for k in range(3 * len(cases)):
            c = Comm(t, list(range(p)), t.rank, k + 1, Deadline.after(30), arena=a)
            if t.rank == k % p:
                time.sleep(0.002)
            _check_a2a(t.rank, c, "int32", cases[k % len(cases)], k, A2A.alltoall_shm)

    run_ranks(ts, body)


def test_results_match_the_message_algorithm_bit_for_bit(world: Any) -> None:
    p = 3
    ts = world(p)
    C = _uneven(p, 2000)

    def body(r: int, make: Callable[..., Comm]) -> None:
        rng = np.random.default_rng(r)
        send = rng.standard_normal(sum(C[r])).astype(np.float32)
        rc = [C[i][r] for i in range(p)]
        a, b = np.empty(sum(rc), np.float32), np.empty(sum(rc), np.float32)
        A2A.alltoall_shm(make(1), send, C[r], a, rc)
        MSG.alltoall_pairwise(make(2), send, C[r], b, rc)
        assert a.tobytes() == b.tobytes()

    _run(ts, body)


@pytest.mark.parametrize("how", ["limit", "no_big_slots"])
def test_streams_above_the_limit_or_without_big_slots_go_as_messages(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    p = 3
    ts = _form("memory", p, "x")
    if how == "no_big_slots":
        ts[0].hub.big_slot = 0  # type: ignore[attr-defined]
    else:
        ts[0].hub.big_slot = 4096  # type: ignore[attr-defined]
        monkeypatch.setitem(select.BIG_LIMIT, "all_to_all", 50_000)
    rounds: List[int] = []
    real = A2A._rounds
    monkeypatch.setattr(A2A, "_rounds", lambda *a: rounds.append(1) or real(*a))
    cases = [_equal(p, 7), _mixed(p), _equal(p, 40_000), _uneven(p, 12_000), _equal(p, 20_000)]

    def body(t: Transport) -> None:
        a = t.arena(0, list(range(p)))
        for k, C in enumerate(cases):
            c = Comm(t, list(range(p)), t.rank, k + 1, Deadline.after(30), arena=a)
            _check_a2a(t.rank, c, "int8", C, k, _select)

    run_ranks(ts, body)
    # limit 50 kB: _mixed (longest stream ~131 kB int8) and 2 x 40_000 go as messages; uneven 12_000 (longest
    # stream 36 kB) and 2 x 20_000 through the big slots; 7: inline
    assert len(rounds) == (0 if how == "no_big_slots" else 3 * 2), rounds


def test_count_mismatch_fails_on_every_rank_without_a_hang(world: Any) -> None:
    """Rank 1 expects one element fewer from rank 0 than rank 0 sends: inline and through the big slots."""
    p = 2
    ts = world(p)

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, n in enumerate((10, 3 * SLOT)):
            send = np.zeros(2 * n, np.int8)
            rc = [n - 1, n] if r == 1 else [n, n]
            recv = np.zeros(sum(rc), np.int8)
            t0 = time.monotonic()
            if n > ARENA or r == 1:  # inline: only the receiver can know (as with messages); big: every rank
                with pytest.raises(ProcGroupError, match="counts disagree") as ei:
                    A2A.alltoall_shm(make(k + 1, 20.0), send, [n, n], recv, rc)
                assert "rank 0" in str(ei.value) and "rank 1" in str(ei.value)
            else:
                A2A.alltoall_shm(make(k + 1, 20.0), send, [n, n], recv, rc)
            assert time.monotonic() - t0 < 10

    _run(ts, body)


@pytest.mark.parametrize("n", [100, 3 * SLOT])
def test_mismatched_calls_never_complete_and_time_out(world: Any, n: int) -> None:
    """Same sequence number, another op (all_gather) on rank 1: never done together, no data mixed."""
    ts = world(2)

    def body(r: int, make: Callable[..., Comm]) -> None:
        c = make(5, 1.0)
        recv = np.full(2 * n, -1, np.int16)
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError, match="did not arrive"):
            if r == 0:
                A2A.alltoall_shm(c, np.arange(2 * n, dtype=np.int16), [n, n], recv, [n, n])
            else:
                select.all_gather(c, np.arange(n, dtype=np.int16), recv)
        assert time.monotonic() - t0 < 10
        if r == 0:
            assert np.all(recv[n:] == -1), "rank 0 received data from a mismatched call"

    _run(ts, body)


@pytest.mark.parametrize("n", [100, 3 * SLOT])
def test_a_dead_peer_fails_the_waiter_naming_it(world: Any, n: int) -> None:
    ts = world(2)
    a = ts[0].arena(0, [0, 1])
    c = Comm(ts[0], [0, 1], 0, 1, Deadline.after(30), arena=a)
    ts[1].close()
    ts[0].mark_peer_failed(1, "rank 1 was killed (test)")
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError) as ei:
        A2A.alltoall_shm(c, np.ones(2 * n, np.float32), [n, n], np.empty(2 * n, np.float32), [n, n])
    assert ei.value.peer == 1 and time.monotonic() - t0 < 10


def test_dead_peer_between_big_rounds(world: Any) -> None:
    """Rank 1 leaves after the first round: rank 0 fails in a later round's sync, naming rank 1."""
    ts = world(2)
    n = 4 * SLOT
    gate = threading.Event()

    def body(r: int, make: Callable[..., Comm]) -> None:
        c = make(1, 30.0)
        if r == 1:
            orig = c.arena.big.sync  # type: ignore[union-attr]

            def sync_then_die(dl: Any) -> None:
                gate.set()  # first: rank 0 may see the failure below and check the gate before another line here
                ts[1].close()
                ts[0].mark_peer_failed(1, "rank 1 was killed (test)")
                raise PeerFailureError("rank 1 stops here (test)", peer=1)

            c.arena.big.sync = sync_then_die  # type: ignore[union-attr, method-assign]
            with pytest.raises(PeerFailureError):
                A2A.alltoall_shm(c, np.ones(2 * n, np.int8), [n, n], np.empty(2 * n, np.int8), [n, n])
            del orig
            return
        t0 = time.monotonic()
        with pytest.raises(PeerFailureError) as ei:
            A2A.alltoall_shm(c, np.ones(2 * n, np.int8), [n, n], np.empty(2 * n, np.int8), [n, n])
        assert ei.value.peer == 1 and time.monotonic() - t0 < 10
        assert gate.is_set()

    _run(ts, body)


def test_abort_wakes_a_waiting_member(world: Any) -> None:
    ts = world(2)
    a = ts[0].arena(0, [0, 1])
    c = Comm(ts[0], [0, 1], 0, 1, Deadline.after(60), arena=a)

    class Boom(ProcGroupError):
        pass

    threading.Timer(0.3, lambda: ts[0].abort(Boom("aborted by the test"))).start()
    t0 = time.monotonic()
    with pytest.raises(Boom):
        A2A.alltoall_shm(c, np.ones(20, np.float32), [10, 10], np.empty(20, np.float32), [10, 10])
    assert time.monotonic() - t0 < 10


def test_selection_uses_the_shm_path_only_with_an_arena_and_forced_names_work(monkeypatch: pytest.MonkeyPatch) -> None:
    p = 2
    ts = _form("memory", p, "x")
    used: List[str] = []
    monkeypatch.setattr(select, "alltoall_shm", lambda *a: used.append("shm") or A2A.alltoall_shm(*a))

    def body(t: Transport) -> None:
        a = t.arena(0, [0, 1])
        for k, arena in enumerate((a, None)):
            c = Comm(t, [0, 1], t.rank, k + 1, Deadline.after(30), arena=arena)
            _check_a2a(t.rank, c, "int32", _equal(p, 5), k, _select)

    run_ranks(ts, body)
    assert used == ["shm", "shm"], used  # once per rank, with the arena only
    assert select.ALGORITHMS["all_to_all"]["shm"] is A2A.alltoall_shm


def test_bad_arguments_fail_before_any_exchange_even_after_a_cached_layout(world: Any) -> None:
    """ConfigError for counts and buffers that cannot work, on the first call and once the counts' layout is
    cached (a buffer too small for counts seen before; element sizes that differ)."""
    from procgroup.errors import ConfigError

    ts = world(2)

    def body(r: int, make: Callable[..., Comm]) -> None:
        _check_a2a(r, make(1), "int32", _equal(2, 5), 1, A2A.alltoall_shm)  # caches the layout of [5, 5]
        bad = [
            (np.zeros(10, np.int32), [5, 5], np.zeros(9, np.int32), [5, 5]),  # recvbuf too small
            (np.zeros(9, np.int32), [5, 5], np.zeros(10, np.int32), [5, 5]),  # sendbuf too small
            (np.zeros(10, np.int32), [5, 5], np.zeros(10, np.int16), [5, 5]),  # element sizes differ
            (np.zeros(10, np.int32), [5, -5], np.zeros(10, np.int32), [5, 5]),  # negative
            (np.zeros(10, np.int32), [5], np.zeros(10, np.int32), [5, 5]),  # one count short
        ]
        for s, sc, o, rc in bad:
            with pytest.raises(ConfigError):
                A2A.alltoall_shm(make(2, 5.0), s, sc, o, rc)
        _check_a2a(r, make(3), "int32", _equal(2, 5), 3, A2A.alltoall_shm)  # nothing was published: in step

    _run(ts, body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipelined_windows_of_their_own_per_sender(world: Any, p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIPE_MIN 1 KiB: every sender cuts its stream into windows of its own size (uneven streams: unequal
    windows and round counts per sender), the ranks still agree on the rounds."""
    monkeypatch.setattr(A2A, "PIPE_MIN", 1024)
    ts = world(p)
    cases = [_uneven(p, 5000), _mixed(p), _equal(p, SLOT // 3 + 1), _uneven(p, SLOT // 2)]

    def body(r: int, make: Callable[..., Comm]) -> None:
        for k, C in enumerate(cases):
            _check_a2a(r, make(k + 1), "int8", C, k, A2A.alltoall_shm)

    _run(ts, body)


def test_an_arena_without_in_place_slots_stages_the_payload() -> None:
    """An Arena whose next_slot() is None (the base class's): header and data staged in scratch, then published."""
    p = 3
    ts = _form("memory", p, "x")
    ts[0].hub.big_slot = 4096  # type: ignore[attr-defined]

    def body(t: Transport) -> None:
        a = t.arena(0, list(range(p)))
        a.next_slot = lambda: None  # type: ignore[method-assign, union-attr]
        for k, C in enumerate([_equal(p, 0), _equal(p, 9), _uneven(p, 700), _mixed(p)]):
            c = Comm(t, list(range(p)), t.rank, k + 1, Deadline.after(30), arena=a)
            _check_a2a(t.rank, c, "float32", C, k, A2A.alltoall_shm)

    run_ranks(ts, body)


def test_world_size_one_has_no_arena_and_copies_locally() -> None:
    t = _form("memory", 1, "x")[0]
    assert t.arena(0, [0]) is None
    for k, n in enumerate((0, 1, 7, SLOT + 3)):
        c = Comm(t, [0], 0, k + 1, Deadline.after(5), arena=None)
        _check_a2a(0, c, "int16", [[n]], k, _select)
