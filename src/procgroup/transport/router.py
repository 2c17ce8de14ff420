"""RouterTransport: one Transport over several, chosen per peer (shm within a host, tcp across).

Sends and receives with a definite peer go straight to that peer's
sub-transport; ``dst == rank`` goes to a loopback transport.

``ANY_SOURCE`` across sub-transports: the receive is posted on every
sub-transport as a member of one :class:`~procgroup.transport._engine.ClaimGroup`;
the first sub-transport whose matching picks a member claims the group,
and the other members are withdrawn (so exactly one message is consumed).
Waiting uses a *shared notification*: every sub-transport reports activity
through a hook, which pokes the shm transport's public doorbell
(:attr:`ShmTransport.doorbell <procgroup.transport.shm.ShmTransport.doorbell>`,
a futex word, so the waiter sleeps in the kernel and is also woken directly
by shm peers), or, without an shm sub-transport, notifies a condition variable.
Between wakes the waiter re-tests the members (which also drives the shm
progress engine and its peer-liveness checks) at least every 50 ms.

Progress: shm progress happens only inside waits, so a wait on a tcp (or
loopback) request keeps driving the shm engine: otherwise a rank blocked on
a tcp receive could hold back the rest of a large shm message that the tcp
sender is itself waiting for.  A tcp request is waited for by reading its
socket in the waiting thread (``TcpTransport._wait_slice``), in slices
between shm progress passes: 1 ms while the shm side is busy, 20 ms while it
is quiet.

Sub-transports must be :class:`~procgroup.transport._engine.EngineTransport`
instances (loopback, shm, tcp) for ANY_SOURCE to span them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..deadline import Deadline
from ..errors import ClosedError, ConfigError, DistTimeoutError
from ._engine import ClaimGroup, EngineTransport, LoopbackTransport, RecvReq
from .base import (
    ANY_SOURCE,
    Arena,
    Buffer,
    CompletedRequest,
    Request,
    Status,
    Transport,
)
from .shm import Doorbell, ShmTransport

__all__ = ["RouterTransport"]

_SLICE = 0.05
_DIRECT_BUSY = 0.001  # a tcp waiter's read slice while the shm side has work (see RouterTransport._direct_slice)
_DIRECT_QUIET = 0.02


class _Routed(Request):
    """A request of a non-shm sub-transport, waited for so that shm progress continues meanwhile."""

    __slots__ = ("_router", "_inner")

    def __init__(self, router: "RouterTransport", inner: Request) -> None:
        self._router = router
        self._inner = inner

    def test(self) -> bool:
        """Drive shm progress once, then test the sub-transport request (True when it finished)."""
        self._router._kick()
        return self._inner.test()

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        """Wait for the sub-transport request while driving shm progress.

        Returns its status, or raises its error (a timeout past ``deadline``).
        """
        inner = self._inner
        st: Optional[Status] = getattr(inner, "status", None)
        if st is not None:  # complete already (a wait_many read it): nothing to wait for, no shm pass needed
            return st
        direct = getattr(getattr(inner, "owner", None), "_wait_slice", None)
        if direct is not None:  # tcp: read our own socket between shm progress passes
            router = self._router
            bell = router._bell
            snap = bell.snapshot() if bell is not None else 0
            while not self.test():
                t = router._direct_slice(snap)
                if bell is not None:
                    snap = bell.snapshot()
                if deadline is not None:
                    rem = deadline.remaining()
                    if rem <= 0:
                        break
                    t = min(t, rem)
                direct(inner, t)
        elif not inner.test():
            self._router._wait_loop(self.test, deadline)
        return inner.wait(deadline)  # the result, or the request's own error (a timeout once the deadline passed)


class _AnyRecv(Request):
    """ANY_SOURCE receive spanning several sub-transports."""

    __slots__ = ("_router", "_group", "_members", "tag", "_result", "_error")

    def __init__(self, router: "RouterTransport", group: ClaimGroup, members: List[RecvReq], tag: int) -> None:
        self._router = router
        self._group = group
        self._members = members
        self.tag = tag
        self._result: Optional[Status] = None
        self._error: Optional[BaseException] = None

    def _settle(self) -> bool:
        """Decide the outcome if possible; True when decided."""
        if self._result is not None or self._error is not None:
            return True
        w = self._group.winner
        if isinstance(w, RecvReq):
            if w.status is not None:
                self._result = w.status
            elif w.error is not None:
                self._error = w.error
            else:
                return False
            self._withdraw()
            return True
        for m in self._members:
            if m.error is not None and m.status is None:
                if self._group.claim(self):  # no member can win any more
                    self._error = m.error
                    self._withdraw()
                    return True
                return self._settle()
        return False

    def _withdraw(self) -> None:
        w = self._group.winner
        for m in self._members:
            if m is not w:
                m.owner._cancel(m)
                m.out = None  # type: ignore[assignment]  # RecvReq.out is typed non-optional; drop the export

    def test(self) -> bool:
        """True once one member matched (or none can any more); drives every member's progress."""
        if self._settle():
            return True
        for m in self._members:
            m.test()  # drives the shm member's progress
        self._router._kick()
        return self._settle()

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        """The status of the member that matched.

        Raises a member's PeerFailureError/ClosedError, or DistTimeoutError past ``deadline``.
        """
        if not self.test():
            self._router._wait_loop(self.test, deadline)
        if not self._settle():
            waited = f"after {deadline.elapsed():.2f}s" if deadline is not None else "in time"
            raise DistTimeoutError(
                f"rank {self._router.rank}: recv from any rank (tag {self.tag}, router transport) did not complete "
                f"{waited}; extend the deadline with timeout= (or PROCGROUP_TIMEOUT)"
            )
        if self._error is not None:
            raise self._error
        assert self._result is not None  # settled without an error
        return self._result


