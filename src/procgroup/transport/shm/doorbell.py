"""The doorbell of a shared-memory rank: a futex word in its own segment that peers ring.

A waiter polls for a while (the transport's spin), then sleeps on its own
doorbell futex in slices of ~50 ms, checking at every slice that its peers
are alive and have not closed.  A producer always rings the consumer's
doorbell after publishing (a value no other ringer writes), and makes the
FUTEX_WAKE syscall only when the consumer's sleep flag is set: the sleeper
raises the flag, fences, then ``futex_wait`` compares the doorbell; the
ringer writes the doorbell, fences, then reads the flag (Dekker), so a
sleeping consumer cannot miss data, and a spinning one costs no syscall.

:class:`Doorbell` is also the public face that other transports' waiters
use (the router, see :attr:`ShmTransport.doorbell
<procgroup.transport.shm.ShmTransport.doorbell>`): :meth:`~Doorbell.snapshot`,
then :meth:`~Doorbell.kick` (one progress pass), then
:meth:`~Doorbell.sleep` until the doorbell moves; and :meth:`~Doorbell.poke`
from any thread that saw activity elsewhere.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .. import _futex
from .layout import OFF_BELL, OFF_SLEEP, Segment, fence

__all__ = ["Doorbell"]

_INT_MAX = 0x7FFFFFFF
_RAW_WAKE = _futex.raw_waker()


class Doorbell:
    """This rank's doorbell (in its own segment ``seg``) and the ringing of its peers' doorbells.

    ``lock`` is the transport's lock; ``kick`` runs one progress pass plus a due liveness check (taking
    the lock itself); ``check_peers(now)`` runs a due liveness check with the lock held.  The transport
    sets ``seg`` once formed (None after release) and ``closed`` when it closes (lock held).
    """

    # slots: the compiled send_fast/recv_fast (_p2pwait.Core) read ``last`` and ``sleepers`` on every message
    __slots__ = (
        "_rank",
        "_world_size",
        "_lock",
        "_slice",
        "_kick",
        "_check_peers",
        "last",
        "seg",
        "closed",
        "sleepers",
        "idle",
        "_draining",
    )

    def __init__(
        self,
        rank: int,
        world_size: int,
        lock: threading.Lock,
        slice_s: float,
        kick: Callable[[], None],
        check_peers: Callable[[float], None],
    ) -> None:
        self._rank = rank
        self._world_size = world_size
        self._lock = lock
        self._slice = slice_s
        self._kick = kick
        self._check_peers = check_peers
        #: the last value this rank wrote into a doorbell (rank + 1 + k * world_size: no other ringer writes it);
        #: the compiled send_fast (ShmTransport.send_fast) steps it too
        self.last = rank + 1
        self.seg: Optional[Segment] = None
        self.closed = False
        #: threads of ours that may be asleep on the doorbell (lock held to change it)
        self.sleepers = 0
        #: notified (lock held) when the last sleeper leaves; close waits on it before unmapping
        self.idle = threading.Condition(lock)
        #: close is waiting on ``idle`` (lock held to change it): only then does the last sleeper notify it
        self._draining = False

    # -- ringing (the hot path; lock held) ------------------------------------------------------
    def ring(self, seg: Segment, force: bool = False) -> None:
        """Write a value no other ringer writes into ``seg``'s doorbell, then wake its sleepers.

        The wake syscall is skipped when the owner has no thread asleep: it raises its sleep flag,
        fences and only then compares the doorbell in futex_wait; we write the doorbell, fence and
        only then read the flag, so one of us sees the other's write.  ``force``: wake regardless.
        """
        v = self.last = (self.last + self._world_size) & 0xFFFFFFFF
        i = seg.i
        i[OFF_BELL // 4] = v
        if not force:
            fence()
            if not i[OFF_SLEEP // 4]:
                return
        w = _RAW_WAKE
        if w is not None:
            w[0](w[1], seg.addr + OFF_BELL, 1, _INT_MAX)
        else:
            _futex.futex_wake(seg.addr + OFF_BELL)

    def value(self) -> int:
        """The current doorbell value of our own segment (formed and not released: the caller knows)."""
        seg = self.seg
        assert seg is not None, "the doorbell of a released shm transport"
        return int(seg.i[OFF_BELL // 4])

    # -- sleeping -------------------------------------------------------------------------------
    def raise_flag_locked(self) -> int:
        """Count one more sleeper and raise the sleep flag (lock held); returns the futex address.

        The caller fences, sleeps with :func:`_futex.futex_wait` and then calls :meth:`lower_flag`.
        """
        seg = self.seg
        assert seg is not None, "sleeping on the doorbell of a released shm transport"
        self.sleepers += 1
        seg.i[OFF_SLEEP // 4] = 1
        return seg.addr + OFF_BELL

    def lower_flag(self) -> None:
        """Count one sleeper less (takes the lock); the last one lowers the flag and notifies ``idle``."""
        with self._lock:
            self.sleepers -= 1
            if not self.sleepers:
                seg = self.seg
                if seg is not None:
                    try:
                        seg.i[OFF_SLEEP // 4] = 0
                    except ValueError:  # released during close
                        pass
                if self._draining:
                    self.idle.notify_all()

    def wait_idle_locked(self, timeout: float) -> None:
        """Wait (``idle`` held) until no thread sleeps on the doorbell, at most ``timeout`` seconds."""
        end = time.monotonic() + timeout
        self._draining = True
        try:
            while self.sleepers and time.monotonic() < end:
                self.idle.wait(0.05)
        finally:
            self._draining = False

    # -- the public API -------------------------------------------------------------------------
    def snapshot(self) -> int:
        """The doorbell's value now (0 once closed): pass it to :meth:`sleep` after testing your condition."""
        with self._lock:
            return 0 if self.closed else self.value()

    def kick(self) -> None:
        """Drive the shm transport once: a progress pass over every ring, plus a liveness check when one is due."""
        self._kick()

    def poke(self) -> None:
        """Ring our own doorbell (activity seen elsewhere, e.g. by another transport's reader thread).

        Wakes every thread in :meth:`sleep` or in a wait of the shm transport; lock held or not.
        Does nothing once the transport is closed.
        """
        seg = self.seg
        if seg is not None and not self.closed:
            try:
                seg.i[OFF_BELL // 4] = (seg.i[OFF_BELL // 4] + 0x10000001) & 0xFFFFFFFF
                _futex.futex_wake(seg.addr + OFF_BELL)
            except ValueError:  # released during close
                pass

    def sleep(self, snapshot: int, timeout: float, ready: Optional[Callable[[], bool]] = None) -> None:
        """Sleep until the doorbell moves from ``snapshot``, at most ``timeout`` (and one slice, ~50 ms).

        Runs a due peer-liveness check first.  ``ready``: re-checked after the sleep flag is up and
        fenced, so a waker that tests the flag after its own fence (the arena's completer) either sees
        the flag and rings, or is seen by this check.  Returns at once on a closed transport; never raises
        for a timeout (the caller re-checks its condition and its deadline).
        """
        with self._lock:
            if self.closed:
                return
            self._check_peers(time.monotonic())
            addr = self.raise_flag_locked()
        fence()
        try:
            if ready is None or not ready():
                _futex.futex_wait(addr, snapshot, min(timeout, self._slice))
        finally:
            self.lower_flag()
