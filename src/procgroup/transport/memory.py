"""In-memory transport: ranks are threads of one process.

The reference implementation of the Transport semantics, used by the fast
unit tests of the algorithms and the API.  Sends are eager (copied at post
time), so ``isend`` completes immediately.

    hub = MemoryHub(4)
    transports = [hub.transport(r) for r in range(4)]   # one per thread
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..deadline import Deadline
from ..errors import ClosedError, ConfigError, DistTimeoutError, PeerFailureError, ProcGroupError
from .base import (
    ANY_SOURCE,
    ARENA_BYTES,
    TAG_LIMIT,
    WAIT_ALL,
    Arena,
    BigArena,
    Buffer,
    CompletedRequest,
    Request,
    Status,
    Transport,
    as_bytes_view,
    as_writable_view,
    raise_if_stuck,
)

__all__ = ["MemoryHub", "MemoryTransport"]


class _RecvRequest(Request):
    __slots__ = ("_hub", "_me", "src", "tag", "out", "status", "error")

    def __init__(self, hub: "MemoryHub", me: int, src: int, tag: int, out: memoryview) -> None:
        self._hub = hub
        self._me = me
        self.src = src
        self.tag = tag
        self.out = out
        self.status: Optional[Status] = None
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        return self.status is not None or self.error is not None

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        hub = self._hub
        with hub.cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self.status is not None:
                    return self.status
                if self._me in hub.aborted:
                    hub.mailboxes[self._me].remove_posted(self)
                    self.error = hub.aborted[self._me]
                    continue
                # failure of the specific peer we wait for
                if self.src != ANY_SOURCE and self.src in hub.failed:
                    self.error = PeerFailureError(
                        f"rank {self._me}: recv from rank {self.src} (tag {self.tag}) cannot complete: "
                        f"rank {self.src} failed ({hub.failed[self.src]})",
                        peer=self.src,
                    )
                    hub.mailboxes[self._me].remove_posted(self)
                    continue
                if hub.closed[self._me]:
                    self.error = ClosedError(f"rank {self._me}: transport closed while a recv was pending")
                    continue
                remaining = None if deadline is None else deadline.remaining_or_none()
                if deadline is not None and remaining is not None and remaining <= 0:
                    src = "any rank" if self.src == ANY_SOURCE else f"rank {self.src}"
                    raise DistTimeoutError(
                        f"rank {self._me}: recv from {src} (tag {self.tag}) did not complete "
                        f"after {deadline.elapsed():.2f}s"
                    )
                hub.cond.wait(remaining)


class _Mailbox:
    __slots__ = ("unexpected", "posted")

    def __init__(self) -> None:
        # arrival order matters for ANY_SOURCE; per (src, tag) order is preserved
        self.unexpected: Dict[int, Deque[Tuple[int, bytes]]] = {}
        self.posted: List[_RecvRequest] = []

    def remove_posted(self, req: _RecvRequest) -> None:
        try:
            self.posted.remove(req)
        except ValueError:
            pass


def _deliver(req: _RecvRequest, src: int, data: bytes) -> None:
    n = len(data)
    if n > req.out.nbytes:
        req.error = ProcGroupError(
            f"message of {n} bytes from rank {src} (tag {req.tag}) does not fit the receive buffer of "
            f"{req.out.nbytes} bytes: the ranks disagree about the message size"
        )
        return
    req.out[:n] = data
    req.status = Status(src, n)


class MemoryHub:
    """Shared state of one in-memory world."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.cond = threading.Condition()
        self.mailboxes = [_Mailbox() for _ in range(world_size)]
        self.failed: Dict[int, str] = {}
        self.closed = [False] * world_size
        self.aborted: Dict[int, BaseException] = {}  # rank -> error its requests fail with
        #: (key, members) -> per parity, per member: its slot
        self.arenas: Dict[Tuple[int, Tuple[int, ...]], List[List[_Slot]]] = {}
        #: bytes of each big-slot buffer (small, so the unit tests' sizes take several steps); 0: no big slots
        self.big_slot = 64 << 10
        #: (key, members) -> [counts, checks, arrays] of the group's big slots
        self.bigs: Dict[Tuple[int, Tuple[int, ...]], List[Any]] = {}

    def transport(self, rank: int) -> "MemoryTransport":
        return MemoryTransport(self, rank)

    def fail(self, rank: int, reason: str = "killed") -> None:
        """Simulate the death of ``rank`` (for tests)."""
        with self.cond:
            self.failed[rank] = reason
            self.closed[rank] = True
            self.cond.notify_all()


