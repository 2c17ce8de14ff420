"""procgroup's Transport over MPI point-to-point (mpi4py): any procgroup algorithm runs over it unchanged.

procgroup tags are 63-bit and MPI's at most ``MPI_TAG_UB`` (2**31 - 1 in Open MPI and MPICH, possibly
less), so tags cannot be mapped onto MPI's one to one.  Each message therefore starts with an *envelope*,
sent on one MPI tag (``ENVELOPE``) of a communicator of its own:

* ``tag`` (u64), ``nbytes`` (u64), ``seq`` (u64): procgroup's tag, the payload size, and the sender's
  count of large messages to this receiver;
* up to :data:`EAGER_BYTES` of payload travel inside the envelope (one MPI message, one copy on each side);
  a larger payload follows as a second MPI message on tag ``DATA_BASE + seq mod span``, received straight
  into the user's buffer (no copy).

Every rank keeps :data:`SLOTS` receives posted for envelopes from ``MPI_ANY_SOURCE``.  MPI matches them
in the order they were posted, and messages from one sender in the order they were sent, so reading the
slots in posting order sees each sender's envelopes in order: procgroup's matching (by source and full tag,
``ANY_SOURCE`` included, posted receives in posting order) then runs in Python, exactly as in the memory
transport.  A large payload's MPI tag is unique among that sender's in-flight messages to that receiver.

Waits poll ``Test`` under the deadline through :class:`~._waiting.Liveness` (spin, then back off).
All MPI calls of one transport happen under its lock, so the MPI library need not be thread-safe for it.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from ...deadline import Deadline
from ...errors import ConfigError, PeerFailureError, ProcGroupError
from ...transport.base import (
    ANY_SOURCE,
    TAG_LIMIT,
    Buffer,
    CompletedRequest,
    Request,
    Status,
    Transport,
    as_bytes_view,
    as_writable_view,
)
from ._waiting import Liveness

__all__ = ["MpiTransport", "EAGER_BYTES", "SLOTS", "ENVELOPE", "DATA_BASE"]

#: payloads up to this size travel inside the envelope
EAGER_BYTES = 16 << 10
#: envelope receives kept posted
SLOTS = 16
#: the MPI tag of envelopes, and the first MPI tag of large payloads
ENVELOPE = 1
DATA_BASE = 2

_HEAD = struct.Struct("<QQQ")  # tag, nbytes, seq (seq = 0: payload inside)
_HB = _HEAD.size


class _Recv(Request):
    """A pending receive: matched in Python, then either filled from an envelope or by an MPI receive."""

    __slots__ = ("t", "src", "tag", "out", "status", "error", "mreq", "drain")

    def __init__(self, t: "MpiTransport", src: int, tag: int, out: memoryview) -> None:
        self.t = t
        self.src = src
        self.tag = tag
        self.out = out
        self.status: Optional[Status] = None
        self.error: Optional[BaseException] = None
        self.mreq: Any = None  # MPI request of a large payload
        self.drain: Any = None  # (src, n) while mreq runs

    def test(self) -> bool:
        if self.status is not None or self.error is not None:
            return True
        t = self.t
        with t._lock:
            t._progress()
            if self.mreq is not None and self.mreq.Test():
                self.mreq = None
                src, n = self.drain
                self.status = Status(src, n)
        return self.status is not None or self.error is not None

    def _what(self) -> str:
        src = "any rank" if self.src == ANY_SOURCE else f"rank {self.src}"
        return f"recv from {src} (tag {self.tag}, {self.out.nbytes} bytes)"

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        if not self.test():
            # an any-source receive fails when any rank is known dead (it might have been the sender)
            peers = (self.drain[0],) if self.drain is not None else (None if self.src == ANY_SOURCE else (self.src,))
            self.t.live.wait(self.test, deadline, self._what, peers, self.out.nbytes)
        if self.error is not None:
            raise self.error
        assert self.status is not None
        return self.status


class _Send(Request):
    """A pending send: done when its MPI request(s) are (the envelope buffer is kept alive until then)."""

    __slots__ = ("t", "dst", "reqs", "keep", "status")

    def __init__(self, t: "MpiTransport", dst: int, reqs: List[Any], keep: Any, status: Status) -> None:
        self.t = t
        self.dst = dst
        self.reqs = reqs
        self.keep = keep
        self.status = status

    def test(self) -> bool:
        if not self.reqs:
            return True
        with self.t._lock:
            self.t._progress()
            self.reqs = [r for r in self.reqs if not r.Test()]
        if not self.reqs:
            self.keep = None
        return not self.reqs

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        if not self.test():
            self.t.live.wait(self.test, deadline, self._what, (self.dst,), self.status.nbytes)
        return self.status

    def _what(self) -> str:
        return f"send to rank {self.dst} ({self.status.nbytes} bytes)"


class MpiTransport(Transport):
    """Tagged messages among the ranks of ``comm`` (a communicator of its own, rank order = procgroup's)."""

    kind = "mpi"

    def __init__(self, MPI: Any, comm: Any, live: Liveness) -> None:
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.live = live
        ub = comm.Get_attr(MPI.TAG_UB)
        self._span = max(1, int(ub if ub else 32767) - DATA_BASE)
        self._lock = threading.RLock()
        self._sseq = [0] * self.world_size  # large messages sent, per receiver
        self._posted: List[_Recv] = []
        self._unexpected: Dict[int, Deque[Tuple[int, int, int, Optional[bytes]]]] = {}
        self._drains: List[Any] = []
        self._bufs = [bytearray(_HB + EAGER_BYTES) for _ in range(SLOTS)]
        self._status = [MPI.Status() for _ in range(SLOTS)]
        self._slots = [comm.Irecv(self._bufs[i], MPI.ANY_SOURCE, ENVELOPE) for i in range(SLOTS)]
        self._head = 0

    # -- matching ------------------------------------------------------------------------------
    def _progress(self) -> None:
        """Read every arrived envelope, in posting order; match it or keep it as unexpected (lock held)."""
        slots = self._slots
        while slots:
            i = self._head
            st = self._status[i]
            if not slots[i].Test(st):
                break
            src = st.Get_source()
            buf = self._bufs[i]
            tag, n, seq = _HEAD.unpack_from(buf, 0)
            for k, r in enumerate(self._posted):
                if r.tag == tag and (r.src == ANY_SOURCE or r.src == src):
                    del self._posted[k]
                    self._deliver(r, src, n, seq, memoryview(buf)[_HB : _HB + n] if seq == 0 else None)
                    break
            else:
                data = bytes(buf[_HB : _HB + n]) if seq == 0 else None
                self._unexpected.setdefault(tag, deque()).append((src, n, seq, data))
            slots[i] = self.comm.Irecv(buf, self.MPI.ANY_SOURCE, ENVELOPE)
            self._head = (i + 1) % SLOTS
        if self._drains:
            self._drains = [d for d in self._drains if not d[0].Test()]

    def _deliver(self, r: _Recv, src: int, n: int, seq: int, data: Optional[Any]) -> None:
        if n > r.out.nbytes:
            r.error = ProcGroupError(
                f"rank {self.rank}: message of {n} bytes from rank {src} (tag {r.tag}) does not fit the receive "
                f"buffer of {r.out.nbytes} bytes: the ranks disagree about the message size"
            )
            if data is None:  # receive the payload anyway, so that it does not block the sender
                junk = bytearray(n)
                self._drains.append((self.comm.Irecv(junk, src, DATA_BASE + (seq - 1) % self._span), junk))
            return
        if data is not None:
            r.out[:n] = data
            r.status = Status(src, n)
            return
        r.drain = (src, n)
        r.mreq = self.comm.Irecv([r.out[:n], self.MPI.BYTE], src, DATA_BASE + (seq - 1) % self._span)

    # -- the Transport interface -----------------------------------------------------------------
    def _check(self, peer: int, what: str, allow_any: bool = False) -> None:
        self.live.check((), what)
        if allow_any and peer == ANY_SOURCE:
            return
        if not 0 <= peer < self.world_size:
            raise ConfigError(f"rank {self.rank}: {what} peer {peer} is outside [0, {self.world_size})")
        why = self.live.failed.get(peer)
        if why is not None:
            raise PeerFailureError(
                f"rank {self.rank}: {what} rank {peer} failed: rank {peer} failed ({why})", peer=peer
            )

    def isend(self, dst: int, tag: int, data: Buffer) -> Request:
        """Send ``data`` to ``dst`` with ``tag``; small payloads are copied (the request is then done at once)."""
        self._check(dst, "send to")
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        view = as_bytes_view(data)
        n = view.nbytes
        with self._lock:
            if n <= EAGER_BYTES:
                env = bytearray(_HB + n)
                _HEAD.pack_into(env, 0, tag, n, 0)
                env[_HB:] = view
                req = self.comm.Isend(env, dst, ENVELOPE)
                if req.Test():
                    return CompletedRequest(Status(dst, n))
                return _Send(self, dst, [req], env, Status(dst, n))
            self._sseq[dst] += 1
            seq = self._sseq[dst]
            env = bytearray(_HB)
            _HEAD.pack_into(env, 0, tag, n, seq)
            data_tag = DATA_BASE + (seq - 1) % self._span
            reqs = [self.comm.Isend(env, dst, ENVELOPE), self.comm.Isend([view, self.MPI.BYTE], dst, data_tag)]
            return _Send(self, dst, reqs, (env, view), Status(dst, n))

    def irecv(self, src: int, tag: int, out: Buffer) -> Request:
        """Receive the next message from ``src`` (or ANY_SOURCE) with ``tag`` into ``out``."""
        self._check(src, "recv from", allow_any=True)
        view = as_writable_view(out)
        r = _Recv(self, src, tag, view)
        with self._lock:
            self._progress()
            q = self._unexpected.get(tag)
            if q:
                for i, (s, n, seq, data) in enumerate(q):
                    if src == ANY_SOURCE or s == src:
                        del q[i]
                        if not q:
                            del self._unexpected[tag]
                        self._deliver(r, s, n, seq, data)
                        return r
            self._posted.append(r)
        return r

    def unmatched(self, src: int, tag: int, mask: int) -> Optional[Tuple[int, int]]:
        """An arrived envelope from ``src`` whose tag differs from ``tag`` in ``mask`` only (see Transport)."""
        want = tag & ~mask
        with self._lock:
            self._progress()
            for t, q in self._unexpected.items():
                if t != tag and t & ~mask == want:
                    for e in q:
                        if src == ANY_SOURCE or e[0] == src:
                            return e[0], t
        return None

    def mark_peer_failed(self, peer: int, reason: str) -> None:
        """Waits on ``peer`` fail with PeerFailureError carrying ``reason``."""
        self.live.mark_failed(peer, reason)

    def abort(self, exc: BaseException) -> None:
        """Every pending and later wait (collectives of the engine included) fails with ``exc``."""
        self.live.abort(exc)

    def close(self) -> None:
        """Cancel the envelope receives and fail later waits with ClosedError (idempotent)."""
        with self._lock:
            if self.live.closed and not self._slots:
                return
            for r in self._slots:
                try:
                    r.Cancel()
                except Exception:  # noqa: BLE001 - best effort while shutting down
                    pass
            self._slots = []
            self._posted.clear()
        self.live.close()
