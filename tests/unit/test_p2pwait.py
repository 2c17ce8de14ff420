"""The compiled helpers of the shm transport's blocking fast path (``_p2pwait``: wait_head, put, take, stream).

put with a bell value rings the consumer's doorbell (the handshake with its sleep flag), take with the tail and
want-flag indices releases the ring (the handshake with a producer waiting for room)."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from procgroup.transport import _futex
from procgroup.transport.shm.layout import OFF_BELL, OFF_SLEEP

try:
    from procgroup.transport.shm import _p2pwait
    from procgroup.transport.shm._p2pwait import put, put_stream, stream, take, wait_head
except ImportError:  # not built: recv_fast polls in Python (covered by tests/integration/test_p2p_fast_procs.py)
    wait_head = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(wait_head is None, reason="the _p2pwait extension was not built (no C compiler?)"),
]


def _ring() -> memoryview:
    return memoryview(bytearray(64)).cast("Q")


def test_returns_at_once_when_the_head_already_moved() -> None:
    q = _ring()
    q[3] = 48
    assert wait_head(q, 3, 32, 10**9, True) == 48


def test_gives_up_after_the_spin() -> None:
    q = _ring()
    q[1] = 16
    t0 = time.monotonic()
    assert wait_head(q, 1, 16, 5_000_000, False) == 16
    assert time.monotonic() - t0 >= 0.004


def test_sees_a_write_of_another_thread_while_it_polls_without_the_gil() -> None:
    q = _ring()

    def publish() -> None:
        time.sleep(0.02)
        q[2] = 80  # a Python thread: it can run only because the poll released the GIL

    t = threading.Thread(target=publish)
    t.start()
    t0 = time.monotonic()
    got = wait_head(q, 2, 0, 10 * 10**9, True)
    t.join()
    assert got == 80 and time.monotonic() - t0 < 5


def test_bad_arguments() -> None:
    q = _ring()
    with pytest.raises(IndexError):
        wait_head(q, 8, 0, 0, True)
    with pytest.raises(IndexError):
        wait_head(q, -1, 0, 0, True)
    with pytest.raises(TypeError):
        wait_head(q, 0, 0)  # type: ignore[call-arg]


def test_put_take_round_trip_with_wrap_and_the_refusals() -> None:
    data = memoryview(bytearray(64))
    q = memoryview(bytearray(16)).cast("Q")  # q[0]: head, q[1]: tail
    assert put(data, q, 0, 1, 0, 7, b"abcdefghijklmnopq") == 33 and q[0] == 33
    out = bytearray(20)
    assert take(data, q, 0, 0, 6, memoryview(out)) == -1  # another tag
    assert take(data, q, 0, 0, 7, memoryview(bytearray(16))) == -1  # does not fit the buffer
    assert take(data, q, 0, 0, 7, memoryview(out)) == 17 and bytes(out[:17]) == b"abcdefghijklmnopq"
    assert put(data, q, 0, 1, 33, 9, bytes(40)) == -1 and q[0] == 33  # no room until the tail moves
    q[1] = 33
    payload = bytes(range(100, 130))  # header at 48, payload wraps to the ring's start
    assert put(data, q, 0, 1, 33, 9, payload) == 94
    out = bytearray(30)
    assert take(data, q, 0, 33, 9, memoryview(out)) == 30 and bytes(out) == payload
    q[0] = 60  # the header published, the payload not yet
    assert take(data, q, 0, 33, 9, memoryview(out)) == -1


def test_put_take_bad_rings() -> None:
    q = memoryview(bytearray(16)).cast("Q")
    with pytest.raises(ValueError):
        put(memoryview(bytearray(48)), q, 0, 1, 0, 1, b"x")  # not a power of two
    with pytest.raises(ValueError):
        take(memoryview(bytearray(64)), q, 5, 0, 1, memoryview(bytearray(4)))  # head index outside q
    with pytest.raises(BufferError):
        take(memoryview(bytearray(64)), q, 0, 0, 1, b"read-only")  # type: ignore[arg-type]


def test_take_releases_the_ring_and_reports_a_producer_waiting_for_room() -> None:
    data = memoryview(bytearray(64))
    q = memoryview(bytearray(32)).cast("Q")  # q[0]: head, q[1]: tail, u32 index 4 (= q[2]): the want flag
    w = q.cast("B").cast("I")
    assert put(data, q, 0, 1, 0, 7, b"abcdefghijklmnopq") == 33
    out = bytearray(17)
    assert take(data, q, 0, 0, 6, memoryview(out), 1, 4) == -1 and q[1] == 0  # another tag: nothing released
    assert take(data, q, 0, 0, 7, memoryview(out), 1, 4) == 17 and q[1] == 33 and out == b"abcdefghijklmnopq"
    assert put(data, q, 0, 1, 33, 9, b"") == 64
    w[4] = 1  # the producer waits for room: -2 - n, the ring released all the same
    assert take(data, q, 0, 33, 9, memoryview(out), 1, 4) == -2 and q[1] == 64
    with pytest.raises(ValueError):
        take(data, q, 0, 64, 9, memoryview(out), 1, 8)  # the want flag outside q


def _sleep_on_bell(addr: int, flag: bool, res: dict) -> None:
    res["t0"] = time.monotonic()
    res["ok"] = _futex.futex_wait(addr, 0, 5.0 if flag else 0.4)
    res["t"] = time.monotonic() - res["t0"]


@pytest.mark.parametrize("flag", [True, False])
def test_put_rings_the_doorbell_and_wakes_only_a_flagged_sleeper(flag: bool) -> None:
    """put(..., bell): the record published, then the bell value written at OFF_BELL and, only while the sleep
    flag (OFF_SLEEP) is up, the FUTEX_WAKE: a flagged sleeper wakes at once, an unflagged one sleeps on."""
    mm = mmap.mmap(-1, 4096)
    q = memoryview(mm).cast("Q")
    i = q.cast("B").cast("I")
    assert (_p2pwait.OFF_BELL, _p2pwait.OFF_SLEEP) == (OFF_BELL, OFF_SLEEP)
    i[OFF_SLEEP // 4] = int(flag)
    res: dict = {}
    th = threading.Thread(target=_sleep_on_bell, args=(_futex.buffer_address(mm) + OFF_BELL, flag, res))
    th.start()
    time.sleep(0.1)  # asleep in futex_wait by now
    assert put(memoryview(bytearray(64)), q, 2, 3, 0, 7, b"x", 0xDEADBEEF) == 17 and q[2] == 17
    assert i[OFF_BELL // 4] == 0xDEADBEEF
    th.join(10)
    assert res["t"] < (2.0 if flag else 10) and res["t"] > (0 if flag else 0.3), res
    del i, q
    mm.close()


def test_put_in_pieces_publishes_and_rings_each_with_a_new_bell_value() -> None:
    """put(..., bell, chunk, step): the same record as in one piece; the doorbell's last value is
    bell + (pieces - 1) * step (the caller's Doorbell.last)."""
    mm = mmap.mmap(-1, 4096)
    q = memoryview(mm).cast("Q")
    i = q.cast("B").cast("I")
    data = memoryview(bytearray(256))
    payload = bytes(range(40))
    assert put(data, q, 2, 3, 0, 7, payload, 100, 16, 3) == 56 and q[2] == 56
    assert i[OFF_BELL // 4] == 100 + 2 * 3  # three pieces: 16, 16, 8 bytes
    out = bytearray(40)
    assert take(data, q, 2, 0, 7, memoryview(out)) == 40 and bytes(out) == payload
    assert put(data, q, 2, 3, 56, 8, payload, 200, 64, 3) == 120 and i[OFF_BELL // 4] == 200  # one piece
    q[3] = 120
    big = bytes(range(200))  # wraps the ring, in pieces
    assert put(data, q, 2, 3, 120, 9, big, 0xFFFFFFFF, 64, 2) == 344 and i[OFF_BELL // 4] == 5  # (u32 wraps)
    out = bytearray(200)
    assert take(data, q, 2, 120, 9, memoryview(out)) == 200 and bytes(out) == big
    assert put(data, q, 2, 3, 344, 9, bytes(300), 1, 64, 2) == -1  # larger than the ring: nothing written
    del i, q
    mm.close()


def _stream_ring() -> tuple:
    data = memoryview(bytearray(256))
    q = memoryview(bytearray(32)).cast("Q")  # q[0]: head, q[1]: tail, u32 index 4: the want flag
    return data, q, q.cast("B").cast("I")


def test_stream_copies_a_whole_record_and_releases_the_ring() -> None:
    data, q, _w = _stream_ring()
    payload = bytes(range(100))
    assert put(data, q, 0, 1, 0, 7, payload) == 116
    out = bytearray(120)
    assert stream(data, q, 0, 1, 4, 0, 6, memoryview(out), 0, -1, 0, False) == -1  # another tag
    assert stream(data, q, 0, 1, 4, 0, 7, memoryview(bytearray(99)), 0, -1, 0, False) == -1  # too large
    assert q[1] == 0  # nothing consumed
    assert stream(data, q, 0, 1, 4, 0, 7, memoryview(out), 0, -1, 0, False) == (100, 100, 0)
    assert bytes(out[:100]) == payload and q[1] == 116
    q[1] = 200  # a control record's length field never fits a buffer
    hdr = memoryview(bytearray(16)).cast("Q")
    hdr[0], hdr[1] = 7, 1 << 63
    data[208:224] = hdr.cast("B")
    q[0] = 224
    assert stream(data, q, 0, 1, 4, 200, 7, memoryview(out), 0, -1, 0, False) == -1


def test_stream_returns_what_arrived_when_the_producer_stalls_and_resumes_later() -> None:
    data, q, _w = _stream_ring()
    payload = bytes(range(7, 207))  # 200 bytes: header at 32, payload wraps the 256-byte ring
    q[0] = q[1] = 32
    assert put(data, q, 0, 1, 32, 5, payload) == 248
    q[0] = 48 + 60  # only 60 payload bytes published
    out = bytearray(200)
    t0 = time.monotonic()
    assert stream(data, q, 0, 1, 4, 32, 5, memoryview(out), 0, -1, 2_000_000, True) == (200, 60, 0)
    assert time.monotonic() - t0 >= 0.0015 and q[1] == 108 and bytes(out[:60]) == payload[:60]
    data[32:48] = bytes(16)  # the header's bytes belong to the producer now: a resumed call must not read them
    q[0] = 248
    assert stream(data, q, 0, 1, 4, 32, 5, memoryview(out), 60, 200, 0, False) == (200, 200, 0)
    assert bytes(out) == payload and q[1] == 248
    with pytest.raises(ValueError):
        stream(data, q, 0, 1, 4, 32, 5, memoryview(out), 60, -1, 0, False)  # resuming needs the length


def test_stream_returns_to_ring_a_producer_waiting_for_room() -> None:
    data, q, w = _stream_ring()
    assert put(data, q, 0, 1, 0, 7, bytes(range(50))) == 66
    w[4] = 1
    out = bytearray(50)
    assert stream(data, q, 0, 1, 4, 0, 7, memoryview(out), 0, -1, 10**9, False) == (50, 50, 1) and q[1] == 66


def test_stream_copies_behind_a_producer_thread_with_the_gil_released() -> None:
    """A Python thread publishes a 1 MiB record in 64 KiB pieces into a 256 KiB ring, waiting for room: it
    can only run because stream releases the GIL, and stream only finishes because it releases the ring."""
    cap, n, piece = 1 << 18, 1 << 20, 1 << 16
    data = memoryview(bytearray(cap))
    q = memoryview(bytearray(32)).cast("Q")
    payload = bytes((i * 7) & 0xFF for i in range(n))
    hdr = memoryview(bytearray(16)).cast("Q")
    hdr[0], hdr[1] = 3, n
    data[0:16] = hdr.cast("B")
    q[0] = 16

    def produce() -> None:
        off = 0
        while off < n:
            while 16 + off + piece - q[1] > cap:
                time.sleep(0.0002)
            p = (16 + off) % cap
            k = min(piece, cap - p)
            data[p : p + k] = payload[off : off + k]
            if k < piece:
                data[0 : piece - k] = payload[off + k : off + piece]
            off += piece
            q[0] = 16 + off

    th = threading.Thread(target=produce)
    th.start()
    out = bytearray(n)
    assert stream(data, q, 0, 1, 4, 0, 3, memoryview(out), 0, -1, 5 * 10**9, True) == (n, n, 0)
    th.join(10)
    assert bytes(out) == payload and q[1] == 16 + n


def test_put_stream_waits_for_room_and_stops_when_the_consumer_stalls() -> None:
    mm = mmap.mmap(-1, 4096)
    q = memoryview(mm).cast("Q")
    i = q.cast("B").cast("I")
    data = memoryview(bytearray(256))
    payload = bytes((k * 3) & 0xFF for k in range(100))
    assert put_stream(data, q, 2, 3, 0, 7, payload, 10, 32, 4, 0, False) == (116, 100, 4)  # 4 pieces
    assert i[OFF_BELL // 4] == 10 + 3 * 4
    out = bytearray(100)
    assert take(data, q, 2, 0, 7, memoryview(out)) == 100 and bytes(out) == payload
    # no consumer: 400 bytes into a 256-byte ring whose tail stays at 116 -> stops after the spin
    t0 = time.monotonic()
    end, off, rings = put_stream(data, q, 2, 3, 116, 8, bytes(400), 1, 64, 1, 2_000_000, True)
    assert time.monotonic() - t0 >= 0.0015 and q[2] == end and end - 116 <= 256 and 0 < off < 400, (end, off)
    assert end == 128 + 16 + off and rings == -(-off // 64)
    q[3] = end  # an empty ring: a 300-byte record gets its header and one piece (128: half the ring), then no room
    assert put_stream(data, q, 2, 3, end, 9, bytes(300), 1, 512, 1, 0, False) == (end + 16 + 128, 128, 1)
    del i, q
    mm.close()


def test_put_stream_and_stream_move_a_record_larger_than_the_ring() -> None:
    mm = mmap.mmap(-1, 4096)
    q = memoryview(mm).cast("Q")
    data = memoryview(bytearray(1 << 16))
    n = 1 << 20
    payload = bytes((k * 13) & 0xFF for k in range(n))
    out = bytearray(n)
    got: dict = {}

    def consume() -> None:
        while q[2] == 0:
            time.sleep(0.0001)
        got["r"] = stream(data, q, 2, 3, 8, 0, 4, memoryview(out), 0, -1, 5 * 10**9, True)

    th = threading.Thread(target=consume)
    th.start()
    assert put_stream(data, q, 2, 3, 0, 4, payload, 1, 8192, 1, 5 * 10**9, True)[:2] == (16 + n, n)
    th.join(10)
    assert got["r"] == (n, n, 0) and bytes(out) == payload and q[3] == 16 + n
    q.release()
    mm.close()
