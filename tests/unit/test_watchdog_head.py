"""The watchdog finds a member stuck in a call that the others got through without waiting for it.

Two watchdogs over one in-memory store, ticked by hand with hand-made group snapshots: rank 1 waits in seq 1
(``broadcast(root=1)``), rank 0 called ``broadcast(root=0)`` there and ran on (as two broadcast roots do on
Open MPI, where a root's ``Ibcast`` completes without its receivers).  Before the published state carried the
hash including the call in flight (``head``), neither rank found it: the in-flight calls were never at the same
seq, and the hashes before rank 1's call agree.
"""

from __future__ import annotations

import time
from typing import List

from procgroup.errors import CollectiveMismatchError
from procgroup.flight import FlightRecord
from procgroup.store.hash import HashStore
from procgroup.watchdog import GroupStatus, Watchdog

ROOT0 = ("broadcast", "float32", 4, "root=0")
ROOT1 = ("broadcast", "float32", 4, "root=1")


def _status(chain, flight, inflight, last) -> GroupStatus:
    return GroupStatus(0, "WORLD", (0, 1), True, False, inflight, last, tuple(chain), tuple(flight))


def _ahead(calls_after: int, remembered: int) -> GroupStatus:
    """Rank 0: seq 0 agreed, seq 1 its root=0 broadcast, then ``calls_after`` more; remembers the last
    ``remembered`` calls."""
    t = time.monotonic() - 5
    n = 2 + calls_after
    chain = [(0, 100), (1, 201)] + [(q, 300 + q) for q in range(2, n)]
    sigs = [("barrier",), ROOT0] + [ROOT0] * calls_after
    flight = [FlightRecord(q, s[0], s, t, t + 0.001, "completed") for q, s in enumerate(sigs)][-remembered:]
    return _status(chain, flight, None, n - 1)


def _stuck() -> GroupStatus:
    """Rank 1: seq 0 agreed, waits in seq 1 (its root=1 broadcast) for 2 s."""
    t = time.monotonic()
    rec = FlightRecord(1, "broadcast", ROOT1, t - 2.0)
    flight = [FlightRecord(0, "barrier", ("barrier",), t - 3, t - 2.9, "completed"), rec]
    return _status([(0, 100), (1, 999)], flight, rec, 0)


def _pair(ahead: GroupStatus):
    store = HashStore()
    errors: List[List[BaseException]] = [[], []]
    dogs = [
        Watchdog(store, 0, lambda: [ahead], errors[0].append),
        Watchdog(store, 1, lambda: [_stuck()], errors[1].append),
    ]
    return dogs, errors


def test_the_member_further_on_names_both_calls_when_it_remembers_its_own():
    dogs, errors = _pair(_ahead(calls_after=5, remembered=64))
    dogs[1].tick()  # publishes its state (head: seq 1) and, waiting, its history; finds nothing itself
    assert errors == [[], []]
    dogs[0].tick()
    assert len(errors[0]) == 1 and isinstance(errors[0][0], CollectiveMismatchError)
    msg = str(errors[0][0])
    assert "at seq 1" in msg and "rank [0] called broadcast(float32, 4, root=0)" in msg, msg
    assert "rank [1] called broadcast(float32, 4, root=1)" in msg, msg
    dogs[1].tick()  # the stuck member reads the recorded finding: the same words
    assert [str(e) for e in errors[1]] == [msg]


def test_the_member_further_on_names_the_stuck_call_when_its_own_is_forgotten():
    dogs, errors = _pair(_ahead(calls_after=200, remembered=64))
    dogs[1].tick()
    dogs[0].tick()
    assert len(errors[0]) == 1, errors
    msg = str(errors[0][0])
    assert "at seq 1: rank 1 called broadcast(float32, 4, root=1) and waits in it" in msg, msg
    assert "rank 0 called another collective there, 200 calls ago" in msg, msg


def test_members_in_step_find_nothing():
    """Rank 1 waits in the same call that rank 0 completed (same hash): no finding, however long it waits."""
    t = time.monotonic()
    rec = FlightRecord(1, "broadcast", ROOT0, t - 2.0)
    same = _status([(0, 100), (1, 201)], [rec], rec, 0)
    store = HashStore()
    errors: List[List[BaseException]] = [[], []]
    dogs = [
        Watchdog(store, 0, lambda: [_ahead(calls_after=5, remembered=64)], errors[0].append),
        Watchdog(store, 1, lambda: [same], errors[1].append),
    ]
    for _ in range(2):
        dogs[1].tick()
        dogs[0].tick()
    assert errors == [[], []]