class RouterTransport(Transport):
    """Dispatch each peer to its own transport; ANY_SOURCE spans them (see the module docstring)."""

    kind = "router"

    def __init__(
        self,
        per_peer: Dict[int, Transport],
        self_transport: Optional[Transport] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ) -> None:
        subs = list(per_peer.values()) + ([self_transport] if self_transport is not None else [])
        if rank is None or world_size is None:
            if not subs:
                raise ConfigError("RouterTransport needs sub-transports, or rank= and world_size=")
            rank, world_size = subs[0].rank, subs[0].world_size
        for t in subs:
            if t.rank != rank or t.world_size != world_size:
                raise ConfigError(
                    f"sub-transport {t!r} is rank {t.rank} of {t.world_size}, not rank {rank} of {world_size}"
                )
        if rank in per_peer:
            raise ConfigError(f"per_peer maps this rank ({rank}) itself; pass self_transport for self-sends")
        self.rank = rank
        self.world_size = world_size
        self._per_peer = dict(per_peer)
        self._self = self_transport if self_transport is not None else LoopbackTransport(rank, world_size)
        uniq: List[Transport] = []
        for t in list(self._per_peer.values()) + [self._self]:
            if all(t is not u for u in uniq):
                uniq.append(t)
        self._subs = uniq
        self._closed = False
        # shared notification
        self._shm: Optional[ShmTransport] = next((t for t in uniq if isinstance(t, ShmTransport)), None)
        self._bell: Optional[Doorbell] = self._shm.doorbell if self._shm is not None else None
        self._cond = threading.Condition()
        self._ticks = 0
        for t in uniq:
            if t is not self._shm and isinstance(t, EngineTransport):
                t.add_activity_hook(self._poke)

    # -- routing ------------------------------------------------------------------------------
    def _route(self, peer: int, what: str) -> Transport:
        if peer == self.rank:
            return self._self
        t = self._per_peer.get(peer)
        if t is None:
            raise ConfigError(
                f"rank {self.rank}: {what} rank {peer}: no transport reaches it (world size {self.world_size})"
            )
        return t

    def _wrap(self, t: Transport, req: Request) -> Request:
        # A wait on a tcp/loopback request must keep the shm progress engine turning: this rank
        # may owe the rest of a large shm message to a peer that the awaited message depends on.
        if self._shm is None or t is self._shm or isinstance(req, CompletedRequest):
            return req
        return _Routed(self, req)

    def isend(self, dst: int, tag: int, data: Buffer) -> Request:
        """Send to ``dst`` through its sub-transport (loopback for ourselves).

        Raises ConfigError when no sub-transport reaches ``dst``, ClosedError once closed.
        """
        if self._closed:
            raise ClosedError(f"rank {self.rank}: send to rank {dst} on a closed router transport")
        t = self._route(dst, "send to")
        return self._wrap(t, t.isend(dst, tag, data))

    def irecv(self, src: int, tag: int, out: Buffer) -> Request:
        """Receive from ``src`` through its sub-transport.

        ``ANY_SOURCE`` posts on every sub-transport and takes the first match.  ClosedError once closed.
        """
        if self._closed:
            raise ClosedError(f"rank {self.rank}: recv on a closed router transport")
        if src != ANY_SOURCE:
            t = self._route(src, "recv from")
            return self._wrap(t, t.irecv(src, tag, out))
        if len(self._subs) == 1:
            return self._subs[0].irecv(ANY_SOURCE, tag, out)
        group = ClaimGroup()
        members: List[RecvReq] = []
        for t in self._subs:
            if not isinstance(t, EngineTransport):
                raise ConfigError(f"ANY_SOURCE across transports needs engine transports, not {type(t).__name__}")
            m = t._irecv(ANY_SOURCE, tag, out, group)
            if m is not None:
                members.append(m)
            if isinstance(group.winner, RecvReq):
                break  # an unexpected message matched already: post no further members
        return _AnyRecv(self, group, members, tag)

    def unmatched(self, src: int, tag: int, mask: int) -> Optional[Tuple[int, int]]:
        """Asks the sub-transport of ``src`` (every one for ANY_SOURCE); see Transport.unmatched."""
        if src != ANY_SOURCE:
            return self._route(src, "probe").unmatched(src, tag, mask)
        for t in [self._self, *self._subs]:
            hit = t.unmatched(src, tag, mask)
            if hit is not None:
                return hit
        return None

    def arena(self, key: int, members: Sequence[int], *, spanning: bool = False) -> Optional[Arena]:
        """The arena of the sub-transport that reaches every other member (the shm one of this host), if any."""
        others = [int(m) for m in members if int(m) != self.rank]
        t = self._per_peer.get(others[0]) if others else None
        if t is None or any(self._per_peer.get(m) is not t for m in others):
            return None
        return t.arena(key, members, spanning=spanning)

    def sent_bytes(self) -> int:
        """Payload bytes sent to other ranks so far, over every sub-transport."""
        return sum(t.sent_bytes() for t in self._subs)

    def mark_peer_failed(self, peer: int, reason: str) -> None:
        """Record ``peer`` as failed (``reason``) on the sub-transport that reaches it."""
        t = self._per_peer.get(peer)
        if t is not None:
            t.mark_peer_failed(peer, reason)

    def abort(self, exc: BaseException) -> None:
        """Fail every pending request of every sub-transport with ``exc`` and wake every waiter."""
        for t in self._subs:
            t.abort(exc)
        with self._cond:
            self._ticks += 1
            self._cond.notify_all()
        if self._bell is not None:
            self._bell.poke()

    def close(self) -> None:
        """Close every sub-transport (idempotent); pending requests fail with ClosedError."""
        if self._closed:
            return
        self._closed = True
        for t in self._subs:
            t.close()
        with self._cond:
            self._ticks += 1
            self._cond.notify_all()

    @property
    def transports(self) -> List[Transport]:
        """The distinct sub-transports (the loopback last)."""
        return list(self._subs)

    # -- shared notification ------------------------------------------------------------------------
    def _poke(self) -> None:
        bell = self._bell
        if bell is not None:
            bell.poke()
            return
        # called under a sub-transport's lock; the router condition is never held while taking one
        with self._cond:
            self._ticks += 1
            self._cond.notify_all()

    def _snapshot(self) -> int:
        bell = self._bell
        if bell is not None:
            return bell.snapshot()
        return self._ticks

    def _kick(self) -> None:
        if self._bell is not None:
            self._bell.kick()

    def wait_many(self, reqs: Sequence[Request], deadline: Optional[Deadline]) -> None:
        """Make progress on several receives at once where one sub-transport can (tcp's ``wait_many``: one
        compiled read of every socket), driving shm progress between its slices; never raises: each request's
        ``wait`` then reports its outcome (most return at once)."""
        inner: List[Request] = []
        owner: Any = None
        for q in reqs:
            r = q._inner if type(q) is _Routed else q
            if type(r) is not RecvReq:
                continue
            o = getattr(r, "owner", None)
            if o is None or getattr(o, "wait_many", None) is None or (owner is not None and o is not owner):
                continue
            owner = o
            inner.append(r)
        if owner is None or len(inner) < 2:
            return
        owner.wait_many(inner, deadline, *self._progress())

    def _progress(self) -> Tuple[Callable[[], float], Callable[[], None]]:
        """``(slice_for, between)`` for a tcp read of several sockets: how long to read before the next shm progress
        pass (:meth:`_direct_slice`, against the doorbell as of the last pass), and that pass."""
        bell = self._bell
        snap = [bell.snapshot() if bell is not None else 0]

        def between() -> None:
            self._kick()
            if bell is not None:
                snap[0] = bell.snapshot()

        return (lambda: self._direct_slice(snap[0])), between

    def phases(self, send_to: Sequence[int], recv_from: Sequence[int]) -> Optional["_RoutedPhases"]:
        """Phases of sends to ``send_to`` and receives from ``recv_from`` bound once, through the sub-transport that
        reaches every one of them (tcp's ``phases``: see ``transport._tcp_phase``), shm progress driven while it
        reads; None where no sub-transport binds them (post and wait as usual)."""
        t = self._per_peer.get(recv_from[0]) if recv_from else None
        bind = getattr(t, "phases", None)
        if t is None or bind is None or any(self._per_peer.get(p) is not t for p in (*send_to, *recv_from)):
            return None
        inner = bind(send_to, recv_from)
        return None if inner is None else _RoutedPhases(self, t, inner)

    def _direct_slice(self, snap: int) -> float:
        """How long a tcp waiter may read its socket before the next shm progress pass.

        Short while the shm side is busy (a send of ours is pending, or the doorbell moved since ``snap``):
        a local peer may wait for that progress; longer while it is quiet.
        """
        shm = self._shm
        if shm is None:
            return _SLICE
        if shm._pending_out or (self._bell is not None and self._bell.snapshot() != snap):
            return _DIRECT_BUSY
        return _DIRECT_QUIET

    def _wait_loop(self, done: Callable[[], bool], deadline: Optional[Deadline]) -> None:
        """Until ``done()`` (which must drive progress) or the deadline: sleep on the shared notification."""
        while True:
            snap = self._snapshot()
            if done():
                return
            if deadline is not None:
                rem = deadline.remaining()
                if rem <= 0:
                    return
                self._block(snap, min(_SLICE, rem))
            else:
                self._block(snap, _SLICE)

    def _block(self, snap: int, timeout: float) -> None:
        if timeout <= 0:
            return
        bell = self._bell
        if bell is not None:
            bell.sleep(snap, timeout)
            return
        with self._cond:
            if self._ticks == snap and not self._closed:
                self._cond.wait(timeout)

    def __repr__(self) -> str:
        return f"<RouterTransport rank {self.rank} of {self.world_size}: {', '.join(t.kind for t in self._subs)}>"


class _RoutedPhases:
    """A sub-transport's bound phases seen through the router: ``run`` drives shm progress between the compiled
    read's slices, and a receive or send left to wait is waited for as the router's request (shm progress too)."""

    __slots__ = ("router", "t", "inner", "end")

    def __init__(self, router: RouterTransport, t: Transport, inner: Any) -> None:
        self.router, self.t, self.inner = router, t, inner
        self.end: Callable[[], None] = inner.end

    def run(self, tag: int, sends: Sequence[Buffer], recvs: Sequence[Buffer], deadline: Any) -> Optional[List[Request]]:
        """The bound phases' ``run`` (None: nothing done, post and wait as usual)."""
        r = self.router
        if r._closed:
            self.inner.end()
            return None
        return self.inner.run(tag, sends, recvs, deadline, r._progress, self._wrap)  # type: ignore[no-any-return]

    def _wrap(self, q: Request) -> Request:
        return self.router._wrap(self.t, q)
