"""Matching engine shared by the loopback, shm and tcp transports.

One :class:`EngineTransport` owns, under one lock:

* ``posted``: receives not yet matched, per tag, in posting order;
* ``unexpected``: messages that arrived before a matching receive, per tag,
  in arrival order (an entry may still be filling: ``complete`` is False
  while its payload streams in; a receive that matches it then waits for it);
* ``failed``: peers known to be dead, with the reason.

Incoming messages are matched when their *header* arrives (so the payload
is copied once, straight into the posted buffer).  Matching rules: a
message ``(src, tag)`` goes to the first posted receive of that tag whose
source is ``src`` or ``ANY_SOURCE``; a new receive takes the first
unexpected message of its tag from a matching source.  Both sides keep
arrival/posting order, which gives MPI's non-overtaking rule.

``ANY_SOURCE`` receives fail with :class:`PeerFailureError` once *any*
peer of the transport is known dead (and no queued message matches): with
a dead member the sender may be the dead one, and waiting until the
deadline only hides the cause.

Receives of a :class:`ClaimGroup` (the router's ANY_SOURCE across several
transports) are posted on every sub-transport; the first sub-transport to
match one *claims* the group, and the other members are dropped.

Subclasses implement ``_send_remote`` and the waiting strategy
(``_wait_req``/``_test_req``); they call ``_notify_locked`` whenever a
request completed or a message arrived.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Deque, Dict, FrozenSet, Iterable, List, Optional, Tuple

from ..deadline import Deadline, as_deadline
from ..errors import ClosedError, ConfigError, DistTimeoutError, PeerFailureError, ProcGroupError
from .base import (
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

__all__ = [
    "delete_key_quiet",
    "EngineRequest",
    "EngineTransport",
    "RecvReq",
    "SendReq",
    "Unexpected",
    "ClaimGroup",
    "LoopbackTransport",
    "timeout_error",
]


class ClaimGroup:
    """Members of one ANY_SOURCE receive posted on several transports; the first match wins."""

    __slots__ = ("_lock", "winner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.winner: object = None

    def claim(self, who: object) -> bool:
        with self._lock:
            if self.winner is None:
                self.winner = who
                return True
            return self.winner is who


class EngineRequest(Request):
    """A send or receive of an :class:`EngineTransport`: done once ``status`` or ``error`` is set (under its lock).

    ``wait`` returns the status or raises the error; while neither is set it defers to the transport's
    waiting strategy (``_wait_req``), which raises :class:`DistTimeoutError` at the deadline.
    """

    __slots__ = ("owner", "peer", "tag", "status", "error")

    def __init__(self, owner: "EngineTransport", peer: int, tag: int) -> None:
        self.owner = owner
        self.peer = peer
        self.tag = tag
        self.status: Optional[Status] = None
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if self.status is not None or self.error is not None:
            return True
        return self.owner._test_req(self)

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        st = self.status
        if st is not None:
            return st
        if self.error is not None:
            raise self.error
        if deadline is not None and not isinstance(deadline, Deadline):
            deadline = as_deadline(deadline)  # seconds or a timedelta, leniently
        return self.owner._wait_req(self, deadline)


class RecvReq(EngineRequest):
    __slots__ = ("out", "group")
    kind = "recv"

    def __init__(
        self, owner: "EngineTransport", src: int, tag: int, out: memoryview, group: Optional[ClaimGroup] = None
    ) -> None:
        super().__init__(owner, src, tag)
        self.out = out
        self.group = group


class SendReq(EngineRequest):
    """A send that could not complete at post time (the transport finishes it later)."""

    __slots__ = ("view", "nbytes", "off", "hdr_done", "extra")
    kind = "send"

    def __init__(self, owner: "EngineTransport", dst: int, tag: int, view: memoryview) -> None:
        super().__init__(owner, dst, tag)
        self.view = view
        self.nbytes = view.nbytes
        self.off = 0
        self.hdr_done = False
        self.extra: object = None


class Unexpected:
    """A message that arrived before its receive was posted (``buf`` may still be filling)."""

    __slots__ = ("src", "buf", "nbytes", "complete", "waiter")

    def __init__(self, src: int, buf: bytearray, nbytes: int, complete: bool) -> None:
        self.src = src
        self.buf = buf
        self.nbytes = nbytes
        self.complete = complete
        self.waiter: Optional[RecvReq] = None


def delete_key_quiet(store: object, key: str) -> None:
    """Best effort: drop a store key nobody will read again (stores without ``delete_key`` keep it)."""
    fn = getattr(store, "delete_key", None)
    if fn is not None:
        try:
            fn(key)
        except Exception as e:  # noqa: BLE001 - housekeeping only
            logging.getLogger("procgroup.transport").debug("could not delete store key %s: %s", key, e)


def _src_name(src: int) -> str:
    return "any rank" if src == ANY_SOURCE else f"rank {src}"


def timeout_error(me: int, req: EngineRequest, deadline: Deadline, kind: str) -> DistTimeoutError:
    if isinstance(req, RecvReq):
        what = f"recv from {_src_name(req.peer)}"
    else:
        what = f"send to rank {req.peer}"
    return DistTimeoutError(
        f"rank {me}: {what} (tag {req.tag}, {kind} transport) did not complete after {deadline.elapsed():.2f}s; "
        "the peer may be slow, stuck or waiting for something else; extend the deadline with timeout= "
        "(or PROCGROUP_TIMEOUT)"
    )


class EngineTransport(Transport):
    """Base of the loopback/shm/tcp transports: request matching and failure bookkeeping."""

    kind = "engine"

    def __init__(self, rank: int, world_size: int, peers: Iterable[int]) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside [0, {world_size})")
        self.rank = rank
        self.world_size = world_size
        self._peers = frozenset(int(p) for p in peers if p != rank)
        for p in self._peers:
            if not 0 <= p < world_size:
                raise ConfigError(f"peer rank {p} is outside [0, {world_size})")
        self._lock = threading.Lock()
        self._posted: Dict[int, List[RecvReq]] = {}
        self._unexpected: Dict[int, Deque[Unexpected]] = {}
        self._failed: Dict[int, str] = {}
        self._closed = False
        self._aborted: Optional[BaseException] = None
        self._hooks: List[Callable[[], None]] = []

    # -- public API -----------------------------------------------------------------
    @property
    def peers(self) -> FrozenSet[int]:
        """The remote ranks this transport reaches (self-sends always work too)."""
        return self._peers

    def isend(self, dst: int, tag: int, data: Buffer) -> Request:
        view = as_bytes_view(data)
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        if self._aborted is not None:
            raise self._aborted
        if self._closed:
            raise ClosedError(f"rank {self.rank}: send to rank {dst} on a closed {self.kind} transport")
        if dst == self.rank:
            return self._send_self(tag, view)
        if dst not in self._peers:
            raise self._bad_peer(dst, "send to")
        reason = self._failed.get(dst)
        if reason is not None:
            raise PeerFailureError(f"rank {self.rank}: send to rank {dst} (tag {tag}) failed: {reason}", peer=dst)
        self.bytes_sent += view.nbytes  # for `procgroup top` (procgroup.telemetry)
        return self._send_remote(dst, tag, view)

    def irecv(self, src: int, tag: int, out: Buffer) -> Request:
        """Post a receive into ``out`` (see :class:`~procgroup.transport.base.Transport`); ConfigError if misused.

        Raises the abort error after :meth:`abort`, :class:`ClosedError` after :meth:`close`.
        """
        req = self._irecv(src, tag, out, None)
        assert req is not None, "a receive outside a claim group is always posted"
        return req

    def unmatched(self, src: int, tag: int, mask: int) -> Optional[Tuple[int, int]]:
        """An unexpected message from ``src`` whose tag differs from ``tag`` in ``mask`` only (see Transport)."""
        want = tag & ~mask
        with self._lock:
            for t, q in self._unexpected.items():
                if t != tag and t & ~mask == want:
                    for e in q:
                        if src == ANY_SOURCE or e.src == src:
                            return e.src, t
        return None

    def mark_peer_failed(self, peer: int, reason: str) -> None:
        with self._lock:
            if peer in self._peers and peer not in self._failed:
                self._fail_peer_locked(peer, reason)

    def abort(self, exc: BaseException) -> None:
        """Fail every pending and later request with ``exc`` until :meth:`close`.

        Messages that were half transferred stay half transferred: after an
        abort the only sensible call is ``close()``.
        """
        with self._lock:
            if self._closed or self._aborted is not None:
                return
            self._aborted = exc
            self._fail_all_locked(exc)
            self._notify_locked()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._close_locked()
        self._after_close()

    def add_activity_hook(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` whenever a request completes or a message arrives (under the transport lock: keep it tiny)."""
        self._hooks.append(fn)

    # -- internals for the router --------------------------------------------------
    def _irecv(self, src: int, tag: int, out: Buffer, group: Optional[ClaimGroup]) -> Optional[RecvReq]:
        """Post a receive; with ``group``, returns None when the group was already claimed elsewhere."""
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        if src != ANY_SOURCE and src != self.rank and src not in self._peers:
            raise self._bad_peer(src, "recv from")
        view = as_writable_view(out)
        req = RecvReq(self, src, tag, view, group)
        with self._lock:
            if self._aborted is not None:
                raise self._aborted
            if self._closed:
                raise ClosedError(f"rank {self.rank}: recv from {_src_name(src)} on a closed {self.kind} transport")
            if not self._post_locked(req):
                return None
        return req

    def _cancel(self, req: RecvReq) -> None:
        """Withdraw a posted (unmatched) receive; no-op if it already matched."""
        with self._lock:
            lst = self._posted.get(req.tag)
            if lst is not None:
                try:
                    lst.remove(req)
                except ValueError:
                    pass
                if not lst:
                    del self._posted[req.tag]

    # -- matching (lock held) ------------------------------------------------------
    def _post_locked(self, req: RecvReq) -> bool:
        src, tag = req.peer, req.tag
        q = self._unexpected.get(tag)
        if q:
            for entry in q:
                if src == ANY_SOURCE or entry.src == src:
                    if req.group is not None and not req.group.claim(req):
                        return False
                    q.remove(entry)
                    if not q:
                        del self._unexpected[tag]
                    if entry.complete:
                        self._deliver_from(req, entry)
                    else:
                        entry.waiter = req
                        self._entry_matched_locked(entry)
                    return True
        if req.group is not None and req.group.winner is not None:
            return False
        if self._failed:
            if src == ANY_SOURCE:
                peer = min(self._failed)
                req.error = self._peer_error(req, peer, self._failed[peer])
                return True
            reason = self._failed.get(src)
            if reason is not None:
                req.error = self._peer_error(req, src, reason)
                return True
        lst = self._posted.get(tag)
        if lst is None:
            self._posted[tag] = [req]
        else:
            lst.append(req)
        return True

    def _match_locked(self, src: int, tag: int) -> Optional[RecvReq]:
        """The posted receive that an arriving message (src, tag) goes to, removed from ``posted``."""
        lst = self._posted.get(tag)
        if not lst:
            return None
        i = 0
        while i < len(lst):
            r = lst[i]
            if r.peer == src or r.peer == ANY_SOURCE:
                if r.group is not None and not r.group.claim(r):
                    del lst[i]  # a stale member: the group was satisfied by another transport
                    continue
                del lst[i]
                if not lst:
                    del self._posted[tag]
                return r
            i += 1
        if not lst:
            del self._posted[tag]
        return None

    def _add_unexpected_locked(self, tag: int, entry: Unexpected) -> None:
        q = self._unexpected.get(tag)
        if q is None:
            self._unexpected[tag] = deque((entry,))
        else:
            q.append(entry)

    def _size_error(self, req: RecvReq, src: int, n: int) -> ProcGroupError:
        return ProcGroupError(
            f"rank {self.rank}: message of {n} bytes from rank {src} (tag {req.tag}) does not fit the receive "
            f"buffer of {req.out.nbytes} bytes: the ranks disagree about the message size"
        )

    def _deliver_from(self, req: RecvReq, entry: Unexpected) -> None:
        n = entry.nbytes
        if n > req.out.nbytes:
            req.error = self._size_error(req, entry.src, n)
            return
        if n:
            req.out[:n] = memoryview(entry.buf)[:n]
        req.status = Status(entry.src, n)
        req.out = None  # type: ignore[assignment]  # drop the export: a bytearray may be resized again

    def _entry_matched_locked(self, entry: Unexpected) -> None:
        """A receive became the waiter of the incomplete ``entry`` (subclasses: e.g. start a rendezvous read)."""

    def _entry_done_locked(self, entry: Unexpected) -> None:
        entry.complete = True
        if entry.waiter is not None:
            self._deliver_from(entry.waiter, entry)
            entry.waiter = None

    def _notify_locked(self) -> None:
        for fn in self._hooks:
            fn()

    # -- loopback ---------------------------------------------------------------------
    def _send_self(self, tag: int, view: memoryview) -> Request:
        n = view.nbytes
        with self._lock:
            if self._closed:
                raise ClosedError(f"rank {self.rank}: send to self on a closed {self.kind} transport")
            req = self._match_locked(self.rank, tag)
            if req is not None:
                if n > req.out.nbytes:
                    req.error = self._size_error(req, self.rank, n)
                else:
                    req.out[:n] = view
                    req.status = Status(self.rank, n)
                    req.out = None  # type: ignore[assignment]  # drop the buffer export; out is typed for live use
            else:
                self._add_unexpected_locked(tag, Unexpected(self.rank, bytearray(view), n, True))
            self._notify_locked()
        return CompletedRequest(Status(self.rank, n))

    # -- failures -----------------------------------------------------------------------
    def _bad_peer(self, peer: int, what: str) -> ConfigError:
        if 0 <= peer < self.world_size:
            return ConfigError(
                f"rank {self.rank}: {what} rank {peer}, which this {self.kind} transport does not reach "
                f"(it reaches {sorted(self._peers)})"
            )
        return ConfigError(f"rank {self.rank}: {what} rank {peer}, which is outside [0, {self.world_size})")

    def _peer_error(self, req: EngineRequest, peer: int, reason: str) -> PeerFailureError:
        if isinstance(req, RecvReq):
            what = f"recv from {_src_name(req.peer)}"
        else:
            what = f"send to rank {req.peer}"
        return PeerFailureError(f"rank {self.rank}: {what} (tag {req.tag}) cannot complete: {reason}", peer=peer)

    def _fail_peer_locked(self, peer: int, reason: str) -> None:
        """Record the death of ``peer``; fail every receive that depended on it.

        Subclasses extend this for their in-flight messages and pending sends.
        """
        self._failed[peer] = reason
        for tag in list(self._posted):
            lst = self._posted[tag]
            keep = []
            for r in lst:
                if r.peer == peer or r.peer == ANY_SOURCE:
                    if r.group is None or r.group.winner is None:
                        r.error = self._peer_error(r, peer, reason)
                else:
                    keep.append(r)
            if keep:
                self._posted[tag] = keep
            else:
                del self._posted[tag]
        for tag in list(self._unexpected):
            q = self._unexpected[tag]
            for e in [e for e in q if e.src == peer and not e.complete]:
                q.remove(e)
            if not q:
                del self._unexpected[tag]
        self._notify_locked()

    def _fail_entry_locked(self, entry: Unexpected, err: BaseException) -> None:
        """An unexpected message that will never complete: fail its waiter, drop it."""
        if entry.waiter is not None:
            entry.waiter.error = err
            entry.waiter = None
        for tag, dq in list(self._unexpected.items()):
            if entry in dq:
                dq.remove(entry)
                if not dq:
                    del self._unexpected[tag]
                break

    def _close_locked(self) -> None:
        self._closed = True
        err = ClosedError(f"rank {self.rank}: the {self.kind} transport was closed while this request was pending")
        self._fail_all_locked(err)
        self._notify_locked()

    def _fail_all_locked(self, err: BaseException) -> None:
        """Every pending request fails with ``err`` (close, abort)."""
        self._fail_inflight_locked(err)
        for lst in self._posted.values():
            for r in lst:
                if r.status is None and r.error is None and (r.group is None or r.group.winner is None):
                    r.error = err
        self._posted.clear()
        for q in self._unexpected.values():
            for e in q:
                if e.waiter is not None:
                    e.waiter.error = err
                    e.waiter = None

    def _fail_inflight_locked(self, err: BaseException) -> None:
        """Subclasses: fail the messages being transferred and the pending sends."""

    def _after_close(self) -> None:
        """Release resources outside the lock (subclasses)."""

    # -- waiting (subclasses) -------------------------------------------------------------
    def _send_remote(self, dst: int, tag: int, view: memoryview) -> Request:
        raise NotImplementedError

    def _test_req(self, req: EngineRequest) -> bool:
        return req.status is not None or req.error is not None

    def _wait_req(self, req: EngineRequest, deadline: Optional[Deadline]) -> Status:
        raise NotImplementedError


class LoopbackTransport(EngineTransport):
    """Only self-sends (world of one, or the router's loopback for ``dst == rank``)."""

    kind = "loopback"

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank, world_size, ())
        self._cond = threading.Condition(self._lock)

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        super()._notify_locked()

    def _wait_req(self, req: EngineRequest, deadline: Optional[Deadline]) -> Status:
        with self._cond:
            while True:
                if req.status is not None:
                    return req.status
                if req.error is not None:
                    raise req.error
                rem = None if deadline is None else deadline.remaining()
                if deadline is not None and rem is not None and rem <= 0:
                    raise timeout_error(self.rank, req, deadline, self.kind)
                self._cond.wait(None if rem is None or rem == float("inf") else rem)
