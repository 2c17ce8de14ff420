"""The receiving side of the TCP transport: the waiting thread reads its own socket.

Each connection has a *reading role* (``_Conn.role``, a lock taken only without blocking).  Whoever
holds it drives the connection's :class:`~procgroup.protocol.frames.FrameDecoder` (its state lives in
the connection, so the role can pass from thread to thread between any two reads) and dispatches what
it decodes: a message for its own receive, and also those for other tags or other threads (into their
posted buffers or the unexpected queue, waking their waiters).

* A thread that waits for a receive from peer P takes P's role and reads P's socket itself:
  ``recv_into(MSG_DONTWAIT)``, tried again for up to ``PROCGROUP_TCP_SPIN_US`` (500 us; ``sched_yield`` between tries,
  so a sender queued behind us on a busy CPU runs) and then ``poll`` (with the deadline as the timeout) when
  nothing is there, until its request completes.  No hand-off from another thread: the waiter is the reader,
  and a message that comes within the spin is read without a sleep and a wake-up.
* A thread that waits for several receives from distinct peers at once (:meth:`TcpReading.wait_many`, the stages
  between hosts) takes all their roles and reads every such socket in one compiled call (``_tcpwait``, optional,
  the GIL released), each message header first and straight into its buffer, never a byte past it.  Whatever it
  does not expect, and any connection that finishes before it would sleep for another, goes back to the decoder
  at the exact byte reached.
* If another thread holds the role, the waiter sleeps on the transport condition; the holder wakes it
  when it dispatches the waiter's message, or when it gives the role back (the waiter then takes it).
* One *watcher* thread per transport notices what arrives while nobody waits: an ``epoll`` set with
  every connection whose role is free, one-shot (the holder of a role disarms its socket while it
  reads; the watcher re-arms it ``_GRACE`` after the role was last given back, by a waiter or by
  itself at a message boundary; at once while a message is half read), so the watcher is
  never woken for data that a waiter reads.  Collectives called back to back read the same
  connections every few milliseconds, so a message that arrives before its receiver waits stays in
  the socket for that receiver (no wake-up of the watcher, no unexpected copy, no hand-off); the
  watcher looks at given-back connections at least every ``_IDLE`` seconds.  It drains what is ready
  without blocking: unexpected messages, the stream of a message whose receiver is not waiting yet (so
  two ranks sending large messages to each other cannot deadlock), and EOF, resets or protocol
  violations, which fail the peer (:class:`~procgroup.errors.PeerFailureError` naming its rank and
  address) whether or not anyone waits.

Bounds and authentication are unchanged: every byte goes through the decoder (lengths checked against
``max_frame_size`` before use), and connections exist only after the HMAC handshake of formation.
Abort and close write the transport's wake pipe, which every reader polls too.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..deadline import Deadline
from ..errors import ProtocolError
from ..protocol.frames import FrameDecoder, FrameStart, Message, MessageEnd
from ._engine import EngineRequest, EngineTransport, RecvReq, SendReq, Unexpected, timeout_error
from .base import ANY_SOURCE, Status

try:  # the optional compiled wait for several receives (setup.py builds it where a C compiler exists)
    from . import _tcpwait
except ImportError:  # pragma: no cover - depends on the build
    _tcpwait = None  # type: ignore[assignment]


def compiled_read() -> bool:
    """Whether the compiled read of several sockets (``_tcpwait``) was built (``TcpTransport.phases`` needs it)."""
    return _tcpwait is not None


def read_frames() -> Callable[..., int]:
    """The compiled ``read_frames`` (see ``_tcpwait.c``); only where :func:`compiled_read`."""
    assert _tcpwait is not None
    return _tcpwait.read_frames


__all__ = ["TcpReading", "compiled_read", "read_frames"]

logger = logging.getLogger("procgroup.transport")

_RBUF = 64 << 10
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_SLICE = 1.0  # longest single sleep of a reader or waiter (a safety net: every wake-up has a cause)
# a connection a waiter just read stays with the waiters this long before the watcher reads it: longer than the
# gap between back-to-back collectives (a message that arrives early is left for its receiver), short enough to
# drain a message nobody takes (two ranks blocked sending to each other) or notice EOF within tens of ms
_GRACE = 0.02
_IDLE = 0.05  # the watcher's longest sleep while connections wait for their re-arm
_HAS_EPOLL = hasattr(select, "epoll")
_sched_yield = getattr(os, "sched_yield", lambda: None)
_MAXC = 64  # connections one read_frames call takes (its MAXC)
_PROG = 5  # int64 words of read_frames' progress per connection: state, header bytes, payload bytes, length, errno
_ST_DONE, _ST_DIVERTED, _ST_EOF, _ST_ERROR = 1, 2, 3, 4  # a connection's state in it
_R_SLICE, _R_PARTIAL = 1, 3  # what read_frames returned: the slice is over; some finished while others wait
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
if _HAS_EPOLL:
    _ARMED = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
    _DISARMED = select.EPOLLONESHOT


def _frame_args(
    taken: List[Tuple["_Conn", RecvReq]],
) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[memoryview, ...]]:
    """``read_frames``' sockets, tags and buffers for ``taken`` (see :meth:`TcpReading.wait_many`)."""
    return tuple(c.fd for c, _ in taken), tuple(r.tag for _, r in taken), tuple(r.out for _, r in taken)


