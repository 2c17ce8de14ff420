"""What a collective algorithm sees: ``Comm``, a group of ranks over a Transport.

Algorithms are plain functions ``f(comm, ...)`` that use only the methods
below, so they run unchanged over the memory, shm and tcp transports, with
ranks as threads or as processes.

* Ranks inside a Comm are *group* ranks ``0..size-1``; ``comm.ranks`` maps
  them to the transport's (global) ranks.
* Each collective call gets a fresh ``tag`` base from the group (it encodes
  group id and sequence number); ``step`` distinguishes messages inside one
  call (``0 <= step < 2**16``).
* ``comm.deadline`` bounds every wait; errors carry the peer's group rank.
* ``comm.scratch(nbytes, slot)`` returns a reusable uint8 buffer owned by the
  group: scratch is not allocated per call.
* ``comm.hosts[i]`` is a host key of group rank ``i`` (ranks with the same key
  share memory), used by hierarchical algorithms.
* ``comm.arena`` is the group's :class:`~procgroup.transport.base.Arena`
  (shared slots, one exchange per call) or None; ``comm.check_word()`` is
  what members of the call publish with it.  ``comm.host_arena``: for a group
  spanning hosts, the shared slots of its members on this host, or None.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..deadline import Deadline
from ..transport.base import Arena, Buffer, Request, Status, Transport

__all__ = ["Comm", "Messaging", "Phases", "ScratchPool", "STEP_BITS", "cached_phases"]

STEP_BITS = 16
_STEP_LIMIT = 1 << STEP_BITS


class ScratchPool:
    """Grow-only reusable byte buffers, keyed by slot."""

    def __init__(self) -> None:
        self._bufs: Dict[int, np.ndarray] = {}

    def get(self, nbytes: int, slot: int = 0) -> np.ndarray:
        b = self._bufs.get(slot)
        if b is None or b.nbytes < nbytes:
            # grow geometrically so a sweep of sizes does not reallocate every call
            cap = max(nbytes, 0 if b is None else min(2 * b.nbytes, nbytes * 2))
            b = np.empty(max(cap, 64), dtype=np.uint8)
            self._bufs[slot] = b
        return b[:nbytes]

    def clear(self) -> None:
        self._bufs.clear()


class Messaging:
    """Blocking and paired operations in terms of ``isend``/``irecv`` and ``deadline``.

    Shared by :class:`Comm` and the algorithms' sub-group views (``algorithms._util.SubComm``).
    """

    __slots__ = ()
    deadline: Deadline

    def isend(self, peer: int, buf: Buffer, step: int = 0) -> Request:
        raise NotImplementedError

    def irecv(self, peer: int, out: Buffer, step: int = 0) -> Request:
        raise NotImplementedError

    def send(self, peer: int, buf: Buffer, step: int = 0) -> None:
        self.isend(peer, buf, step).wait(self.deadline)

    def wait_all(self, reqs: Sequence[Optional[Request]]) -> None:
        """Wait for every request of ``reqs`` (None skipped); raises the first failure.  Receives from several
        peers are read together first where the transport can (tcp: one compiled read of their sockets)."""
        live = [q for q in reqs if q is not None]
        if len(live) > 1:
            many = self._wait_many()
            if many is not None:
                many(live, self.deadline)
        for q in live:
            q.wait(self.deadline)

    def _wait_many(self) -> Optional[Callable[[Sequence[Request], Optional[Deadline]], None]]:
        """The transport's ``wait_many`` (see :meth:`wait_all`), or None."""
        return None

    def phases(self, send_to: Sequence[int], recv_from: Sequence[int]) -> Optional["Phases"]:
        """Phases bound once: each sends to every peer of ``send_to`` and receives from every one of ``recv_from``
        (distinct peers), all at one step, in one call from the algorithm where the transport has one (tcp between
        hosts: the receives read in compiled calls, none of the per-message layers).  ``phases.run(step, sends,
        recvs)`` (buffers in the order of the peers) waits for the receives and returns the sends still pending
        (wait for them before reusing their buffers), or None where it could not take that call (nothing done:
        post and wait as usual); ``phases.end()`` after the call's last phase (the connections stay claimed
        between phases).  None where there is no such call.  The messages on the wire are those of ``isend`` /
        ``irecv``, so peers may take either path."""
        return None

    def recv(self, peer: int, out: Buffer, step: int = 0) -> Status:
        return self.irecv(peer, out, step).wait(self.deadline)

    def sendrecv(self, dst: int, sendbuf: Buffer, src: int, recvbuf: Buffer, step: int = 0) -> Status:
        """Send to ``dst`` and receive from ``src`` concurrently (deadlock-free ring step)."""
        r = self.irecv(src, recvbuf, step)
        s = self.isend(dst, sendbuf, step)
        st = r.wait(self.deadline)
        s.wait(self.deadline)
        return st


