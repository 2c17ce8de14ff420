"""Arena conformance: the shared slots that small collectives use (memory, shm, and shm behind the router).

Ranks are threads; each test forms real transports through the conformance
suite's ``_form`` (shm segments in /dev/shm, checked for leaks at teardown).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, List

import numpy as np
import pytest

from procgroup.deadline import Deadline
from procgroup.errors import ClosedError, ConfigError, DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.transport import Transport
from procgroup.transport.shm import ARENA_BYTES, ARENA_GROUPS

from .test_transport_conformance import _form, _segments, run_ranks

KINDS = ["memory", "shm", "router"]


@pytest.fixture(params=KINDS)
def world(request: Any) -> Any:
    job = f"arena-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int) -> List[Transport]:
        ts = _form(request.param, n, job)
        made.extend(ts)
        return ts

    factory.kind = request.param  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    assert _segments(job) == [], "shared memory segments leaked"


def _members(kind: str, n: int) -> List[int]:
    """A group whose ranks share a host: all ranks, except behind the router (its ranks span two hosts)."""
    return list(range(n // 2)) if kind == "router" else list(range(n))


def _payload(rank: int, rnd: int, nbytes: int) -> bytes:
    return bytes((rank * 37 + rnd * 11 + i) % 251 for i in range(nbytes))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_exchange_returns_every_members_bytes_in_member_order(world: Any, n: int) -> None:
    ts = world(2 * n if world.kind == "router" else n)
    members = _members(world.kind, len(ts))
    sizes = [0, 1, 7, 4096, ARENA_BYTES]

    def body(t: Transport) -> None:
        if t.rank not in members:
            return
        a = t.arena(1, members)
        assert a is not None and a.members == members and a.index == members.index(t.rank)
        for rnd in range(60):
            nb = sizes[rnd % len(sizes)]
            views = a.exchange(memoryview(_payload(t.rank, rnd, nb)), 1000 + rnd, Deadline.after(20))
            assert len(views) == len(members)
            for i, m in enumerate(members):
                assert bytes(views[i][:nb]) == _payload(m, rnd, nb), (t.rank, rnd, m)
            if t.rank == members[rnd % len(members)]:
                time.sleep(0.002)  # one rank lags: the others must not overwrite a slot it may still read

    run_ranks(ts, body)


def test_a_fast_rank_never_overwrites_a_slot_a_slow_rank_reads(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    seen: List[List[int]] = [[] for _ in ts]

    def body(t: Transport) -> None:
        if t.rank not in members:
            return
        a = t.arena(2, members)
        for rnd in range(200):
            views = a.exchange(memoryview(rnd.to_bytes(4, "little") * 64), rnd, Deadline.after(20))
            if t.rank == members[0] and rnd % 10 == 0:
                time.sleep(0.003)  # the slow reader: between publishing and reading
            for v in views:
                assert bytes(v[:256]) == rnd.to_bytes(4, "little") * 64, (t.rank, rnd)
            seen[t.rank].append(rnd)

    run_ranks(ts, body)
    for r in members:
        assert seen[r] == list(range(200))


def test_missing_member_times_out_naming_it(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    me, absent = members[0], members[1]
    a = ts[me].arena(3, members)
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError) as ei:
        a.exchange(memoryview(b"x"), 5, Deadline.after(0.5))
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert f"[{absent}]" in str(ei.value) and f"rank {me}" in str(ei.value)


def test_different_check_words_never_complete(world: Any) -> None:
    """Members that disagree about the call (sequence number or fingerprint) do not read each other's bytes."""
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    errs: List[BaseException] = []

    def body(t: Transport) -> None:
        if t.rank not in members:
            return
        try:
            t.arena(4, members).exchange(memoryview(b"abc"), 100 + t.rank, Deadline.after(0.6))
        except DistTimeoutError as e:
            errs.append(e)

    run_ranks(ts, body)
    assert len(errs) == len(members)


def test_abort_wakes_a_waiting_member(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    t = ts[members[0]]
    a = t.arena(5, members)
    boom = ProcGroupError("aborted by the test")
    threading.Timer(0.3, t.abort, args=(boom,)).start()
    t0 = time.monotonic()
    with pytest.raises(ProcGroupError, match="aborted by the test"):
        a.exchange(None, 1, Deadline.after(20))
    assert time.monotonic() - t0 < 5.0


def test_closed_or_dead_peer_fails_the_waiter(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    me, peer = members[0], members[1]
    a = ts[me].arena(6, members)
    if world.kind == "memory":
        kill = lambda: ts[me].hub.fail(peer, "killed by the test")  # type: ignore[attr-defined]  # noqa: E731
    else:
        kill = ts[peer].close
    threading.Timer(0.2, kill).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailureError) as ei:
        a.exchange(memoryview(b"x"), 1, Deadline.after(20))
    assert ei.value.peer == peer
    assert time.monotonic() - t0 < 5.0


def test_exchange_after_close_raises(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    a = ts[members[0]].arena(7, members)
    ts[members[0]].close()
    with pytest.raises((ClosedError, ProcGroupError)):
        a.exchange(None, 1, Deadline.after(1))


def test_payload_larger_than_a_slot_is_refused(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))
    a = ts[members[0]].arena(8, members)
    with pytest.raises(ConfigError, match="slot"):
        a.exchange(memoryview(bytes(a.max_bytes + 1)), 1, Deadline.after(1))


def test_who_gets_an_arena(world: Any) -> None:
    ts = world(4)
    if world.kind == "router":
        assert ts[0].arena(0, [0, 1, 2, 3]) is None  # ranks on two hosts
        assert ts[0].arena(0, [0, 1]) is not None
        assert ts[2].arena(0, [2, 3]) is not None
    else:
        assert ts[0].arena(0, [0, 1, 2, 3]) is not None
    assert ts[0].arena(1, [0]) is None  # nobody to exchange with
    assert ts[0].arena(1, [1, 2]) is None  # not a member
    if world.kind != "memory":
        assert ts[0].arena(ARENA_GROUPS, [0, 1]) is None  # only the first groups have slots


def test_arena_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROCGROUP_SHM_ARENA", "0")
    job = f"arena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job)
    try:
        assert ts[0].arena(0, [0, 1]) is None
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


def test_arena_switched_off_by_explicit_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from procgroup.config import ShmOptions

    monkeypatch.setenv("PROCGROUP_SHM_ARENA", "1")  # explicit options win over the environment
    job = f"arena-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job, shm_options=ShmOptions(arena=False))
    try:
        assert ts[0].arena(0, [0, 1]) is None
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


def test_exchange_accepts_numpy_bytes(world: Any) -> None:
    ts = world(4 if world.kind == "router" else 2)
    members = _members(world.kind, len(ts))

    def body(t: Transport) -> Any:
        if t.rank not in members:
            return None
        x = np.arange(5, dtype=np.float64) + t.rank
        views = t.arena(9, members).exchange(memoryview(x).cast("B"), 3, Deadline.after(20))
        return [np.frombuffer(v, np.float64, 5).tolist() for v in views]

    out = run_ranks(ts, body)
    want = [(np.arange(5, dtype=np.float64) + m).tolist() for m in members]
    for m in members:
        assert out[m] == want