_noticed = False


def _notice_once() -> None:
    """One line (at INFO) the first time the compiled wait is wanted but was not built."""
    global _noticed
    if not _noticed:
        _noticed = True
        logger.info(
            "procgroup: the compiled TCP wait (_tcpwait) was not built (no C compiler at install time?); the stages "
            "between hosts read their sockets in Python (reinstall with a C compiler for it)"
        )


class _Inbound:
    """A message arriving in several pieces: its posted receive or unexpected entry, and (unexpected) its buffers."""

    __slots__ = ("target", "chunks")

    def __init__(self, target: Union[RecvReq, Unexpected], chunks: Optional[List[bytearray]]) -> None:
        self.target = target
        self.chunks = chunks


class _Conn:
    """One connection: its socket, the sending queue, and the reading state that passes with the role."""

    __slots__ = (
        "peer",
        "sock",
        "fd",
        "where",
        "send_lock",
        "send_cv",
        "queue",
        "writer",
        "broken",
        "role",
        "dec",
        "rx",
        "watch",
        "poller",
        "armed",
        "wanted",
        "dead",
        "given_at",
    )

    def __init__(self, peer: int, sock: socket.socket, where: str) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.where = where
        self.send_lock = threading.Lock()
        self.send_cv = threading.Condition(self.send_lock)
        self.queue: List[SendReq] = []
        self.writer: Optional[threading.Thread] = None
        self.broken: Optional[str] = None
        self.role = threading.Lock()  # the reading role: acquired only with blocking=False
        self.dec: Optional[FrameDecoder] = None
        self.rx: Optional[_Inbound] = None  # the message whose frames are arriving (placed with FrameStart)
        self.watch: Optional[RecvReq] = None  # its posted receive, if any: checked between reads
        self.poller: Optional["select.poll"] = None
        self.armed = False  # registered for the watcher (an optimisation hint: the role holder re-arms)
        self.wanted = 0  # threads sleeping until the role is free (under the transport lock)
        self.dead = False  # EOF / error seen: nobody reads it again
        self.given_at = 0.0  # when a waiter last gave the role back (the watcher re-arms GRACE later)


def _done(req: EngineRequest) -> bool:
    return req.status is not None or req.error is not None


