"""The public doorbell of the shm transport (what the router's wait loop uses): snapshot, poke, kick, sleep."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, List, Optional

import pytest

from procgroup.config import ShmOptions
from procgroup.deadline import Deadline
from procgroup.transport.shm import ShmTransport, shm_supported

from .test_transport_conformance import DictStore, _segments

pytestmark = pytest.mark.skipif(not shm_supported(), reason="no writable /dev/shm")


@pytest.fixture()
def pair() -> Any:
    """Two shm ranks as threads, with a long sleep slice so that only a ring or a poke ends a sleep early."""
    job = f"bell-{uuid.uuid4().hex[:10]}"
    store = DictStore()
    out: List[Optional[ShmTransport]] = [None, None]

    def make(r: int) -> None:
        out[r] = ShmTransport(
            store, r, 2, local_ranks=[0, 1], job_id=job, deadline=Deadline.after(30), slice_s=5.0, options=ShmOptions()
        )

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] is not None and out[1] is not None, "formation failed"
    yield out
    for t in out:
        t.close()
    assert _segments(job) == []


def test_poke_moves_the_snapshot_and_a_stale_snapshot_does_not_sleep(pair: Any) -> None:
    bell = pair[0].doorbell
    snap = bell.snapshot()
    bell.poke()
    assert bell.snapshot() != snap
    t0 = time.monotonic()
    bell.sleep(snap, 3.0)  # the doorbell already moved: futex_wait returns at once
    assert time.monotonic() - t0 < 1.0


def test_sleep_times_out_without_activity(pair: Any) -> None:
    bell = pair[0].doorbell
    t0 = time.monotonic()
    bell.sleep(bell.snapshot(), 0.05)
    assert 0.03 <= time.monotonic() - t0 < 2.0


def test_a_peer_send_wakes_a_sleeper_and_kick_delivers_it(pair: Any) -> None:
    a, b = pair
    bell = a.doorbell
    buf = bytearray(4)
    req = a.irecv(1, 7, buf)
    snap = bell.snapshot()

    def send_later() -> None:
        time.sleep(0.2)
        b.isend(0, 7, b"ping").wait(Deadline.after(5))

    th = threading.Thread(target=send_later, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not req.test():  # test() drives progress like bell.kick() does
        bell.sleep(snap, 4.0)
        snap = bell.snapshot()
        bell.kick()
    th.join(5)
    assert bytes(buf) == b"ping"
    assert time.monotonic() - t0 < 3.0, "the sender's ring did not wake the sleeper"


def test_a_poke_from_another_thread_wakes_a_sleeper(pair: Any) -> None:
    bell = pair[0].doorbell
    snap = bell.snapshot()
    threading.Timer(0.2, bell.poke).start()
    t0 = time.monotonic()
    bell.sleep(snap, 4.0)
    assert time.monotonic() - t0 < 3.0


def test_a_closed_doorbell_neither_sleeps_nor_raises(pair: Any) -> None:
    a = pair[0]
    bell = a.doorbell
    a.close()
    assert bell.snapshot() == 0
    bell.poke()
    bell.kick()
    t0 = time.monotonic()
    bell.sleep(12345, 3.0)
    assert time.monotonic() - t0 < 1.0