class _Slot:
    """One member's arena slot: how many exchanges it published, the last one's check word, and its bytes."""

    __slots__ = ("count", "check", "data")

    def __init__(self) -> None:
        self.count = 0
        self.check = 0
        self.data = bytearray(ARENA_BYTES)


class _MemoryArena(Arena):
    """The reference :class:`Arena`: slots in a dict of the hub, waits on the hub's condition."""

    def __init__(self, t: "MemoryTransport", key: int, members: Sequence[int]) -> None:
        self.t = t
        self.members = list(members)
        self.index = self.members.index(t.rank)
        self.max_bytes = ARENA_BYTES
        with t.hub.cond:
            self.slots = t.hub.arenas.setdefault(
                (key, tuple(self.members)),
                [[_Slot() for _ in self.members] for _ in range(2)],
            )
        self.count = 0

    def exchange(self, data: Optional[Buffer], check: int, deadline: Optional[Deadline]) -> Sequence[memoryview]:
        hub, me = self.t.hub, self.t.rank
        par = self.count & 1
        self.count += 1
        val = self.count
        slots = self.slots[par]
        with hub.cond:
            mine = slots[self.index]
            if data is not None:
                v = as_bytes_view(data)
                if v.nbytes > self.max_bytes:
                    raise ConfigError(f"arena exchange of {v.nbytes} bytes exceeds the slot size {self.max_bytes}")
                mine.data[: v.nbytes] = v
            mine.count, mine.check = val, check
            hub.cond.notify_all()
            while True:
                missing = [m for i, m in enumerate(self.members) if slots[i].count != val or slots[i].check != check]
                if not missing:
                    return [memoryview(s.data) for s in slots]
                self.t._check(me, "arena exchange")
                raise_if_stuck(me, "shared-slot exchange", missing, hub.failed, deadline)
                hub.cond.wait(None if deadline is None else deadline.remaining_or_none())

    def next_slot(self) -> Optional[memoryview]:
        """This member's slot bytes of the next exchange (see :meth:`Arena.next_slot`)."""
        self.t._check(self.t.rank, "arena exchange")
        return memoryview(self.slots[self.count & 1][self.index].data)


class _MemoryBigArena(BigArena):
    """The reference :class:`BigArena`: counters and buffers in the hub, waits on the hub's condition."""

    def __init__(self, t: "MemoryTransport", key: int, members: Sequence[int]) -> None:
        self.t = t
        self.members = list(members)
        self.index = self.members.index(t.rank)
        hub = t.hub
        self.slot_bytes = hub.big_slot
        p = len(self.members)
        with hub.cond:
            self._shared = hub.bigs.setdefault(
                (key, tuple(self.members)),
                [[0] * p, [0] * p, [[np.zeros(self.slot_bytes, np.uint8) for _ in range(p)] for _ in (0, 1)]],
            )
        self.arrays = self._shared[2]
        self.count = self._shared[0][self.index]
        self.turn = 0
        self._check = 0

    def begin(self, check: int, deadline: Optional[Deadline] = None) -> None:
        self._check = check & 0xFFFFFFFF

    def sync(self, deadline: Optional[Deadline], wait: int = WAIT_ALL) -> None:
        """A full synchronisation whatever ``wait`` says (the reference transport takes no one-way steps)."""
        hub, me = self.t.hub, self.t.rank
        counts, checks = self._shared[0], self._shared[1]
        self.count += 1
        val, check = self.count, self._check
        with hub.cond:
            self.t._check(me, "big-slot collective")
            checks[self.index] = check
            counts[self.index] = val
            hub.cond.notify_all()
            while True:
                missing = [
                    m
                    for i, m in enumerate(self.members)
                    if counts[i] < val or (counts[i] == val and checks[i] != check)
                ]
                if not missing:
                    return
                self.t._check(me, "big-slot collective")
                raise_if_stuck(me, "big-slot collective", missing, hub.failed, deadline)
                hub.cond.wait(None if deadline is None else deadline.remaining_or_none())


