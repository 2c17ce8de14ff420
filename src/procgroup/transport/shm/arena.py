"""Arena: shared slots in the members' segments, for the small collectives of ranks that share a host.

Groups whose ranks all share this host (and whose id is below
``ARENA_GROUPS``) get a :class:`ShmArena`: member ``m`` publishes into its
own segment's slot for the group (payload, then check word, then count:
TSO keeps that order), fences, and reads every member's count and check.
Whoever sees every member there rings the doorbells of the members whose
sleep flag is up.  The others poll (``ARENA_SPIN``; on a host with fewer
CPUs than local ranks they ``sched_yield`` at every poll, so the members
they wait for run instead), then raise their sleep flag, fence, re-check
and sleep on their doorbell (Dekker with the completer's
count-fence-flag), and check liveness, abort, close and the deadline at
every slice.  The small collectives of ``algorithms.arena`` use it: one
publish and one wake instead of log2(p) rounds of matched messages.

Each slot is double-buffered by call parity, so a fast member never
overwrites a slot a slow member still reads.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from ...deadline import Deadline
from ...errors import ClosedError, ConfigError, DistTimeoutError, PeerFailureError
from ..base import ARENA_BYTES, Arena
from .doorbell import Doorbell
from .layout import ARENA_HDR, ARENA_SLOT, OFF_BELL, OFF_SLEEP, Segment, fence

__all__ = ["ShmArena", "ArenaHost", "ARENA_SPIN", "ARENA_SPIN_OVERSUBSCRIBED"]

#: how long an arena wait polls before it sleeps (s): every local rank has a CPU / the host is oversubscribed
ARENA_SPIN = 200e-6
ARENA_SPIN_OVERSUBSCRIBED = 300e-6

_sched_yield = getattr(os, "sched_yield", lambda: None)


class ArenaHost(Protocol):
    """What an arena reads of its shm transport (the transport's own state, read without its lock)."""

    rank: int
    bytes_sent: int
    _aborted: Optional[BaseException]
    _closed: bool
    _failed: Dict[int, str]
    _seg: Optional[Segment]

    @property
    def doorbell(self) -> Doorbell:
        """The transport's doorbell."""


class ShmArena(Arena):
    """Arena slots of group ``key`` in the segments of ``members`` (``segs``, in member order).

    ``spin``: seconds a wait polls before it sleeps (yielding the CPU at every poll when ``oversubscribed``);
    ``slice_s``: the longest sleep without a deadline.

    ``exchange`` raises ClosedError on a closed transport, the abort error after ``abort()``,
    PeerFailureError when a missing member is known dead, DistTimeoutError past the deadline,
    ConfigError for a payload larger than ``max_bytes``.
    """

    def __init__(
        self,
        t: ArenaHost,
        key: int,
        members: List[int],
        segs: List[Segment],
        *,
        spin: float,
        oversubscribed: bool,
        slice_s: float,
    ) -> None:
        self.t = t
        self._spin = spin
        self._oversubscribed = oversubscribed
        self._slice = slice_s
        self.members = members
        self.index = members.index(t.rank)
        self.max_bytes = ARENA_BYTES
        own = segs[self.index]
        offs = [[seg.arena_off + (2 * key + k) * ARENA_SLOT for seg in segs] for k in (0, 1)]
        # per parity: (u32 view, index of the count word) of every member, and every member's payload view
        self._slots: List[List[Tuple[memoryview, int]]] = [
            [(seg.i, off // 4) for seg, off in zip(segs, offs[k])] for k in (0, 1)
        ]
        self._data = [
            [memoryview(seg.mm)[off + ARENA_HDR :][:ARENA_BYTES] for seg, off in zip(segs, offs[k])] for k in (0, 1)
        ]
        self._others = [seg for seg in segs if seg is not own]
        self.count = 0

    def release(self) -> None:
        """Drop the views into the segments (before they are unmapped)."""
        for views in self._data:
            for v in views:
                v.release()
        self._slots = [[], []]
        self._others = []

    def _arrived(self, k: int, val: int, check: int) -> bool:
        for w, c in self._slots[k]:
            if w[c] != val or w[c + 1] != check:
                return False
        return True

    def exchange(self, data: Optional[Any], check: int, deadline: Optional[Deadline]) -> Sequence[memoryview]:
        """Publish ``data`` (a byte view, or None) with ``check``; returns every member's slot, in member order."""
        t = self.t
        if t._aborted is not None:
            raise t._aborted
        if t._closed or not self._others:
            raise ClosedError(f"rank {t.rank}: shared-slot exchange on a closed shm transport")
        k = self.count & 1
        self.count += 1
        val = (self.count - 1) % 0xFFFFFFFF + 1  # never 0 (0: "never published")
        me = self.index
        views = self._data[k]
        if data is not None:
            n = data.nbytes
            if n > ARENA_BYTES:
                raise ConfigError(f"arena exchange of {n} bytes exceeds the slot size {ARENA_BYTES}")
            if n:
                views[me][:n] = data
                t.bytes_sent += n  # for `procgroup top` (procgroup.telemetry)
        w, c = self._slots[k][me]
        w[c + 1] = check
        w[c] = val  # last: publishes the payload and the check (stores stay in order on x86)
        fence()  # our count before their counts and sleep flags (Dekker with the other arrivers and sleepers)
        if self._arrived(k, val, check):
            # we completed the exchange; members that may be asleep on it need a wake (see _wait)
            ring = t.doorbell.ring
            for seg in self._others:
                if seg.i[OFF_SLEEP // 4]:
                    ring(seg, force=True)  # its flag is up: a new doorbell value, then FUTEX_WAKE
            return views
        self._wait(k, val, check, deadline)
        return views

    def _wait(self, k: int, val: int, check: int, deadline: Optional[Deadline]) -> None:
        t = self.t
        arrived = self._arrived
        spin = self._spin
        if spin:
            end = time.monotonic() + spin
            yld = self._oversubscribed
            while time.monotonic() < end:
                if arrived(k, val, check):
                    return
                if yld:
                    _sched_yield()  # the member we wait for may be queued behind us
        bell = t.doorbell
        while True:
            seg = t._seg
            if t._aborted is not None:
                raise t._aborted
            if t._closed or seg is None:
                raise ClosedError(f"rank {t.rank}: the shm transport was closed during a shared-slot exchange")
            snap = seg.i[OFF_BELL // 4]  # before the check: a ring after it moves the doorbell
            if arrived(k, val, check):
                return
            missing = [m for (w, c), m in zip(self._slots[k], self.members) if w[c] != val or w[c + 1] != check]
            dead = [m for m in missing if m in t._failed]
            if dead:
                raise PeerFailureError(
                    f"rank {t.rank}: shared-slot exchange with ranks {self.members} cannot complete: "
                    f"{t._failed[dead[0]]}",
                    peer=dead[0],
                )
            if deadline is not None and deadline.expired():
                raise DistTimeoutError(
                    f"rank {t.rank}: shared-slot exchange (call {self.count} of this group's arena): "
                    f"ranks {missing} of {self.members} did not arrive within {deadline.elapsed():.2f}s"
                )
            bell.sleep(
                snap,
                self._slice if deadline is None else max(deadline.remaining(), 1e-4),
                lambda: arrived(k, val, check),
            )
