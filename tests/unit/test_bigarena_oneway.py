"""One-way big-slot reduce (issue 14): a reduce's non-roots publish their part and return, the root alone waits.

Ranks as threads over the shm transport, on the compiled and the pure-Python syncs.  What the one-way step must
keep from a full sync: a non-root returns before the root arrives; its next big-slot call settles first (waits
for every member to reach the one-way step) so no buffer is overwritten while the root still reads it, under a
lagging rank and every op mixed in; a root that never comes, a dead root, and a mismatch that no wait of its own
step sees (every member a non-root) all end in a named error at the next big-slot call, within its deadline.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Iterator, List

import numpy as np
import pytest

from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms import bigarena as BIG
from procgroup.algorithms.comm import Comm, ScratchPool
from procgroup.config import ShmOptions
from procgroup.deadline import Deadline
from procgroup.errors import DistTimeoutError, PeerFailureError, ProcGroupError
from procgroup.ops import ReduceOp
from procgroup.transport import Transport
from procgroup.transport.shm import arena as shm_arena

from .test_algorithms import kernel
from .test_transport_conformance import _form, _segments, run_ranks

SLOT = 64 << 10
PATHS = [
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(not shm_arena.native_available(), reason="the compiled arena was not built"),
    ),
    pytest.param(False, id="python"),
]
SUM = kernel(ReduceOp.SUM, "int64")


def shm_worlds(native: bool, job: str) -> Iterator[Callable[..., List[Transport]]]:
    """A factory of shm worlds of ranks as threads (big slots of SLOT bytes, the compiled path or not; further
    ShmOptions by keyword), closed afterwards and checked for leaked segments."""
    made: List[Transport] = []

    def factory(n: int, **kw: Any) -> List[Transport]:
        ts = _form("shm", n, job, shm_options=ShmOptions(big_slot=SLOT, native=native, **kw))
        made.extend(ts)
        return ts

    yield factory
    for t in made:
        t.close()
    assert _segments(job) == [], "shared memory segments leaked"


@pytest.fixture(params=PATHS)
def world(request: Any) -> Any:
    yield from shm_worlds(request.param, f"bow-{uuid.uuid4().hex[:10]}")


def _comms(t: Transport, p: int) -> Callable[..., Comm]:
    a = t.arena(0, list(range(p)))
    assert a is not None and a.big is not None and a.big.slot_bytes == SLOT
    pool = ScratchPool()

    def make(tag: int, deadline: float = 30.0) -> Comm:
        return Comm(t, list(range(p)), t.rank, tag, Deadline.after(deadline), scratch=pool, arena=a)

    return make


def _vals(r: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) * (r + 1) + r


def _total(p: int, n: int) -> np.ndarray:
    return sum(_vals(q, n) for q in range(p))


@pytest.mark.parametrize("n", [0, 1, 5000, SLOT // 8])  # one direct step (larger ones first sync every member)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_non_roots_return_before_the_root_arrives(world: Any, p: int, n: int) -> None:
    ts = world(p)
    returned = threading.Barrier(p - 1) if p > 2 else None
    gone = threading.Event()

    def body(t: Transport) -> None:
        r, make = t.rank, _comms(t, p)
        buf = _vals(r, n)
        if r == 0:  # the root comes only once every non-root's reduce has returned
            assert gone.wait(20), "a non-root's reduce waited for the root: the step is not one-way"
        BIG.reduce_big(make(1, 10.0), buf, SUM, 0)
        if r:
            if returned is not None:
                returned.wait(20)
            gone.set()
            assert np.array_equal(buf, _vals(r, n))  # a non-root's buffer is left alone
        else:
            assert np.array_equal(buf, _total(p, n))
        x = _vals(r, n)
        BIG.allreduce_big(make(2), x, SUM)  # the non-roots settle here first
        assert np.array_equal(x, _total(p, n))

    run_ranks(ts, body, 60)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_lagging_rank_among_one_way_reduces_and_every_other_op(world: Any, p: int) -> None:
    """Every op after a one-way reduce, one rank (often the root) late at every call: the settle keeps each buffer
    until the root has read it, so every result is the closed-form one."""
    ts = world(p)
    big_n = 3 * SLOT // 8 + 5  # above DIRECT_MAX's slot here: reduce-scatter + gather steps

    def body(t: Transport) -> None:
        r, make = t.rank, _comms(t, p)
        for k in range(36):
            if r == (k // 2) % p:
                time.sleep(0.003)
            root = k % p
            n = (5000, big_n)[k % 2] + k
            x = _vals(r + k, n)
            BIG.reduce_big(make(2 * k + 1), x, SUM, root)
            want = sum(_vals(q + k, n) for q in range(p))
            assert np.array_equal(x, want if r == root else _vals(r + k, n)), k
            c = make(2 * k + 2)
            kind = k % 6
            if kind == 0:
                y = _vals(r, n)
                BIG.allreduce_big(c, y, SUM)
                assert np.array_equal(y, _total(p, n)), k
            elif kind == 1:
                y = _vals(root, n) if r == root else np.zeros(n, np.int64)
                BIG.bcast_big(c, y, root)
                assert np.array_equal(y, _vals(root, n)), k
            elif kind == 2:
                out = np.empty(p * n, np.int64)
                BIG.allgather_big(c, _vals(r, n), out)
                assert np.array_equal(out, np.concatenate([_vals(q, n) for q in range(p)])), k
            elif kind == 3:
                out = np.empty(n, np.int64)
                BIG.reduce_scatter_big(c, np.tile(_vals(r, n), p), out, SUM)
                assert np.array_equal(out, _total(p, n)), k
            elif kind == 4:  # all_to_all whose streams go through the big buffers
                m = 3000 + k
                send = np.concatenate([np.full(m, 100 * r + j, np.int64) for j in range(p)])
                recv = np.empty(p * m, np.int64)
                A2A.alltoall_shm(c, send, [m] * p, recv, [m] * p)
                assert np.array_equal(recv, np.repeat(100 * np.arange(p) + r, m)), k
            # kind 5: another one-way reduce follows at once

    run_ranks(ts, body, 120)


def test_a_root_that_never_comes_is_named_at_the_next_call(world: Any) -> None:
    ts = world(3)

    def body(t: Transport) -> None:
        r, make = t.rank, _comms(t, 3)
        if r == 0:
            return  # the root never calls
        BIG.reduce_big(make(1), _vals(r, 5000), SUM, 0)  # one-way: returns
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError, match="did not arrive") as ei:
            BIG.allreduce_big(make(2, 1.0), _vals(r, 5000), SUM)
        assert "0" in str(ei.value) and time.monotonic() - t0 < 10, ei.value

    run_ranks(ts, body, 60)


def test_every_member_a_non_root_is_stopped_at_the_next_big_slot_call(world: Any) -> None:
    """Each rank names the other the root: no wait of that step sees the mismatch, and neither rank receives
    anything; the next big-slot call of either never completes and times out naming the other."""
    ts = world(2)

    def body(t: Transport) -> None:
        r, make = t.rank, _comms(t, 2)
        buf = _vals(r, 5000)
        BIG.reduce_big(make(1), buf, SUM, 1 - r)
        assert np.array_equal(buf, _vals(r, 5000))
        with pytest.raises(DistTimeoutError, match="did not arrive"):
            BIG.allreduce_big(make(2, 1.0), _vals(r, 5000), SUM)

    run_ranks(ts, body, 60)


def test_a_dead_root_fails_a_settling_non_root(world: Any) -> None:
    ts = world(2)
    make = _comms(ts[1], 2)
    _comms(ts[0], 2)
    BIG.reduce_big(make(1), _vals(1, 5000), SUM, 0)  # rank 1's one-way step; rank 0 never takes its part
    ts[0].close()
    ts[1].mark_peer_failed(0, "rank 0 was killed (test)")
    t0 = time.monotonic()
    with pytest.raises((PeerFailureError, ProcGroupError), match="rank 0"):
        BIG.bcast_big(make(2), np.zeros(5000, np.int64), 1)
    assert time.monotonic() - t0 < 10
