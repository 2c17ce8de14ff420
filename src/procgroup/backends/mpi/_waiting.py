"""What every MPI wait shares: the job's sticky state (abort, closed, dead peers) and the polling loop.

A blocking MPI call cannot be interrupted, so the mpi backend only ever posts nonblocking operations and
polls them with ``Test`` under the caller's :class:`~procgroup.deadline.Deadline`.  :meth:`Liveness.wait`
spins first (``Test`` in a tight loop, yielding the CPU now and then: the peer is probably about to arrive,
and MPI progresses a large message only inside its calls), for a budget that grows with the message size,
then backs off to short sleeps (50 us doubling up to 1 ms), so that a rank waiting for an absent peer uses
a few percent of a core.  Between polls it checks, in this order: a sticky abort (the watchdog found a
peer failure or a mismatch through the store), ``close()``, and every ~0.2 s whether a peer on this host
has died (its pid, watched as the shm transport does).  Peers on other hosts are covered by the deadline,
the roll call, and the failure records that the survivors write to the store.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Sequence

from ...deadline import Deadline
from ...errors import ClosedError, DistTimeoutError, PeerFailureError
from ...transport.shm.peers import PeerWatch

__all__ = ["Liveness", "SPIN_S", "SPIN_S_PER_BYTE", "NAP_MIN_S", "NAP_MAX_S"]

#: seconds a wait polls without sleeping, plus SPIN_S_PER_BYTE per byte of the operation
SPIN_S = 2e-3
#: 10 ns per byte (100 MB/s): a 64 MiB operation polls flat out for ~0.7 s before backing off
SPIN_S_PER_BYTE = 1e-8
#: the back-off: first sleep and longest sleep between polls
NAP_MIN_S = 50e-6
NAP_MAX_S = 1e-3
#: how often a waiting rank checks that the peers on its host are alive
ALIVE_EVERY_S = 0.2


class Liveness:
    """The sticky state every request of one MPI world consults while it waits (thread-safe).

    ``hosts[r]``/``pids[r]``/``names[r]``: rank r's host key, pid and host name (from the rendezvous).
    ``watch_pids``: watch the pids of the ranks on this host (False when they live in another pid namespace).
    """

    def __init__(
        self, rank: int, hosts: Sequence[str], pids: Sequence[int], names: Sequence[str], watch_pids: bool = True
    ) -> None:
        self.rank = rank
        self.names = list(names)
        self.aborted: Optional[BaseException] = None
        self.closed = False
        self.failed: Dict[int, str] = {}
        self._lock = threading.Lock()
        self._watch = PeerWatch()
        for r, (h, pid) in enumerate(zip(hosts, pids)):
            if r != rank and h == hosts[rank]:
                self._watch.add(r, int(pid), watch_pids)
        self._next_alive = 0.0

    # -- sticky state ---------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Fail every pending and later wait with ``exc`` (first abort wins)."""
        if self.aborted is None:
            self.aborted = exc

    def mark_failed(self, peer: int, reason: str) -> None:
        """Record that ``peer`` is dead: waits that depend on it raise PeerFailureError with ``reason``."""
        with self._lock:
            self.failed.setdefault(peer, reason)

    def close(self) -> None:
        """Later waits raise ClosedError; stop watching pids."""
        self.closed = True
        with self._lock:
            self._watch.close()

    def check(self, peers: Optional[Iterable[int]], what: str) -> None:
        """Raise the sticky error that applies to a wait on ``peers`` (None: every rank), if any."""
        if self.aborted is not None:
            raise self.aborted
        if self.closed:
            raise ClosedError(f"rank {self.rank}: {what}: the mpi backend was closed while it waited")
        if self.failed:
            for p in self.failed if peers is None else peers:
                why = self.failed.get(p)
                if why is not None:
                    raise PeerFailureError(f"rank {self.rank}: {what} cannot complete: rank {p} failed ({why})", peer=p)

    def check_alive(self) -> None:
        """Look for dead peers on this host (at most every ALIVE_EVERY_S); records them as failed."""
        now = time.monotonic()
        if now < self._next_alive:
            return
        self._next_alive = now + ALIVE_EVERY_S
        with self._lock:
            if self.closed:
                return
            for p in self._watch.dead():
                pid = self._watch.pids.get(p, 0)
                self.failed.setdefault(p, f"its process (pid {pid} on {self.names[p]}) exited")
                self._watch.forget(p)

    # -- the polling loop -----------------------------------------------------------------
    def wait(
        self,
        test: Callable[[], bool],
        deadline: Optional[Deadline],
        what: Callable[[], str],
        peers: Optional[Iterable[int]] = None,
        nbytes: int = 0,
    ) -> None:
        """Poll ``test()`` until it is true; spin, then back off.

        Raises DistTimeoutError at ``deadline`` (the operation stays pending), PeerFailureError when a
        peer in ``peers`` (None: any rank) is known dead, the abort's error, or ClosedError.  ``what()``
        describes the operation for the messages.
        """
        if test():
            return
        if peers is not None:
            peers = tuple(peers)
        start = time.monotonic()
        spin_end = start + SPIN_S + nbytes * SPIN_S_PER_BYTE
        at = float("inf") if deadline is None else deadline.at
        nap = NAP_MIN_S
        i = 0
        while True:
            if test():
                return
            i += 1
            if i & 7:
                continue
            self.check_alive()
            self.check(peers, what())
            now = time.monotonic()
            if now >= at:
                assert deadline is not None
                raise DistTimeoutError(f"rank {self.rank}: {what()} did not complete after {deadline.elapsed():.2f}s")
            if now < spin_end:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX_S)
