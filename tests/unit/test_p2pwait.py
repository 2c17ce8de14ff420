"""The compiled helpers of the shm transport's blocking fast path (``_p2pwait``: wait_head, put, take; issue 14).

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
    from procgroup.transport.shm._p2pwait import put, take, wait_head
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
