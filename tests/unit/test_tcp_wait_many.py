"""TCP: several receives read at once (``TcpReading.wait_many``, the compiled ``_tcpwait.read_frames``; issue 14).

Ranks are threads over real sockets.  Ranks 0 and 2 write raw frames to rank 1 through their own sockets, so every
case the compiled loop hands back is reachable: a message of another tag first, a message longer than the buffer,
several frames, a header or payload cut by the deadline, EOF and garbage mid-message, an abort.  Every case runs on
the compiled path and on the pure-Python one (``_tcpwait`` None: ``wait_many`` does nothing and ``req.wait`` reads);
the outcome must be the same, and on the compiled path the compiled loop must have run.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterator, List

import numpy as np
import pytest

from procgroup.deadline import Deadline
from procgroup.errors import PeerFailureError, ProcGroupError
from procgroup.protocol.frames import FLAG_MORE, encode_header
from procgroup.transport import _tcp_read

from .test_transport_conformance import _form

pytestmark = pytest.mark.timeout(60)

TAG = 77


class _Counting:
    """Stands in for the compiled module: counts calls of read_frames."""

    def __init__(self, mod: Any) -> None:
        self.mod, self.calls = mod, 0

    def read_frames(self, *a: Any) -> int:
        self.calls += 1
        return int(self.mod.read_frames(*a))


@pytest.fixture(params=["compiled", "python"])
def path(request: Any, monkeypatch: Any) -> Iterator[Any]:
    if request.param == "compiled":
        if _tcp_read._tcpwait is None:
            pytest.skip("the compiled _tcpwait was not built")
        c = _Counting(_tcp_read._tcpwait)
        monkeypatch.setattr(_tcp_read, "_tcpwait", c)
        yield c
        assert c.calls >= 1, "the compiled loop never ran"
    else:
        monkeypatch.setattr(_tcp_read, "_tcpwait", None)
        yield None


@pytest.fixture
def world(path: Any) -> Iterator[Any]:
    ts = _form("tcp", 3, f"many{id(path)}")
    yield ts
    for t in ts:
        t.close()


def _wire(ts: List[Any], src: int) -> Any:
    return ts[src]._conns[1].sock  # rank src's socket to rank 1


def _frame(tag: int, payload: bytes, flags: int = 0) -> bytes:
    return encode_header(tag, len(payload), flags) + payload


def _later(delay: float, fn: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def _wait_all(t: Any, reqs: List[Any], timeout: float = 10.0) -> List[Any]:
    dl = Deadline.after(timeout)
    t.wait_many(reqs, dl)
    return [r.wait(dl) for r in reqs]


def test_two_peers_at_once(world: Any, path: Any) -> None:
    a, b = bytearray(1000), bytearray(70000)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    pa, pb = bytes(range(250)) * 4, np.arange(70000, dtype=np.uint8).tobytes()
    th = [
        _later(0.05, lambda: _wire(world, 0).sendall(_frame(TAG, pa))),
        _later(0.15, lambda: _wire(world, 2).sendall(_frame(TAG, pb))),
    ]
    sts = _wait_all(world[1], [ra, rb])
    assert [s.nbytes for s in sts] == [1000, 70000] and [s.source for s in sts] == [0, 2]
    assert bytes(a) == pa and bytes(b) == pb
    for x in th:
        x.join()


def test_real_sends_and_a_short_message(world: Any, path: Any) -> None:
    """Through isend: the receive buffers are larger than the messages (a message may be shorter)."""
    got = [np.zeros(64, np.int64), np.zeros(64, np.int64)]
    reqs = [world[1].irecv(0, TAG, got[0]), world[1].irecv(2, TAG, got[1])]
    _later(0.05, lambda: world[0].isend(1, TAG, np.arange(10, dtype=np.int64)).wait(Deadline.after(5)))
    _later(0.05, lambda: world[2].isend(1, TAG, np.arange(64, dtype=np.int64) * 3).wait(Deadline.after(5)))
    sts = _wait_all(world[1], reqs)
    assert [s.nbytes for s in sts] == [80, 512]
    assert got[0][:10].tolist() == list(range(10)) and got[1].tolist() == [3 * i for i in range(64)]


def test_a_message_of_another_tag_first_is_left_unexpected(world: Any, path: Any) -> None:
    a, b = bytearray(8), bytearray(8)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    _later(0.1, lambda: _wire(world, 0).sendall(_frame(TAG + 1, b"other!!!") + _frame(TAG, b"mine-000")))
    _later(0.05, lambda: _wire(world, 2).sendall(_frame(TAG, b"mine-222")))
    _wait_all(world[1], [ra, rb])
    assert bytes(a) == b"mine-000" and bytes(b) == b"mine-222"
    late = bytearray(8)
    world[1].irecv(0, TAG + 1, late).wait(Deadline.after(5))
    assert bytes(late) == b"other!!!"


def test_a_message_longer_than_the_buffer_is_a_size_error_and_the_stream_stays_in_sync(world: Any, path: Any) -> None:
    a, b = bytearray(100), bytearray(4)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    _later(0.1, lambda: _wire(world, 0).sendall(_frame(TAG, bytes(200)) + _frame(TAG + 1, b"next")))
    _later(0.1, lambda: _wire(world, 2).sendall(_frame(TAG, b"2222")))
    dl = Deadline.after(10)
    world[1].wait_many([ra, rb], dl)
    with pytest.raises(ProcGroupError, match="200 bytes from rank 0 .* does not fit the receive buffer of 100"):
        ra.wait(dl)
    assert rb.wait(dl).nbytes == 4 and bytes(b) == b"2222"
    nxt = bytearray(4)
    world[1].irecv(0, TAG + 1, nxt).wait(dl)
    assert bytes(nxt) == b"next"


def test_a_message_of_several_frames(world: Any, path: Any) -> None:
    a, b = bytearray(6), bytearray(3)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    _later(0.1, lambda: _wire(world, 0).sendall(_frame(TAG, b"abc", FLAG_MORE) + _frame(TAG, b"def")))
    _later(0.1, lambda: _wire(world, 2).sendall(_frame(TAG, b"xyz")))
    sts = _wait_all(world[1], [ra, rb])
    assert sts[0].nbytes == 6 and bytes(a) == b"abcdef" and bytes(b) == b"xyz"


@pytest.mark.parametrize("cut", [10, 24, 24 + 3000], ids=["in-header", "after-header", "in-payload"])
def test_the_deadline_cuts_a_message_and_a_later_wait_finishes_it(world: Any, path: Any, cut: int) -> None:
    payload = np.random.default_rng(cut).integers(0, 256, 10000, dtype=np.uint8).tobytes()
    wire = _frame(TAG, payload)
    a, b = bytearray(10000), bytearray(2)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    _later(0.05, lambda: _wire(world, 0).sendall(wire[:cut]))
    _later(0.05, lambda: _wire(world, 2).sendall(_frame(TAG, b"ok")))
    t0 = time.monotonic()
    world[1].wait_many([ra, rb], Deadline.after(0.3))
    assert time.monotonic() - t0 < 2.0
    assert rb.wait(Deadline.after(5)).nbytes == 2 and not ra.test()
    _later(0.1, lambda: _wire(world, 0).sendall(wire[cut:] + _frame(TAG + 1, b"after")))
    assert ra.wait(Deadline.after(10)).nbytes == 10000 and bytes(a) == payload
    nxt = bytearray(5)
    world[1].irecv(0, TAG + 1, nxt).wait(Deadline.after(5))
    assert bytes(nxt) == b"after"


@pytest.mark.parametrize(
    "wire", [_frame(TAG, b"abcdef")[:27], b"XX" + _frame(TAG, b"abcdef")[2:]], ids=["eof", "garbage"]
)
def test_eof_or_garbage_mid_message_fails_the_peer(world: Any, path: Any, wire: bytes) -> None:
    a, b = bytearray(6), bytearray(2)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    s = _wire(world, 0)
    garbage = wire.startswith(b"XX")
    match = "protocol error" if garbage else "closed"

    def write() -> None:
        _wire(world, 2).sendall(_frame(TAG, b"ok"))
        s.sendall(wire)
        if not garbage:
            s.shutdown(socket.SHUT_WR)

    _later(0.1, write)
    dl = Deadline.after(10)
    world[1].wait_many([ra, rb], dl)
    with pytest.raises(PeerFailureError, match=match) as ei:
        ra.wait(dl)
    assert ei.value.peer == 0
    assert rb.wait(dl).nbytes == 2


def test_an_abort_ends_the_wait_at_once(world: Any, path: Any) -> None:
    a, b = bytearray(6), bytearray(6)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    err = RuntimeError("aborted by the test")
    _later(0.2, lambda: world[1].abort(err))
    t0 = time.monotonic()
    world[1].wait_many([ra, rb], Deadline.after(20))
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(RuntimeError, match="aborted by the test"):
        ra.wait(Deadline.after(1))


def test_receives_it_cannot_take_are_left_to_wait(world: Any, path: Any) -> None:
    """Two receives from one peer, and one behind an earlier receive of the same tag: all still complete in order."""
    first, second, other = bytearray(3), bytearray(3), bytearray(3)
    r1 = world[1].irecv(0, TAG, first)
    r2 = world[1].irecv(0, TAG, second)
    r3 = world[1].irecv(2, TAG, other)
    _later(0.1, lambda: _wire(world, 0).sendall(_frame(TAG, b"one") + _frame(TAG, b"two")))
    _later(0.1, lambda: _wire(world, 2).sendall(_frame(TAG, b"333")))
    _wait_all(world[1], [r2, r1, r3])
    assert (bytes(first), bytes(second), bytes(other)) == (b"one", b"two", b"333")


def test_procgroup_native_0_keeps_the_python_path(monkeypatch: Any) -> None:
    """``TcpOptions(native=False)`` (``PROCGROUP_NATIVE=0``): the compiled loop never runs, the receives complete."""
    from procgroup.config import TcpOptions, tcp_options

    assert tcp_options({"PROCGROUP_NATIVE": "0"}).native is False and tcp_options({}).native is True
    if _tcp_read._tcpwait is None:
        pytest.skip("the compiled _tcpwait was not built")
    c = _Counting(_tcp_read._tcpwait)
    monkeypatch.setattr(_tcp_read, "_tcpwait", c)
    ts = _form("tcp", 3, "many-native0", tcp_options=TcpOptions(native=False))
    try:
        a, b = bytearray(3), bytearray(3)
        ra, rb = ts[1].irecv(0, TAG, a), ts[1].irecv(2, TAG, b)
        _later(0.05, lambda: _wire(ts, 0).sendall(_frame(TAG, b"aaa")))
        _later(0.05, lambda: _wire(ts, 2).sendall(_frame(TAG, b"bbb")))
        _wait_all(ts[1], [ra, rb])
        assert (bytes(a), bytes(b)) == (b"aaa", b"bbb") and c.calls == 0
    finally:
        for t in ts:
            t.close()


def test_ctrl_c_during_the_wait_leaves_the_connection_usable(world: Any, path: Any) -> None:
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    a, b = bytearray(5), bytearray(5)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            world[1].wait_many([ra, rb], Deadline.after(10))
            ra.wait(Deadline.after(10))  # the Python path: the interrupt comes here
        assert time.monotonic() - t0 < 0.8  # the compiled loop returns at the signal, not at its 1 s slice
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    _wire(world, 0).sendall(_frame(TAG, b"after"))
    _wire(world, 2).sendall(_frame(TAG, b"other"))
    _wait_all(world[1], [ra, rb])
    assert (bytes(a), bytes(b)) == (b"after", b"other")


def test_a_connection_is_not_held_while_another_thread_needs_it(world: Any, path: Any) -> None:
    """Thread A waits for tag T from ranks 0 and 2 and holds both connections; then thread B waits for tag U from
    rank 0, whose message comes first.  Rank 2 sends A's message only once B has its own: A must hand rank 0's
    connection back at once (not hold it while it sleeps for rank 2), or B never reads and A waits until its
    deadline."""
    U = TAG + 5
    a0, a2, bu = bytearray(3), bytearray(3), bytearray(3)
    ra0, ra2 = world[1].irecv(0, TAG, a0), world[1].irecv(2, TAG, a2)
    b_got = threading.Event()
    took: List[float] = []

    def thread_a() -> None:
        t0 = time.monotonic()
        _wait_all(world[1], [ra0, ra2], timeout=20)
        took.append(time.monotonic() - t0)

    def thread_b() -> None:
        world[1].irecv(0, U, bu).wait(Deadline.after(20))
        b_got.set()

    def rank2() -> None:
        if b_got.wait(20):
            _wire(world, 2).sendall(_frame(TAG, b"a-2"))

    ta = threading.Thread(target=thread_a, daemon=True)
    ta.start()
    time.sleep(0.1)  # A holds both connections now (its compiled wait, or its Python wait on the first)
    tb, t2 = threading.Thread(target=thread_b, daemon=True), threading.Thread(target=rank2, daemon=True)
    tb.start()
    t2.start()
    time.sleep(0.1)
    _wire(world, 0).sendall(_frame(U, b"b-0") + _frame(TAG, b"a-0"))
    for th in (ta, tb, t2):
        th.join(25)
    assert took and took[0] < 5.0, took
    assert (bytes(a0), bytes(a2), bytes(bu)) == (b"a-0", b"a-2", b"b-0")


def test_an_abort_in_the_middle_of_a_payload(world: Any, path: Any) -> None:
    """The receive fails while its payload is half read: the decoder takes the connection over and discards the
    rest (nothing is left posted, nothing lands in another buffer), and the receive reports the abort."""
    wire = _frame(TAG, bytes(range(200)) * 50)
    a, b = bytearray(10000), bytearray(2)
    ra, rb = world[1].irecv(0, TAG, a), world[1].irecv(2, TAG, b)
    _later(0.05, lambda: _wire(world, 0).sendall(wire[: 24 + 4000]))
    _later(0.3, lambda: world[1].abort(RuntimeError("aborted mid-payload")))
    t0 = time.monotonic()
    world[1].wait_many([ra, rb], Deadline.after(20))
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(RuntimeError, match="aborted mid-payload"):
        ra.wait(Deadline.after(1))
    assert ra not in world[1]._posted.get(TAG, [])  # type: ignore[attr-defined]  # (rb stays, as on the Python path)


def test_without_the_compiled_wait_one_line_says_so(monkeypatch: Any, caplog: Any) -> None:
    import logging

    monkeypatch.setattr(_tcp_read, "_tcpwait", None)
    monkeypatch.setattr(_tcp_read, "_noticed", False)
    ts = _form("tcp", 2, "many-notice")
    try:
        with caplog.at_level(logging.INFO, logger="procgroup.transport"):
            for _ in range(3):
                r = ts[1].irecv(0, TAG, bytearray(1))
                ts[1].wait_many([r], Deadline.after(1))
                ts[0].isend(1, TAG, b"x").wait(Deadline.after(5))
                r.wait(Deadline.after(5))
        lines = [rec.getMessage() for rec in caplog.records if "_tcpwait" in rec.getMessage()]
        assert len(lines) == 1 and "not built" in lines[0], lines
    finally:
        for t in ts:
            t.close()
