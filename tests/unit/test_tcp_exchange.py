"""TCP: the phases of a stage between hosts, one call each, bound once (``TcpTransport.phases``, ``Comm.phases``;
issue 14).

Ranks are threads over real sockets (``_form``).  A bound phase's ``start`` claims the connections' reading roles
(kept until ``end()``), sends, and reads every receive with the compiled ``read_frames``; where it cannot claim them
(the compiled read not built, a role taken, an earlier message of the tag already read) it does nothing and returns
None.
Raw frames written into a peer's socket reach every hand-back: another tag first, EOF mid-message, the deadline.
The messages on the wire are those of ``isend``, so a rank on the usual path meets a rank on this one.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Iterator, List

import numpy as np
import pytest

from procgroup.algorithms._util import SPAN, SubComm
from procgroup.algorithms.comm import Comm
from procgroup.algorithms.direct import allreduce_direct, allreduce_direct_rsag
from procgroup.deadline import Deadline
from procgroup.errors import DistTimeoutError, PeerFailureError
from procgroup.ops import ReduceOp, reducer
from procgroup.protocol.frames import encode_header
from procgroup.transport import _tcp_read
from procgroup.transport._tcp_phase import TcpPhases

from .test_tcp_wait_many import _Counting
from .test_transport_conformance import _form, run_ranks

pytestmark = pytest.mark.timeout(60)

TAG = 91


@pytest.fixture
def counting(monkeypatch: Any) -> Iterator[_Counting]:
    if _tcp_read._tcpwait is None:
        pytest.skip("the compiled _tcpwait was not built")
    c = _Counting(_tcp_read._tcpwait)
    monkeypatch.setattr(_tcp_read, "_tcpwait", c)
    yield c


@pytest.fixture
def world() -> Iterator[List[Any]]:
    ts = _form("tcp", 3, f"exchange{time.monotonic_ns()}")
    yield ts
    for t in ts:
        t.close()


def _exchange(t: Any, sends: List[Any], recvs: List[Any], dl: Any) -> Any:
    """``(sends' requests, receives not arrived whole)`` of a phase of ``sends`` / ``recvs`` ((rank, tag, buffer),
    one tag) bound on ``t``, or None where it was not taken; the roles given back after it."""
    ph = t.phases([d for d, _, _ in sends], [s for s, _, _ in recvs])
    assert ph is not None
    tag = (sends or recvs)[0][1]
    assert all(q[1] == tag for q in sends + recvs)
    try:
        return ph.start(tag, [b for _, _, b in sends], [o for _, _, o in recvs], dl)
    finally:
        ph.end()


def _frame(tag: int, payload: bytes) -> bytes:
    return encode_header(tag, len(payload), 0) + payload


def _phase(t: Any, r: int, tag: int, n: int) -> Any:
    """Rank ``r`` sends ``r*10+j`` bytes of value to each other rank j and receives theirs; its received arrays.
    Where ``exchange`` refuses the phase, the usual isend / irecv do it."""
    peers = [(r + 1) % 3, (r + 2) % 3]
    outs = {j: np.zeros(n, np.uint8) for j in peers}
    sends = [(j, tag, np.full(n, r * 10 + j, np.uint8)) for j in peers]
    got = _exchange(t, sends, [(j, tag, outs[j]) for j in peers], None)
    if got is None:  # refused (a peer's message came first and the watcher read it): the usual path, as Comm does
        got = ([t.isend(j, tg, b) for j, tg, b in sends], [t.irecv(j, tag, outs[j]) for j in peers])
    dl = Deadline.after(10)
    for q in got[1] + got[0]:
        q.wait(dl)
    return outs


@pytest.mark.parametrize("n", [1, 1000, 300_000])
def test_three_ranks_exchange_in_one_call_each(world: List[Any], counting: _Counting, n: int) -> None:
    for k in range(3):
        outs = run_ranks(world, lambda t, k=k: _phase(t, t.rank, TAG + k, n))
        for r in range(3):
            for j, o in outs[r].items():
                assert (o == j * 10 + r).all(), (k, r, j)
    assert counting.calls >= 1


def test_a_rank_on_the_usual_path_meets_one_in_one_call(world: List[Any], counting: _Counting) -> None:
    n = 70_000

    def usual(r: int) -> Any:
        t, peers = world[r], [(r + 1) % 3, (r + 2) % 3]
        outs = {j: np.zeros(n, np.uint8) for j in peers}
        rr = [t.irecv(j, TAG, outs[j]) for j in peers]
        ss = [t.isend(j, TAG, np.full(n, r * 10 + j, np.uint8)) for j in peers]
        for q in rr + ss:
            q.wait(Deadline.after(10))
        return outs

    outs = run_ranks(world, lambda t: usual(1) if t.rank == 1 else _phase(t, t.rank, TAG, n))
    for r in range(3):
        for j, o in outs[r].items():
            assert (o == j * 10 + r).all(), (r, j)


def test_nothing_is_done_where_the_phase_cannot_be_claimed(world: List[Any], counting: _Counting) -> None:
    """An earlier message of the tag already read (unexpected), or a role another thread holds: None, no byte sent,
    and the usual receive still gets the message."""
    t1 = world[1]
    early = world[0].isend(1, TAG, b"early")
    dl = Deadline.after(10)
    early.wait(dl)
    while not t1._unexpected.get(TAG):  # the watcher reads it (no receive posted)
        time.sleep(0.01)
    out = bytearray(5)
    assert _exchange(t1, [(0, TAG, b"never")], [(0, TAG, out)], dl) is None
    assert t1.irecv(0, TAG, out).wait(dl).nbytes == 5 and bytes(out) == b"early"
    c = t1._conns[2]
    assert t1._take(c)
    try:
        assert _exchange(t1, [(2, TAG + 1, b"never")], [(2, TAG + 1, bytearray(1))], dl) is None
    finally:
        t1._give(c)
    # nothing of either refused call reached the peers: their next message of those tags is the real one
    world[1].isend(0, TAG + 5, b"x").wait(dl)
    assert world[0].irecv(1, TAG + 5, bytearray(1)).wait(dl).nbytes == 1
    assert counting.calls == 0


def test_a_message_of_another_tag_first_is_handed_back_and_the_phase_completes(
    world: List[Any], counting: _Counting
) -> None:
    t1 = world[1]
    a, b = bytearray(4), bytearray(4)

    def peers() -> None:
        time.sleep(0.05)
        world[0]._conns[1].sock.sendall(_frame(TAG + 7, b"OTHR") + _frame(TAG, b"aaaa"))
        world[2]._conns[1].sock.sendall(_frame(TAG, b"cccc"))

    th = threading.Thread(target=peers)
    th.start()
    dl = Deadline.after(10)
    got = _exchange(t1, [], [(0, TAG, a), (2, TAG, b)], dl)
    assert got is not None and got[1]  # the message of the other tag: handed back, its receive waited for
    for q in got[1]:
        q.wait(dl)
    th.join()
    assert (bytes(a), bytes(b)) == (b"aaaa", b"cccc")
    other = bytearray(4)
    assert t1.irecv(0, TAG + 7, other).wait(dl).nbytes == 4 and bytes(other) == b"OTHR"
    assert counting.calls >= 1


def test_the_deadline_ends_the_phase_with_the_usual_timeout(world: List[Any], counting: _Counting) -> None:
    dl = Deadline.after(0.3)
    got = _exchange(world[1], [], [(0, TAG, bytearray(8)), (2, TAG, bytearray(8))], dl)
    assert got is not None
    with pytest.raises(DistTimeoutError):
        for q in got[1]:
            q.wait(dl)
    # the receives went back to the engine: a message that comes later completes them
    world[0].isend(1, TAG, b"12345678").wait(Deadline.after(5))
    assert got[1][0].wait(Deadline.after(5)).nbytes == 8


def test_eof_in_the_middle_of_a_message_fails_the_peer(world: List[Any], counting: _Counting) -> None:
    def cut() -> None:
        time.sleep(0.05)
        s = world[0]._conns[1].sock
        s.sendall(_frame(TAG, b"abcdefgh")[:30])
        s.close()

    th = threading.Thread(target=cut)
    th.start()
    dl = Deadline.after(10)
    got = _exchange(world[1], [], [(0, TAG, bytearray(8))], dl)
    th.join()
    assert got is not None
    with pytest.raises(PeerFailureError, match="rank 0"):
        got[1][0].wait(dl)


@pytest.mark.parametrize("alg", [allreduce_direct, allreduce_direct_rsag])
def test_the_direct_all_reduce_takes_one_call_a_phase(world: List[Any], counting: _Counting, alg: Any) -> None:
    """The direct all-reduces over Comms of tcp transports: every phase through the bound phases, every dtype's sum
    in closed form, and the same result as the message path (no phases bound)."""
    for dt in ("int32", "float64", "uint8"):
        for fast in (True, False):
            n = 30_001

            def rank(r: int, dt: str = dt, n: int = n) -> Any:
                c = Comm(world[r], list(range(3)), r, 1 << 20, Deadline.after(20))
                buf = (np.arange(n) % 50 + r).astype(dt)
                alg(c, buf, reducer(ReduceOp.SUM, dt))
                return buf

            real, real_start, taken = Comm.phases, TcpPhases.start, []

            def start(self: Any, *a: Any, _real: Any = real_start, _taken: List[bool] = taken) -> Any:
                got = _real(self, *a)
                _taken.append(got is not None)
                return got

            TcpPhases.start = start  # type: ignore[method-assign]
            if not fast:
                Comm.phases = lambda *a, **k: None  # type: ignore[method-assign,assignment]
            try:
                outs = run_ranks(world, lambda t: rank(t.rank))
            finally:
                Comm.phases = real  # type: ignore[method-assign]
                TcpPhases.start = real_start  # type: ignore[method-assign]
            want = (3 * (np.arange(n) % 50) + 3).astype(dt)
            for o in outs:
                assert np.array_equal(o, want), (dt, fast)
            assert any(taken) if fast else not taken, (dt, fast, taken)


def test_a_comm_binds_each_phase_once_and_its_later_calls_reuse_it(world: List[Any], counting: _Counting) -> None:
    """A plan's Comm keeps its bound phases: later calls (a new tag and deadline each, as the group sets them) run
    through the same objects, with the call's own tag on the wire, and a sub-group binds through its parent; no
    role stays claimed after a call."""
    comms = [Comm(world[r], list(range(3)), r, 1 << 20, Deadline.after(20)) for r in range(3)]
    subs = [SubComm(c, [2, 0, 1], 2 * SPAN) for c in comms]  # the leaders' sub-group of a hierarchical call
    n = 9_000
    bound: List[Any] = []
    for call in range(4):
        for c in comms:
            c.tag, c.deadline = ((1 << 20) + call) << 16, Deadline.after(20)

        def rank(r: int, call: int = call) -> Any:
            buf = (np.arange(n) % 7 + r + call).astype(np.int64)
            sub = subs[r]
            sub.deadline = comms[r].deadline
            allreduce_direct_rsag(sub if call % 2 else comms[r], buf, reducer(ReduceOp.SUM, "int64"))
            return buf

        outs = run_ranks(world, lambda t: rank(t.rank))
        want = 3 * (np.arange(n) % 7) + 3 + 3 * call
        for o in outs:
            assert np.array_equal(o, want), call
        bound.append([dict(c._phases) for c in comms])
    # bound once (the Comm's own peers and, where the sub-group orders them differently, the sub-group's), every
    # later call through the objects an earlier one bound, the sub-group's through its parent's
    assert all(1 <= len(b) <= 2 and all(v is not None for v in b.values()) for b in bound[-1])
    inner = [{id(v.inner) for v in c._phases.values()} for c in comms]
    assert all(len(s._phases) == 1 and {id(v.inner) for v in s._phases.values()} <= i for s, i in zip(subs, inner))
    assert all(bound[-1][r][key] is b[r][key] for b in bound for r in range(3) for key in b[r])
    assert not any(c.role.locked() for t in world for c in t._conns.values())
    # nothing of any call is left behind: no unexpected message, no posted receive, no connection in flight
    for t in world:
        assert not t._unexpected and not t._posted and not t._inflight


def test_the_roles_stay_claimed_between_phases_until_end(world: List[Any], counting: _Counting) -> None:
    """After a phase whose messages all arrived, its connections stay claimed (nobody else reads them, so the next
    phase needs no new claim); ``end()`` gives them back, and a usual receive then reads the connection."""
    n = 5000
    phs = [world[r].phases([(r + 1) % 3, (r + 2) % 3], [(r + 1) % 3, (r + 2) % 3]) for r in range(3)]

    def rank(r: int) -> Any:
        outs = [np.zeros(n, np.uint8), np.zeros(n, np.uint8)]
        for k in range(2):
            sends = [np.full(n, 10 * r + k, np.uint8)] * 2
            got = phs[r].start(TAG + k, sends, outs, Deadline.after(10))
            assert got is not None and got == ([], []), got
            assert all(c.role.locked() for c in phs[r].rconns)
            assert [int(o[0]) for o in outs] == [10 * ((r + 1) % 3) + k, 10 * ((r + 2) % 3) + k]
        return True

    # claimed before any message flies (fresh connections are the watcher's: it would read an early message)
    assert all(ph._claim() for ph in phs)
    try:
        assert run_ranks(world, lambda t: rank(t.rank)) == [True] * 3
    finally:
        for ph in phs:
            ph.end()
    assert not any(c.role.locked() for t in world for c in t._conns.values())
    world[0].isend(1, TAG + 9, b"after").wait(Deadline.after(5))
    out = bytearray(5)
    assert world[1].irecv(0, TAG + 9, out).wait(Deadline.after(5)).nbytes == 5 and bytes(out) == b"after"


def test_an_abort_during_a_phase_fails_it_at_once_with_the_abort_error(world: List[Any], counting: _Counting) -> None:
    err = RuntimeError("aborted by the test")
    threading.Timer(0.2, lambda: world[1].abort(err)).start()
    ph = world[1].phases([], [0, 2])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted by the test"):
        ph.run(TAG, [], [bytearray(8), bytearray(8)], Deadline.after(20))
    assert time.monotonic() - t0 < 5
    assert not ph.held and not any(c.role.locked() for c in world[1]._conns.values())


def test_read_frames_holds_a_finished_connection_while_it_sleeps_for_another() -> None:
    """``read_frames(..., hold=True)`` sleeps for the pending socket with a finished one kept (it returns once all
    arrived); without ``hold`` it returns 3 first, so the caller can give the finished connection back."""
    if _tcp_read._tcpwait is None:
        pytest.skip("the compiled _tcpwait was not built")
    import socket

    for hold in (False, True):
        pairs = [socket.socketpair() for _ in range(2)]
        try:
            pairs[0][1].sendall(_frame(TAG, b"first"))
            later = threading.Timer(0.1, lambda p=pairs: p[1][1].sendall(_frame(TAG, b"later")))
            later.start()
            outs = (bytearray(5), bytearray(5))
            prog = np.zeros(10, np.int64)
            fds = tuple(p[0].fileno() for p in pairs)
            r, w = os.pipe()
            try:
                code = _tcp_read._tcpwait.read_frames(fds, (TAG, TAG), outs, bytearray(48), prog, 0, 5 * 10**9, r, hold)
                if not hold:  # the finished one first; then the caller waits for the pending one alone
                    assert code == 3 and prog[0] == 1 and prog[5] == 0, (code, prog)
                    rest = np.zeros(5, np.int64)
                    code = _tcp_read._tcpwait.read_frames(
                        fds[1:], (TAG,), outs[1:], bytearray(24), rest, 0, 5 * 10**9, r
                    )
                    prog[5:] = rest
                assert code == 0 and prog[0] == 1 and prog[5] == 1, (hold, code, prog)
                assert bytes(outs[0]) == b"first" and bytes(outs[1]) == b"later"
            finally:
                later.join()
                os.close(r)
                os.close(w)
        finally:
            for a, b in pairs:
                a.close()
                b.close()


def test_an_error_between_slices_hands_a_half_read_message_back_to_the_decoder(
    world: List[Any], counting: _Counting
) -> None:
    """The router's progress pass (``between``) raising after a slice that read half a message: the error
    propagates, the roles are given back, and the decoder goes on from the byte reached: the rest of that message
    lands in its (abandoned) receive, and the next message on the connection arrives whole."""
    frame = _frame(TAG, bytes(range(200)))
    s = world[0]._conns[1].sock
    ph = world[1].phases([], [0])
    sent = threading.Event()

    def send_half() -> None:
        # once the phase holds the connection: sent earlier, the bytes may wake the connection's own reader first,
        # which then owns the half-read frame and the phase is not claimed at all (start returns None; 1 run in 15)
        end = time.monotonic() + 10
        while not ph.held and time.monotonic() < end:
            time.sleep(0.001)
        s.sendall(frame[:100])  # the header and 76 payload bytes
        sent.set()

    def boom() -> None:
        sent.wait(10)
        raise RuntimeError("progress failed")

    th = threading.Thread(target=send_half, daemon=True)
    th.start()
    try:
        with pytest.raises(RuntimeError, match="progress failed"):
            ph.start(TAG, [], [bytearray(200)], Deadline.after(10), lambda: 0.05, boom)
    finally:
        th.join(10)
    assert not ph.held and not world[1]._conns[0].role.locked()
    s.sendall(frame[100:] + _frame(TAG + 1, b"next message"))
    out = bytearray(12)
    assert world[1].irecv(0, TAG + 1, out).wait(Deadline.after(10)).nbytes == 12
    assert bytes(out) == b"next message"
