"""The single-producer/single-consumer rings of the shared-memory transport.

Each ring carries a byte stream of records: a 16-byte header ``(tag u64,
length u64)`` at a 16-byte aligned stream position (so it never wraps),
then ``length`` payload bytes, which may wrap and which stream through the
ring in chunks (:data:`CHUNK`) when the message is larger than the ring.

Large messages (>= :data:`RNDV_MIN`, 8 MiB, or, sent by isend, too large
for the ring at once: :func:`by_rendezvous`) to a peer whose CMA flag is set go by
*rendezvous*: the record's length field is ``RNDV_BIT | n`` and its
16-byte payload is ``(address of the sender's buffer, id)``; the receiver
copies the ``n`` bytes with ``process_vm_readv`` (see ``_cma``) straight
into the matched receive buffer, then sends back an acknowledgement record
(length field ``ACK``, tag = id), which completes the send.

The producer side (:class:`OutRing`) writes records and publishes ``head``;
when the ring is full it raises its want-space flag, fences and looks again
(Dekker with the consumer, which rings the producer when it sees the flag
after releasing space).  The consumer side (:class:`InRing`) is drained by
the transport, which owns the matching of records to receives.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any, Deque, List, Optional

from .._engine import SendReq, Unexpected
from ..base import Status
from .doorbell import Doorbell
from .layout import C_CMA, C_HEAD, C_TAIL, C_WANT, CTRL, HDR_SIZE, Segment, fence

__all__ = [
    "InRing",
    "OutRing",
    "RndvEntry",
    "Flow",
    "REC",
    "REC_SIZE",
    "RNDV_BIT",
    "ACK",
    "LEN_MASK",
    "RNDV_MIN",
    "CHUNK",
    "by_rendezvous",
]

REC = struct.Struct("<QQ")  # tag, length
REC_SIZE = 16
#: record length field flags: a rendezvous descriptor (payload: address u64, id u64) and its acknowledgement
RNDV_BIT = 1 << 62
ACK = 1 << 63
LEN_MASK = RNDV_BIT - 1
#: messages of at least this many bytes -- or too large for the ring at once -- go by rendezvous (one
#: process_vm_readv) when the peer can read us (see :func:`by_rendezvous`)
RNDV_MIN = 8 << 20
#: copy granularity, so producer and consumer overlap on large messages
CHUNK = 256 << 10

_ZEROS = memoryview(bytes(CHUNK))


def by_rendezvous(n: int, cap: int) -> bool:
    """Whether a general-path (isend) ``n``-byte message goes by rendezvous through a ring of ``cap`` bytes
    (when the peer can read us): from RNDV_MIN on, or when its record cannot fit the ring at once.

    Below that the ring is faster than process_vm_readv on the VMs measured (issue 14: a 4,000,000-byte
    ping-pong took 155 us through a 4 MiB ring, 450 us by rendezvous; 1 MiB 77 us against 207 us), as the
    receiver copies behind the sender out of a ring that stays in the caches.  A blocking send (p2pfast)
    streams anything below RNDV_MIN through the ring, waiting for room as the receiver copies.
    """
    return n >= RNDV_MIN or n + 2 * REC_SIZE > cap


class Flow:
    """A counter bumped whenever bytes move through a ring: a waiter keeps spinning while it moves."""

    __slots__ = ("moved",)

    def __init__(self) -> None:
        self.moved = 0


class InRing:
    """Consumer side of the ring ``src`` -> me (it lives in my segment ``seg``; ``peer_seg`` is the producer's).

    ``cur`` is the record being received: ``[dest view or None, offset, length, target]``.
    """

    __slots__ = ("src", "seg", "data", "cap", "mask", "head_i", "tail_i", "want_i", "tail", "cur", "peer_seg")

    def __init__(self, src: int, seg: Segment, slot: int, peer_seg: Segment) -> None:
        base = HDR_SIZE + slot * CTRL
        self.src = src
        self.seg = seg
        self.data = seg.data(slot)
        self.cap = seg.cap
        self.mask = seg.cap - 1
        self.head_i = (base + C_HEAD) // 8
        self.tail_i = (base + C_TAIL) // 8
        self.want_i = (base + C_WANT) // 4
        self.tail: int = seg.q[self.tail_i]
        self.cur: Optional[List[Any]] = None  # mixed types, unpacked on the hot path
        self.peer_seg = peer_seg


class OutRing:
    """Producer side of the ring me -> ``dst`` (it lives in dst's segment ``seg``).

    ``pending`` holds the sends not yet fully written, in order; ``cma``: dst probed that it can
    ``process_vm_readv`` our memory, so large messages may go by rendezvous.
    """

    __slots__ = (
        "dst",
        "seg",
        "data",
        "cap",
        "mask",
        "head_i",
        "tail_i",
        "want_i",
        "head",
        "pending",
        "wanting",
        "cma",
        "_ring",
        "_flow",
    )

    def __init__(self, dst: int, seg: Segment, slot: int, bell: Doorbell, flow: Flow) -> None:
        base = HDR_SIZE + slot * CTRL
        self.dst = dst
        self.seg = seg
        self.data = seg.data(slot)
        self.cap = seg.cap
        self.mask = seg.cap - 1
        self.head_i = (base + C_HEAD) // 8
        self.tail_i = (base + C_TAIL) // 8
        self.want_i = (base + C_WANT) // 4
        self.head: int = seg.q[self.head_i]
        self.pending: Deque[SendReq] = deque()
        self.wanting = False
        self.cma = bool(seg.i[(base + C_CMA) // 4])  # dst probed that it can process_vm_readv our memory
        self._ring = bell.ring  # bound once: the hot path
        self._flow = flow

    def try_write(self, tag: int, view: memoryview) -> bool:
        """Write a whole small message (at most CHUNK bytes) now if it fits, publish it and ring dst.

        Returns False (writing nothing) when it does not fit; the caller queues it in ``pending``.
        Only when nothing is pending (order).  Lock held.
        """
        n = view.nbytes
        seg = self.seg
        h = (self.head + 15) & ~15
        end = h + REC_SIZE + n
        if end - seg.q[self.tail_i] > self.cap or n > CHUNK:
            return False
        data = self.data
        pos = h & self.mask
        REC.pack_into(data, pos, tag, n)
        if n:
            pos += REC_SIZE
            first = self.cap - pos
            if n <= first:
                data[pos : pos + n] = view
            else:
                data[pos:] = view[:first]
                data[: n - first] = view[first:]
        self.head = end
        seg.q[self.head_i] = end
        self._ring(seg)
        return True

    def push(self) -> bool:
        """Write as much of the pending sends as fits, publishing and ringing dst as it goes.

        A send whose ``view`` is None (aborted mid-record) is padded with zeros so the stream stays
        framed.  Returns True if a send completed (its ``status`` set unless it already failed).  Lock held.
        """
        seg = self.seg
        q = seg.q
        ring = self._ring
        flow = self._flow
        data, cap, mask = self.data, self.cap, self.mask
        pending = self.pending
        head = self.head
        published = head
        completed = False
        while True:
            tail = q[self.tail_i]
            blocked = False
            while pending:
                s = pending[0]
                if not s.hdr_done:
                    h = (head + 15) & ~15
                    if h + REC_SIZE - tail > cap:
                        blocked = True
                        break
                    REC.pack_into(data, h & mask, s.tag, s.nbytes if s.extra is None else s.extra)
                    head = h + REC_SIZE
                    s.hdr_done = True
                view: Optional[memoryview] = s.view
                off = s.off
                rem = s.nbytes - off
                while rem:
                    free = cap - (head - tail)
                    if free <= 0:
                        if head != published:
                            q[self.head_i] = head
                            published = head
                            ring(seg)
                        tail = q[self.tail_i]
                        free = cap - (head - tail)
                        if free <= 0:
                            break
                    k = min(free, rem, CHUNK)
                    pos = head & mask
                    first = cap - pos
                    if view is None:  # an aborted send: pad the record with zeros
                        src_v, soff = _ZEROS, 0
                    else:
                        src_v, soff = view, off
                    if k <= first:
                        data[pos : pos + k] = src_v[soff : soff + k]
                    else:
                        data[pos:] = src_v[soff : soff + first]
                        data[: k - first] = src_v[soff + first : soff + k]
                    head += k
                    off += k
                    rem -= k
                    flow.moved += 1
                    if rem:  # publish each chunk of a large message so the consumer overlaps with us
                        q[self.head_i] = head
                        published = head
                        ring(seg)
                s.off = off
                if rem:
                    blocked = True
                    break
                pending.popleft()
                if s.error is None:
                    s.status = Status(self.dst, s.nbytes)
                s.view = None  # type: ignore[assignment]  # SendReq.view (_engine) is typed non-optional; drop export
                completed = True
            if head != published:
                q[self.head_i] = head
                published = head
                ring(seg)
            if not blocked:
                if self.wanting:
                    seg.i[self.want_i] = 0
                    self.wanting = False
                break
            # blocked for space: raise the want flag, fence, and look again (Dekker with the consumer)
            if not self.wanting:
                seg.i[self.want_i] = 1
                self.wanting = True
                fence()
                continue
            break
        self.head = head
        return completed


class RndvEntry(Unexpected):
    """A rendezvous message that arrived before its receive: the payload is still in the sender's memory."""

    __slots__ = ("addr", "rid")

    def __init__(self, src: int, nbytes: int, addr: int, rid: int) -> None:
        super().__init__(src, bytearray(), nbytes, False)
        self.addr = addr
        self.rid = rid