class TcpReading(EngineTransport):
    """The reading half of :class:`~procgroup.transport.tcp.TcpTransport` (see the module docstring)."""

    _conns: Dict[int, _Conn]
    _cond: threading.Condition
    _inflight: Dict[int, Union[RecvReq, Unexpected]]
    _max_frame: int
    #: seconds a waiter keeps trying its socket (yielding the CPU between tries) before it sleeps in poll
    _spin: float = 0.0
    #: whether :meth:`wait_many` may use the compiled loop (``TcpOptions.native``)
    _native: bool = True

    # -- set-up and tear-down -------------------------------------------------------------------------
    def _start_reading(self) -> None:
        """After formation: decoders, pollers, the wake pipe and the watcher thread."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._by_fd: Dict[int, _Conn] = {}
        self._pending: Set[_Conn] = set()  # given back by waiters, not re-armed yet (the watcher does it)
        self._ep = select.epoll() if _HAS_EPOLL else None
        for c in self._conns.values():
            c.dec = FrameDecoder(self._max_frame, buffer_size=_RBUF)
            p = select.poll()
            p.register(c.fd, _POLLIN)
            p.register(self._wake_r, select.POLLIN)
            c.poller = p
            self._by_fd[c.fd] = c
            if self._ep is not None:
                self._ep.register(c.fd, _DISARMED)
            self._arm(c)
        if self._ep is not None:
            self._ep.register(self._wake_r, select.EPOLLIN | select.EPOLLONESHOT)
        self._watcher = threading.Thread(target=self._watch, name=f"procgroup-tcp-watch-r{self.rank}", daemon=True)
        self._watcher.start()

    def _wake_all(self) -> None:
        """Abort or close: every reader's poll returns (the pipe stays readable: both states are final)."""
        try:
            if getattr(self, "_wake_w", -1) >= 0:
                os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _stop_reading(self) -> None:
        """After the sockets were shut down: end the watcher, release the pipe and the epoll set."""
        self._wake_all()
        ep = getattr(self, "_ep", None)
        if ep is not None:
            try:  # after an abort the one-shot wake-up was spent: arm it again for the close
                ep.modify(self._wake_r, select.EPOLLIN | select.EPOLLONESHOT)
            except (OSError, ValueError):
                pass
        w = getattr(self, "_watcher", None)
        if w is not None and w is not threading.current_thread():
            w.join(2.0)
        if ep is not None:
            ep.close()
        for fd in (getattr(self, "_wake_r", -1), getattr(self, "_wake_w", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1

    # -- the role ---------------------------------------------------------------------------------------
    def _arm(self, c: _Conn) -> None:
        c.armed = True
        ep = self._ep
        if ep is not None:
            try:
                ep.modify(c.fd, _ARMED)
            except (OSError, ValueError):  # closed meanwhile
                pass

    def _take(self, c: _Conn) -> bool:
        """Take the reading role of ``c`` if it is free (never blocks); stops the watcher's interest in it."""
        if not c.role.acquire(False):
            return False
        if c.armed:
            c.armed = False
            ep = self._ep
            if ep is not None:
                try:
                    ep.modify(c.fd, _DISARMED)
                except (OSError, ValueError):
                    pass
        return True

    def _give(self, c: _Conn, rearm: bool = False) -> None:
        """Give the role back and wake the threads that wait for it.

        The watcher's interest comes back ``_GRACE`` later (at once with ``rearm``), when the watcher
        re-arms it: a waiter that reads a conversation usually comes back for the next message within
        microseconds to milliseconds, and a watcher woken meanwhile would take the message and hand it over.
        """
        c.role.release()
        if not c.dead and not self._closed:
            if rearm:
                self._arm(c)
            else:
                c.given_at = time.monotonic()
                self._pending.add(c)
        if c.wanted:
            with self._lock:
                self._cond.notify_all()

    # -- reading ------------------------------------------------------------------------------------------
    def _pump(self, c: _Conn, req: Optional[EngineRequest], deadline: Optional[Deadline]) -> None:
        """Role held: read and dispatch ``c``'s frames until ``req`` is done (None: until no byte is ready).

        Returns at the deadline, on abort or close, and when the connection ends (EOF, an ``OSError`` or a
        :class:`ProtocolError` fail the peer first).
        """
        if c.dead:
            return
        dec = c.dec
        assert dec is not None, "reading before _start_reading"
        sock, src, lock = c.sock, c.peer, self._lock
        next_event, get_buffer, buffer_updated = dec.next_event, dec.get_buffer, dec.buffer_updated
        recv_into = sock.recv_into
        reason: Optional[str] = None
        spin, spin_end = (self._spin if req is not None else 0.0), -1.0
        try:
            while True:
                ev = next_event()
                if ev is None:
                    if req is not None and (req.status is not None or req.error is not None):
                        return
                    w = c.watch
                    if w is not None and w.error is not None:
                        dec.drop_target()  # failed meanwhile (abort, close): the buffer is the user's again
                    try:
                        n = recv_into(get_buffer(), 0, _MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        if req is None or self._closed or self._aborted is not None:
                            return
                        if spin:  # try again soon, giving the CPU to whoever can run meanwhile (the sender?)
                            now = time.perf_counter()
                            if spin_end < 0:
                                spin_end = now + spin
                            if now < spin_end and (deadline is None or not deadline.expired()):
                                _sched_yield()
                                continue
                            spin = 0.0
                        t = _SLICE
                        if deadline is not None:
                            t = deadline.remaining()
                            if t <= 0:
                                return
                            t = min(t, _SLICE)
                        c.poller.poll(t * 1000.0)  # type: ignore[union-attr]  # set by _start_reading
                        continue
                    buffer_updated(n)
                    continue
                if type(ev) is Message:  # the common small message: one lock section
                    tag, payload = ev
                    n = payload.nbytes
                    with lock:
                        if self._closed:
                            return
                        r = self._match_locked(src, tag)
                        if r is not None:
                            if n > r.out.nbytes:
                                r.error = self._size_error(r, src, n)
                            else:
                                if n:
                                    r.out[:n] = payload
                                r.status = Status(src, n)
                            r.out = None  # type: ignore[assignment]  # drop the export; out is typed for live use
                        else:
                            self._add_unexpected_locked(tag, Unexpected(src, bytearray(payload), n, True))
                        if r is not req:  # our own receive: we are its only waiter, nobody to wake
                            self._notify_locked()
                    r = None
                    del payload
                elif isinstance(ev, FrameStart):
                    with lock:
                        if self._closed:
                            return
                        c.rx = rx = self._place_frame_locked(dec, src, ev, c.rx)
                    c.watch = rx.target if type(rx.target) is RecvReq else None
                elif isinstance(ev, MessageEnd):
                    cur = c.rx
                    assert cur is not None, "MessageEnd without FrameStart"
                    rx = cur
                    c.rx = c.watch = None  # keep no export of the user's buffer
                    with lock:
                        self._inflight.pop(src, None)
                        if self._closed:
                            return
                        self._finish_locked(rx, src, ev.nbytes)
                        if rx.target is not req:
                            self._notify_locked()
                    del rx
                else:  # CLOSED: EOF at a message boundary
                    reason = f"rank {src} at {c.where} closed the connection"
                    break
        except ProtocolError as e:
            if not self._closed:
                logger.error(
                    "rank %d: protocol error on the connection to rank %d at %s: %s; closing it",
                    self.rank,
                    src,
                    c.where,
                    e,
                )
            reason = f"protocol error on the connection to rank {src} at {c.where}: {e}"
        except OSError as e:
            reason = self._lost_reason(c, e)
        except (KeyboardInterrupt, SystemExit):  # raised in the waiting thread (Ctrl-C): not the connection's fault
            raise
        except BaseException as e:  # noqa: BLE001 - a reader must never die silently: fail the peer instead
            if not self._closed:
                logger.exception("rank %d: reading the connection to rank %d at %s failed", self.rank, src, c.where)
            reason = f"reading the connection to rank {src} at {c.where} failed: {e!r}"
        c.dead = True
        if not self._closed:
            self._conn_lost(c, reason)

    def _place_frame_locked(self, dec: FrameDecoder, src: int, ev: FrameStart, rx: Optional[_Inbound]) -> _Inbound:
        """Tell ``dec`` where the payload of the frame ``ev`` goes; returns the message it belongs to.

        A first frame is matched: to a posted receive (the payload goes into its buffer, at the frame's
        offset) or to a new unexpected entry (one fresh buffer per frame, joined at the end).  A frame that
        does not fit the posted buffer fails that receive with a size error and is discarded, like the
        rest of its message.  Lock held.
        """
        if ev.offset == 0:
            req = self._match_locked(src, ev.tag)
            if req is None:
                buf = bytearray(ev.length)
                entry = Unexpected(src, buf, ev.length, False)
                self._add_unexpected_locked(ev.tag, entry)
                self._inflight[src] = entry
                dec.set_target(memoryview(buf))
                return _Inbound(entry, [buf])
            rx = _Inbound(req, None)
            self._inflight[src] = req
        else:
            assert rx is not None, "continuation frame without its first frame"
            if rx.chunks is not None:
                buf = bytearray(ev.length)
                rx.chunks.append(buf)
                dec.set_target(memoryview(buf))
                return rx
        posted = rx.target
        assert isinstance(posted, RecvReq), "an unexpected message without its buffers"
        end = ev.offset + ev.length
        if posted.error is not None:
            dec.set_target(None)
        elif end > posted.out.nbytes:
            posted.error = self._size_error(posted, src, end)
            self._notify_locked()
            dec.set_target(None)
        else:
            dec.set_target(posted.out[ev.offset : end])
        return rx

    def _finish_locked(self, rx: _Inbound, src: int, nbytes: int) -> None:
        """The last frame of ``rx`` arrived: complete its receive, or mark its unexpected entry complete.  Lock held."""
        t = rx.target
        if isinstance(t, RecvReq):
            if t.error is None and t.status is None:
                t.status = Status(src, nbytes)
            t.out = None  # type: ignore[assignment]  # drop the buffer export; out is typed for live use
        else:
            if rx.chunks is not None and len(rx.chunks) > 1:
                t.buf = bytearray().join(rx.chunks)
            t.nbytes = nbytes
            self._entry_done_locked(t)

    def _watch(self) -> None:
        """The watcher thread: read, without blocking, every connection that turns readable while its role is free."""
        ep = self._ep
        try:
            while not self._closed:
                if ep is None:  # no epoll (not Linux): poll the free connections in slices
                    self._watch_slice()
                    continue
                timeout = self._rearm_due()
                try:
                    events = ep.poll(timeout)
                except InterruptedError:
                    continue
                for fd, _ in events:
                    c = self._by_fd.get(fd)
                    if c is None:  # the wake pipe: abort (not re-armed) or close (the loop ends)
                        continue
                    c.armed = False  # one-shot: the kernel disarmed it
                    if self._closed:
                        return
                    if self._take(c):
                        try:
                            self._pump(c, None, None)
                        finally:
                            # in the middle of a message: keep draining it (its sender may be blocked); at a
                            # message boundary the next one is probably for a receiver about to wait (_GRACE)
                            self._give(c, rearm=c.rx is not None)
        except (OSError, ValueError):  # the epoll set was closed under us: the transport is closing
            if not self._closed:
                logger.exception("rank %d: the tcp watcher failed", self.rank)

    def _rearm_due(self) -> float:
        """Re-arm the connections given back ``_GRACE`` ago and still free; the watcher's next timeout."""
        while True:
            now = time.monotonic()
            nxt = 0.0
            for c in list(self._pending):
                if c.dead or c.armed or c.role.locked():  # its holder puts it back when done
                    self._pending.discard(c)
                    continue
                due = c.given_at + _GRACE
                if due <= now:
                    self._pending.discard(c)
                    self._arm(c)
                elif not nxt or due < nxt:
                    nxt = due
            if nxt:
                return min(max(nxt - now, 1e-4), _IDLE)
            if not self._pending:
                return _IDLE  # a waiter may give a connection back meanwhile: look again within _IDLE

    def _watch_slice(self) -> None:
        p = select.poll()
        p.register(self._wake_r, select.POLLIN)
        for conn in self._conns.values():
            if not conn.dead and not conn.role.locked():
                p.register(conn.fd, _POLLIN)
        for fd, _ in p.poll(50.0):
            c = self._by_fd.get(fd)
            if c is None:
                if self._closed:
                    return
                continue
            if self._take(c):
                try:
                    self._pump(c, None, None)
                finally:
                    self._give(c, rearm=True)

    # -- waiting ----------------------------------------------------------------------------------------
    def _reading_conn(self, req: EngineRequest) -> Optional[_Conn]:
        """The connection a waiter for ``req`` reads itself: its peer's (the only one for ANY_SOURCE)."""
        if type(req) is not RecvReq and not isinstance(req, RecvReq):
            return None
        p = req.peer
        if p == ANY_SOURCE:
            if len(self._conns) != 1 or req.group is not None:
                return None
            return next(iter(self._conns.values()))
        return self._conns.get(p)

    def _test_req(self, req: EngineRequest) -> bool:
        if req.status is None and req.error is None:
            c = self._reading_conn(req)
            if c is not None and not c.dead and self._take(c):
                try:
                    self._pump(c, None, None)
                finally:
                    self._give(c)
        return req.status is not None or req.error is not None

    def _wait_req(self, req: EngineRequest, deadline: Optional[Deadline]) -> Status:
        c = self._reading_conn(req)
        while True:
            st = req.status
            if st is not None:
                return st
            if req.error is not None:
                raise req.error
            rem = _SLICE
            if deadline is not None:
                rem = deadline.remaining()
                if rem <= 0:
                    raise timeout_error(self.rank, req, deadline, self.kind)
            if c is not None and not c.dead and self._take(c):
                try:
                    self._pump(c, req, deadline)
                finally:
                    self._give(c)
                continue
            with self._cond:
                if req.status is not None or req.error is not None:
                    continue
                if c is not None and not c.dead:
                    c.wanted += 1
                    try:
                        if c.role.locked():  # its holder wakes us when it gives the role back
                            self._cond.wait(min(rem, _SLICE))
                    finally:
                        c.wanted -= 1
                else:
                    self._cond.wait(min(rem, _SLICE))

    def wait_many(
        self,
        reqs: Sequence[EngineRequest],
        deadline: Optional[Deadline],
        slice_for: Optional[Callable[[], float]] = None,
        between: Optional[Callable[[], None]] = None,
    ) -> None:
        """Make progress on several receives from distinct peers at once; never raises (``req.wait`` reports).

        Where the compiled wait was built (``_tcpwait``), one call reads every such socket with the GIL released:
        each receive must be the one its message would match (first posted for its tag and peer), its connection's
        role free and its decoder at a message boundary with nothing buffered; the rest is left to ``req.wait``.
        Each message is read straight into its buffer, header first, never a byte beyond it; a message that is
        not the expected one (another tag, several frames, too long), a connection that ends or fails, and the
        deadline or an abort hand the connection back to the decoder at the exact byte reached: the receive is
        posted again (or, mid-payload, placed as the decoder would have placed it) and ``req.wait`` goes on from
        there with the usual errors.  ``slice_for()``: how long to read before ``between()`` runs (the router's shm
        progress); the whole wait ends at the deadline.
        """
        if _tcpwait is None or not self._native or self._closed or self._aborted is not None:
            if _tcpwait is None and self._native:
                _notice_once()
            return
        taken = self._take_many(reqs)
        if not taken:
            return
        n = len(taken)
        hdr = bytearray(24 * n)
        prog = np.zeros(_PROG * n, np.int64)
        spin = int(self._spin * 1e9)
        fds, tags, outs = _frame_args(taken)
        try:
            while taken:
                t = _SLICE if slice_for is None else slice_for()
                if deadline is not None:
                    rem = deadline.remaining()
                    if rem <= 0:
                        break
                    t = min(t, rem)
                try:
                    code = _tcpwait.read_frames(fds, tags, outs, hdr, prog, spin, max(1, int(t * 1e9)), self._wake_r)
                except (ValueError, TypeError, BufferError, OverflowError):  # an odd buffer: req.wait does it
                    break
                spin = 0  # spun once: a later call (after a slice or a hand-back) polls at once
                if code == _R_PARTIAL:  # some finished while others wait: give those back now, go on with the rest
                    taken, hdr, prog = self._keep_pending(taken, hdr, prog)
                    fds, tags, outs = _frame_args(taken)
                    continue
                if code != _R_SLICE or self._aborted is not None or self._closed:
                    break
                if between is not None:
                    between()
        finally:
            if taken:
                self._settle_many(taken, hdr, prog.tolist())

    def _keep_pending(
        self, taken: List[Tuple[_Conn, RecvReq]], hdr: bytearray, prog: "np.ndarray"
    ) -> Tuple[List[Tuple[_Conn, RecvReq]], bytearray, "np.ndarray"]:
        """Settle (and give back) the finished connections of ``taken``; the pending ones with their progress."""
        words = prog.tolist()
        done = [i for i in range(len(taken)) if words[_PROG * i]]
        pending = [i for i in range(len(taken)) if not words[_PROG * i]]
        self._settle_many(
            [taken[i] for i in done],
            bytearray().join(hdr[24 * i : 24 * i + 24] for i in done),
            [w for i in done for w in words[_PROG * i : _PROG * i + _PROG]],
        )
        return (
            [taken[i] for i in pending],
            bytearray().join(hdr[24 * i : 24 * i + 24] for i in pending),
            np.array([w for i in pending for w in words[_PROG * i : _PROG * i + _PROG]], np.int64),
        )

    def _take_many(self, reqs: Sequence[EngineRequest]) -> List[Tuple[_Conn, RecvReq]]:
        """The receives :meth:`wait_many` reads in C, each claimed (out of ``posted``, into ``inflight``), with their
        connections' roles held."""
        cand: List[Tuple[_Conn, RecvReq]] = []
        seen: Set[int] = set()
        for req in reqs:
            if type(req) is not RecvReq or req.group is not None or _done(req) or req.peer in seen:
                continue
            c = self._conns.get(req.peer)
            if c is None or c.dead:
                continue
            dec = c.dec
            if not self._take(c):
                continue
            if dec is None or not dec.at_boundary or c.rx is not None:
                self._give(c)
                continue
            seen.add(req.peer)
            cand.append((c, req))
            if len(cand) == _MAXC:
                break
        taken: List[Tuple[_Conn, RecvReq]] = []
        with self._lock:
            for c, req in cand:
                lst = self._posted.get(req.tag)
                first = next((r for r in lst if r.peer == c.peer or r.peer == ANY_SOURCE), None) if lst else None
                if first is req and c.peer not in self._inflight and not self._closed and self._aborted is None:
                    lst.remove(req)  # type: ignore[union-attr]  # first is req: lst is a list
                    if not lst:
                        del self._posted[req.tag]
                    self._inflight[c.peer] = req
                    taken.append((c, req))
        for c, req in cand:
            if (c, req) not in taken:
                self._give(c)
        return taken

    def _settle_many(self, taken: List[Tuple[_Conn, RecvReq]], hdr: bytearray, words: List[int]) -> None:
        """After :meth:`wait_many`'s reads (``words``: read_frames' progress as a list): complete what arrived, hand
        every other connection back to its decoder."""
        lost: List[Tuple[_Conn, str]] = []
        with self._lock:  # what arrived whole, under one hold of the lock
            for i, (c, req) in enumerate(taken):
                if words[_PROG * i] == _ST_DONE:
                    self._inflight.pop(c.peer, None)
                    if req.status is None and req.error is None:
                        req.status = Status(c.peer, words[_PROG * i + 3])
                    req.out = None  # type: ignore[assignment]  # drop the export, as _finish_locked does
        for i, (c, req) in enumerate(taken):
            state, hgot, pgot, length, err = words[_PROG * i : _PROG * (i + 1)]
            src = c.peer
            if state == _ST_DONE:
                continue
            if state in (_ST_EOF, _ST_ERROR):
                c.dead = True
                what = (
                    f"rank {src} at {c.where} closed the connection"
                    if state == _ST_EOF
                    else self._lost_reason(c, OSError(err, os.strerror(err)))
                )
                if hgot or pgot:
                    what += f" inside a message ({hgot} header and {pgot} payload bytes read)"
                lost.append((c, what))
                continue
            # pending (deadline, abort) or diverted: the decoder takes over at the byte reached
            dec = c.dec
            assert dec is not None
            live = req.status is None and req.error is None
            partial = state != _ST_DIVERTED and hgot == 24 and pgot > 0  # inside its payload
            try:
                with self._lock:
                    self._inflight.pop(src, None)
                    if live or partial:  # it was the first match: it stays the first (failed: placed to discard)
                        self._posted.setdefault(req.tag, []).insert(0, req)
                    else:  # failed meanwhile (abort, peer failure): nothing will complete it
                        req.out = None  # type: ignore[assignment]  # drop the export
                if hgot:
                    dec.get_buffer()[:hgot] = hdr[24 * i : 24 * i + hgot]
                    dec.buffer_updated(hgot)
                if partial:  # placed as _pump places a frame (a failed receive discards the rest)
                    ev = dec.next_event()
                    assert isinstance(ev, FrameStart), ev
                    with self._lock:
                        c.rx = rx = self._place_frame_locked(dec, src, ev, None)
                    c.watch = rx.target if type(rx.target) is RecvReq else None
                    dec.buffer_updated(pgot)  # already in the target's first pgot bytes (or discarded)
            except ProtocolError as e:  # a diverted header that is garbage: as _pump reports it
                c.dead = True
                lost.append((c, f"protocol error on the connection to rank {src} at {c.where}: {e}"))
        for c, _ in taken:
            self._give(c)
        for c, what in lost:
            self._conn_lost(c, what)

    def _wait_slice(self, req: EngineRequest, timeout: float) -> None:
        """Wait for ``req`` at most ``timeout`` seconds, reading its socket if we can; never raises for time.

        For a caller that must do other work between slices (the router drives shm progress).
        """
        from ..deadline import as_deadline

        try:
            self._wait_req(req, as_deadline(timeout))
        except Exception:  # noqa: BLE001 - the caller's req.wait() reports the outcome
            pass

    # -- failures -----------------------------------------------------------------------------------------
    def _lost_reason(self, c: _Conn, e: Optional[BaseException]) -> str:
        return f"the connection to rank {c.peer} at {c.where} failed ({e})"

    def _conn_lost(self, c: _Conn, reason: str) -> None:
        with self._lock:
            if c.peer not in self._failed and not self._closed:
                self._fail_peer_locked(c.peer, reason)

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        for fn in self._hooks:
            fn()