class Comm(Messaging):
    __slots__ = (
        "transport",
        "ranks",
        "rank",
        "size",
        "tag",
        "deadline",
        "hosts",
        "_scratch",
        "arena",
        "host_arena",
        "_phases",
    )

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int],
        rank: int,
        tag: int,
        deadline: Deadline,
        hosts: Optional[Sequence[str]] = None,
        scratch: Optional[ScratchPool] = None,
        arena: Optional[Arena] = None,
        host_arena: Optional[Arena] = None,
    ) -> None:
        self.transport = transport
        self.ranks: List[int] = list(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self.tag = tag << STEP_BITS
        self.deadline = deadline
        self.hosts: List[str] = list(hosts) if hosts is not None else ["localhost"] * self.size
        self._scratch = scratch if scratch is not None else ScratchPool()
        #: the group's shared slots when its ranks share a host (see ``algorithms.arena``), else None
        self.arena = arena
        #: when the group spans hosts: the shared slots of its members on this host (members in group order), used
        #: by the host-local stages of the hierarchical all_reduce; else None
        self.host_arena = host_arena
        self._phases: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], Optional[Phases]] = {}

    def check_word(self) -> int:
        """What the members of this call agree on (sequence number and fingerprint), as a u32 for the arena."""
        return (self.tag >> STEP_BITS) & 0xFFFFFFFF

    # -- messaging (group ranks) ------------------------------------------------
    def _t(self, step: int) -> int:
        if not 0 <= step < _STEP_LIMIT:
            raise ValueError(f"algorithm step {step} outside [0, {_STEP_LIMIT})")
        return self.tag | step

    def isend(self, peer: int, buf: Buffer, step: int = 0) -> Request:
        return self.transport.isend(self.ranks[peer], self._t(step), buf)

    def _wait_many(self) -> Optional[Callable[[Sequence[Request], Optional[Deadline]], None]]:
        return getattr(self.transport, "wait_many", None)

    def irecv(self, peer: int, out: Buffer, step: int = 0) -> Request:
        return self.transport.irecv(self.ranks[peer], self._t(step), out)

    def phases(self, send_to: Sequence[int], recv_from: Sequence[int]) -> Optional["Phases"]:
        """:meth:`Messaging.phases` through the transport's ``phases`` (the router's, tcp's), bound once per peers
        for this Comm (its calls reuse them: the tag and deadline are read at each ``run``)."""

        def bind() -> Optional[Phases]:
            f = getattr(self.transport, "phases", None)
            inner = f([self.ranks[p] for p in send_to], [self.ranks[p] for p in recv_from]) if f else None
            return None if inner is None else Phases(self, inner, 0)

        return cached_phases(self._phases, send_to, recv_from, bind)

    # -- resources ----------------------------------------------------------------
    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        return self._scratch.get(nbytes, slot)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]


def cached_phases(
    cache: Dict[Any, Any], send_to: Sequence[int], recv_from: Sequence[int], bind: Callable[[], Any]
) -> Any:
    """``cache``'s phases for these peers, bound by ``bind()`` (None too is kept: no such call) on first use."""
    key = (tuple(send_to), tuple(recv_from))
    try:
        return cache[key]
    except KeyError:
        ph = cache[key] = bind()
        return ph


class Phases:
    """A transport's bound phases (``run(tag, sends, recvs, deadline)``, ``end()``) on a Comm, at steps from
    ``base`` on: see :meth:`Messaging.phases`."""

    __slots__ = ("comm", "inner", "base", "end")

    def __init__(self, comm: Comm, inner: Any, base: int) -> None:
        self.comm, self.inner, self.base = comm, inner, base
        #: give the connections back (after the call's last phase, and on any way out of the call)
        self.end: Callable[[], None] = inner.end

    def at(self, base: int) -> "Phases":
        """The same phases at steps from ``base`` on (a sub-group's range)."""
        return Phases(self.comm, self.inner, self.base + base)

    def run(self, step: int, sends: Sequence[Buffer], recvs: Sequence[Buffer]) -> Optional[List[Request]]:
        """Send ``sends`` and receive into ``recvs`` (in the order of the bound peers) at ``step`` of the Comm's
        current call; the sends still pending, or None where nothing was done (post and wait as usual)."""
        c = self.comm
        return self.inner.run(c._t(self.base + step), sends, recvs, c.deadline)