class MemoryTransport(Transport):
    kind = "memory"

    def __init__(self, hub: MemoryHub, rank: int) -> None:
        if not 0 <= rank < hub.world_size:
            raise ConfigError(f"rank {rank} is outside [0, {hub.world_size})")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self._bigs: Dict[Tuple[int, Tuple[int, ...]], _MemoryBigArena] = {}  # one per group: its turn persists

    def _check(self, peer: int, what: str, allow_any: bool = False) -> None:
        if self.rank in self.hub.aborted:
            raise self.hub.aborted[self.rank]
        if self.hub.closed[self.rank]:
            raise ClosedError(f"rank {self.rank}: {what} on a closed transport")
        if allow_any and peer == ANY_SOURCE:
            return
        if not 0 <= peer < self.world_size:
            raise ConfigError(f"rank {self.rank}: {what} peer {peer} is outside [0, {self.world_size})")

    def isend(self, dst: int, tag: int, data: Buffer) -> Request:
        self._check(dst, "send")
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        payload = bytes(as_bytes_view(data))
        hub = self.hub
        with hub.cond:
            if dst in hub.failed:
                raise PeerFailureError(
                    f"rank {self.rank}: send to rank {dst} failed: rank {dst} failed ({hub.failed[dst]})", peer=dst
                )
            box = hub.mailboxes[dst]
            for req in box.posted:
                if req.tag == tag and (req.src == ANY_SOURCE or req.src == self.rank):
                    box.posted.remove(req)
                    _deliver(req, self.rank, payload)
                    hub.cond.notify_all()
                    break
            else:
                box.unexpected.setdefault(tag, deque()).append((self.rank, payload))
                hub.cond.notify_all()
        return CompletedRequest(Status(dst, len(payload)))

    def irecv(self, src: int, tag: int, out: Buffer) -> Request:
        self._check(src, "recv", allow_any=True)
        view = as_writable_view(out)
        req = _RecvRequest(self.hub, self.rank, src, tag, view)
        hub = self.hub
        with hub.cond:
            box = hub.mailboxes[self.rank]
            q = box.unexpected.get(tag)
            if q:
                for i, (s, payload) in enumerate(q):
                    if src == ANY_SOURCE or s == src:
                        del q[i]
                        if not q:
                            del box.unexpected[tag]
                        _deliver(req, s, payload)
                        return req
            box.posted.append(req)
        return req

    def unmatched(self, src: int, tag: int, mask: int) -> Optional[Tuple[int, int]]:
        """A queued message from ``src`` whose tag differs from ``tag`` in ``mask`` only (see Transport)."""
        want = tag & ~mask
        with self.hub.cond:
            for t, q in self.hub.mailboxes[self.rank].unexpected.items():
                if t != tag and t & ~mask == want:
                    for s, _ in q:
                        if src == ANY_SOURCE or s == src:
                            return s, t
        return None

    def arena(self, key: int, members: Sequence[int], *, spanning: bool = False) -> Optional[Arena]:
        """Arena and big slots among threads of one hub (``spanning`` changes nothing here: waits block)."""
        if self.rank not in members or len(members) < 2:
            return None
        a = _MemoryArena(self, key, members)
        if self.hub.big_slot:
            k = (key, tuple(members))
            b = self._bigs.get(k)
            if b is None:
                b = self._bigs[k] = _MemoryBigArena(self, key, members)
            a.big = b
        return a

    def abort(self, exc: BaseException) -> None:
        with self.hub.cond:
            self.hub.aborted[self.rank] = exc
            self.hub.cond.notify_all()

    def mark_peer_failed(self, peer: int, reason: str) -> None:
        with self.hub.cond:
            self.hub.failed.setdefault(peer, reason)
            self.hub.cond.notify_all()

    def close(self) -> None:
        hub = self.hub
        with hub.cond:
            hub.closed[self.rank] = True
            box = hub.mailboxes[self.rank]
            for req in box.posted:
                req.error = ClosedError(f"rank {self.rank}: transport closed while a recv was pending")
            box.posted.clear()
            hub.cond.notify_all()
