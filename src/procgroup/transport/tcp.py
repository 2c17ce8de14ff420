"""TCP transport: one authenticated connection per pair of ranks.

Formation (collective over the ``peers``):

1. every rank that a lower rank will dial listens on its advertised address
   (port 0) and publishes ``{"host", "port", "pid"}`` under
   ``<prefix>/addr/<rank>``;
2. each rank dials every *higher* peer, runs the HMAC handshake with the job
   secret (:func:`~procgroup.protocol.auth.client_handshake`), then
   identifies itself: ``b"PGTC" version(u16) 0(u16) client_rank(u32)
   server_rank(u32) world_size(u32)``; the server answers one byte (1 = ok);
3. an acceptor thread authenticates incoming connections
   (:func:`~procgroup.protocol.auth.server_handshake`), drops any that fail
   (the listener keeps accepting) and registers the rest by rank; once every
   lower peer is connected the listener is closed.

Data: frames of :mod:`procgroup.protocol.frames`.  A send goes out in the
caller's thread as one ``sendmsg([header, payload])`` (no concatenation);
whatever the socket does not take at once is finished by a per-connection
writer thread, so ``isend`` never blocks and ``wait(deadline)`` is honoured.
Receiving (:mod:`procgroup.transport._tcp_read`): the thread that waits for a
message reads its peer's socket itself, through the sans-IO
:class:`~procgroup.protocol.frames.FrameDecoder` (payloads straight into the
posted buffer); one watcher thread per transport drains the connections
nobody is reading, so two ranks sending large messages to each other cannot
deadlock and EOF, a reset or a protocol violation is noticed at once: it
fails every pending and later request that involves the peer with
:class:`~procgroup.errors.PeerFailureError` naming its rank and address.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from ..config import TcpOptions
from ..deadline import as_deadline
from ..errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    ConfigError,
    ConnectError,
    DistTimeoutError,
    PeerFailureError,
    ProtocolError,
)
from ..protocol.auth import client_handshake, recv_exact, server_handshake
from ..protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    message_frames,
)
from . import _tcp_read
from ._engine import RecvReq, SendReq, Unexpected
from ._engine import delete_key_quiet as _delete_key
from ._tcp_phase import TcpPhases
from ._tcp_read import _MAXC, TcpReading, _Conn
from .base import CompletedRequest, Request, Status

__all__ = ["TcpTransport"]

logger = logging.getLogger("procgroup.transport")

_IDENT = struct.Struct("<4sHHIII")
_IDENT_MAGIC = b"PGTC"
_IDENT_VERSION = 1
_ACK_OK, _ACK_REJECT = b"\x01", b"\x02"
_HANDSHAKE_TIMEOUT = 10.0
_MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Outgoing:
    """What the writer thread still has to send of one queued message: its header and payload parts."""

    __slots__ = ("parts", "done")

    def __init__(self, parts: List[Union[bytes, memoryview]], done: int) -> None:
        self.parts = parts
        self.done = done  # bytes of the concatenation already handed to the kernel


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class TcpTransport(TcpReading):
    """Transport over TCP connections to ``peers`` (see the module docstring).

    Collective: every rank of ``peers + [rank]`` constructs it with the same
    store, ``prefix`` and secret.
    """

    kind = "tcp"

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        peers: Sequence[int],
        secret: bytes,
        advertise_addr: str = "127.0.0.1",
        deadline: Any = None,
        prefix: str = "transport/tcp",
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        options: Optional[TcpOptions] = None,
    ) -> None:
        super().__init__(rank, world_size, peers)
        if max_frame_size < 1:
            raise ConfigError(f"max_frame_size={max_frame_size} must be >= 1")
        self._cond = threading.Condition(self._lock)
        self._secret = secret
        self._max_frame = max_frame_size
        opts = options or TcpOptions()
        self._spin = opts.spin_us * 1e-6  # see TcpReading._pump
        self._native = opts.native  # TcpReading.wait_many's compiled loop, where built
        self._deadline = as_deadline(deadline)
        self._conns: Dict[int, _Conn] = {}
        self._inflight: Dict[int, Union[RecvReq, Unexpected]] = {}  # per peer: the message being received
        self._listener: Optional[socket.socket] = None
        self._form_cv = threading.Condition()
        self._stop_accept = False
        self._addr = advertise_addr
        try:
            self._form(store, prefix, advertise_addr)
        except BaseException:
            self._shutdown_sockets()
            raise
        self._start_reading()

    # -- formation --------------------------------------------------------------------------
    def _form(self, store: Any, prefix: str, advertise: str) -> None:
        me = self.rank
        peers = sorted(self._peers)
        lower = [p for p in peers if p < me]
        higher = [p for p in peers if p > me]
        acceptor = None
        if lower:
            self._listener = self._listen(advertise)
            port = self._listener.getsockname()[1]
            store.set(f"{prefix}/addr/{me}", json.dumps({"host": advertise, "port": port, "pid": os.getpid()}).encode())
            acceptor = threading.Thread(
                target=self._accept_loop, args=(set(lower),), name=f"procgroup-tcp-accept-r{me}", daemon=True
            )
            acceptor.start()
        try:
            for p in higher:
                self._dial(store, prefix, p)
            with self._form_cv:
                while not all(p in self._conns for p in lower):
                    rem = self._deadline.remaining()
                    if rem <= 0:
                        missing = [p for p in lower if p not in self._conns]
                        raise DistTimeoutError(
                            f"rank {me}: tcp transport setup: ranks {missing} did not connect within "
                            f"{self._deadline.elapsed():.2f}s (listening on {self._listen_where}); are they alive, "
                            "and can they reach this address? (set PROCGROUP_SOCKET_ADDR / PROCGROUP_SOCKET_IFNAME)"
                        )
                    self._form_cv.wait(min(rem, 0.5))
            if lower:
                _delete_key(store, f"{prefix}/addr/{me}")  # every rank that needed it has connected
        finally:
            self._stop_accept = True
            if self._listener is not None:
                try:
                    self._listener.close()
                except OSError:
                    pass
            if acceptor is not None:
                acceptor.join(2.0)

    def _listen(self, advertise: str) -> socket.socket:
        from ..netutil import bind_listener

        try:
            ls = bind_listener(advertise, 0)
        except ConfigError as e:  # the advertised address is not local (NAT, container): listen everywhere
            logger.debug("rank %d: cannot listen on %s (%s); listening on all interfaces", self.rank, advertise, e)
            ls = bind_listener("::" if ":" in advertise.strip("[]") else "0.0.0.0", 0)
        self._listen_where = _fmt(advertise, ls.getsockname()[1])
        return ls

    def _accept_loop(self, expected: Set[int]) -> None:
        ls = self._listener
        assert ls is not None
        ls.settimeout(0.1)
        while not self._stop_accept:
            try:
                s, addr = ls.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(s, addr, expected), daemon=True, name=f"procgroup-tcp-auth-r{self.rank}"
            ).start()

    def _serve(self, s: socket.socket, addr: Any, expected: Set[int]) -> None:
        who = _fmt(str(addr[0]), int(addr[1])) if isinstance(addr, tuple) else str(addr)
        try:
            dl = self._deadline.sooner(_HANDSHAKE_TIMEOUT)
            server_handshake(s, self._secret, dl)
            magic, ver, _r, client, server, ws = _IDENT.unpack(recv_exact(s, _IDENT.size, dl, "rank identification"))
            if magic != _IDENT_MAGIC or ver != _IDENT_VERSION:
                raise ProtocolError(f"bad identification magic/version {magic!r}/{ver}")
            with self._form_cv:
                ok = (
                    server == self.rank
                    and ws == self.world_size
                    and client in expected
                    and client not in self._conns
                    and not self._stop_accept
                )
                if not ok:
                    raise ProtocolError(
                        f"connection claims to be rank {client} of {ws} dialing rank {server}; this is rank "
                        f"{self.rank} of {self.world_size} expecting ranks {sorted(expected)} "
                        f"({'already connected' if client in self._conns else 'unexpected'})"
                    )
                s.settimeout(None)
                s.sendall(_ACK_OK)
                _tune(s)
                self._conns[client] = _Conn(client, s, who)
                self._form_cv.notify_all()
        except (AuthenticationError, ProtocolError, BrokenError, DistTimeoutError, OSError) as e:
            logger.warning("rank %d: dropped an incoming connection from %s: %s", self.rank, who, e)
            try:
                if isinstance(e, ProtocolError):
                    s.sendall(_ACK_REJECT)
            except OSError:
                pass
            s.close()

    def _dial(self, store: Any, prefix: str, peer: int) -> None:
        dl = self._deadline
        try:
            raw = store.get(f"{prefix}/addr/{peer}", timeout=dl.remaining_or_none())
        except (DistTimeoutError, TimeoutError) as e:
            raise DistTimeoutError(
                f"rank {self.rank}: tcp transport setup: rank {peer} did not publish its address within "
                f"{dl.elapsed():.2f}s; did every rank call init_process_group?"
            ) from e
        info = json.loads(raw)
        host, port = str(info["host"]), int(info["port"])
        where = _fmt(host, port)
        delay = 0.01
        last: Optional[BaseException] = None
        while True:
            rem = dl.remaining()
            if rem <= 0:
                raise ConnectError(
                    f"rank {self.rank}: could not connect to rank {peer} at {where} within {dl.elapsed():.2f}s"
                    + (f" ({last})" if last else "")
                    + "; check that this address is reachable from here (set PROCGROUP_SOCKET_ADDR or "
                    "PROCGROUP_SOCKET_IFNAME on rank " + str(peer) + ")"
                )
            try:
                s = socket.create_connection((host, port), timeout=min(rem, _HANDSHAKE_TIMEOUT))
            except OSError as e:
                last = e
                time.sleep(min(delay, max(0.0, dl.remaining())))
                delay = min(delay * 2, 0.5)
                continue
            break
        try:
            hdl = dl.sooner(_HANDSHAKE_TIMEOUT)
            client_handshake(s, self._secret, hdl)
            s.sendall(_IDENT.pack(_IDENT_MAGIC, _IDENT_VERSION, 0, self.rank, peer, self.world_size))
            ack = recv_exact(s, 1, hdl, "connection acknowledgement")
            if ack != _ACK_OK:
                raise ProtocolError(
                    f"rank {peer} at {where} refused our connection as rank {self.rank} "
                    f"(its log says why: duplicate rank or a different world size?)"
                )
            s.settimeout(None)
            _tune(s)
        except AuthenticationError as e:
            s.close()
            raise AuthenticationError(f"rank {self.rank} connecting to rank {peer} at {where}: {e}") from e
        except BrokenError as e:
            s.close()
            raise PeerFailureError(
                f"rank {self.rank}: rank {peer} at {where} dropped the connection during setup: {e}", peer=peer
            ) from e
        except BaseException:
            s.close()
            raise
        with self._form_cv:
            self._conns[peer] = _Conn(peer, s, where)

    # -- one phase of a stage between hosts -----------------------------------------------------
    def phases(self, send_to: Sequence[int], recv_from: Sequence[int]) -> Optional[TcpPhases]:
        """Phases of sends to ``send_to`` and receives from ``recv_from`` (distinct ranks each) bound once: see
        :mod:`._tcp_phase`.  None where a rank is not a connected peer or the compiled read was not built (or
        ``PROCGROUP_NATIVE=0``), or more receives than one compiled read takes: post and wait as usual."""
        if not _tcp_read.compiled_read() or not self._native or len(recv_from) > _MAXC:
            return None
        if len(set(recv_from)) != len(recv_from) or any(p not in self._conns for p in (*send_to, *recv_from)):
            return None
        return TcpPhases(self, send_to, recv_from)

    # -- sending -------------------------------------------------------------------------------
    def _send_remote(self, dst: int, tag: int, view: memoryview) -> Request:
        return self._send_now(self._conns[dst], tag, view) or CompletedRequest(Status(dst, view.nbytes))

    def _send_now(self, c: _Conn, tag: int, view: memoryview) -> Optional[Request]:
        """Send one message to ``c``'s peer: None where the kernel took all of it at once (``MSG_DONTWAIT``), else
        the request the writer thread finishes; raises PeerFailureError where the connection is lost."""
        n = view.nbytes
        if n > self._max_frame:
            return self._send_multi(c, tag, view)
        hdr = HEADER.pack(MAGIC, VERSION, 0, 0, tag, n)
        err: Optional[OSError] = None
        with c.send_lock:
            if c.broken is not None:
                raise PeerFailureError(
                    f"rank {self.rank}: send to rank {c.peer} (tag {tag}) failed: {c.broken}", peer=c.peer
                )
            sent = 0
            if not c.queue:
                try:
                    sent = c.sock.sendmsg((hdr, view) if n else (hdr,), (), _MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as e:
                    err = e
                if err is None and sent == HEADER_SIZE + n:
                    return None
            if err is None:
                req = SendReq(self, c.peer, tag, view)
                req.extra = _Outgoing([hdr, view], sent)
                self._enqueue(c, req)
                return req
        reason = self._lost_reason(c, err)
        self._conn_lost(c, reason)
        raise PeerFailureError(f"rank {self.rank}: send to rank {c.peer} (tag {tag}) failed: {reason}", peer=c.peer)

    def _send_multi(self, c: _Conn, tag: int, view: memoryview) -> Request:
        parts: List[Union[bytes, memoryview]] = []
        for hdr, off, k in message_frames(tag, view.nbytes, self._max_frame):
            parts.append(hdr)
            parts.append(view[off : off + k])
        req = SendReq(self, c.peer, tag, view)
        req.extra = _Outgoing(parts, 0)
        with c.send_lock:
            if c.broken is not None:
                raise PeerFailureError(
                    f"rank {self.rank}: send to rank {c.peer} (tag {tag}) failed: {c.broken}", peer=c.peer
                )
            self._enqueue(c, req)
        return req

    def _enqueue(self, c: _Conn, req: SendReq) -> None:
        """Queue for the writer thread; c.send_lock held."""
        c.queue.append(req)
        if c.writer is None:
            c.writer = threading.Thread(
                target=self._writer, args=(c,), daemon=True, name=f"procgroup-tcp-w{self.rank}->{c.peer}"
            )
            c.writer.start()
        else:
            c.send_cv.notify()

    def _writer(self, c: _Conn) -> None:
        while True:
            with c.send_lock:
                while not c.queue and c.broken is None and not self._closed:
                    c.send_cv.wait()
                if not c.queue:
                    return
                req = c.queue[0]
                stop = c.broken is not None or self._closed
            if stop:
                self._fail_queue(c, c.broken or "the transport was closed")
                return
            out = req.extra
            assert isinstance(out, _Outgoing), "a queued send without its frames"
            try:
                self._send_parts(c.sock, out.parts, out.done)
            except BaseException as e:  # noqa: BLE001 - OSError usually; never die silently
                if not self._closed and not isinstance(e, OSError):
                    logger.exception("rank %d: writer to rank %d failed", self.rank, c.peer)
                reason = self._lost_reason(c, e)
                if not self._closed:
                    self._conn_lost(c, reason)
                self._fail_queue(c, c.broken or reason)
                return
            # every byte is in the kernel: the send succeeded, even if the peer closes right now
            with c.send_lock:
                if c.queue and c.queue[0] is req:
                    c.queue.pop(0)
            req.extra = None  # keep no export of the caller's buffer once complete
            req.view = None  # type: ignore[assignment]  # same; view is typed for the request's live use
            del out
            with self._lock:
                if req.error is None:
                    req.status = Status(c.peer, req.nbytes)
                self._notify_locked()

    def _fail_queue(self, c: _Conn, reason: str) -> None:
        """The writer gives up: every send still queued on ``c`` fails."""
        with self._lock:
            with c.send_lock:
                for s in c.queue:
                    if s.status is None and s.error is None:
                        s.error = (
                            ClosedError(f"rank {self.rank}: the tcp transport was closed while this send was pending")
                            if self._closed
                            else self._peer_error(s, c.peer, reason)
                        )
                    s.extra = None
                    s.view = None  # type: ignore[assignment]  # drop the buffer export; view is typed for live use
                c.queue.clear()
            self._notify_locked()

    @staticmethod
    def _send_parts(sock: socket.socket, parts: List[Union[bytes, memoryview]], done: int) -> None:
        """Blocking: send the concatenation of ``parts`` from byte ``done`` on."""
        i = 0
        while i < len(parts) and done >= len(parts[i]):
            done -= len(parts[i])
            i += 1
        while i < len(parts):
            first = memoryview(parts[i])[done:] if done else parts[i]
            iov = [first] + list(parts[i + 1 : i + 4])
            k = sock.sendmsg(iov)
            done += k
            while i < len(parts) and done >= len(parts[i]):
                done -= len(parts[i])
                i += 1

    # -- failures -----------------------------------------------------------------------------------
    def _fail_peer_locked(self, peer: int, reason: str) -> None:
        target = self._inflight.pop(peer, None)
        if target is not None:
            if isinstance(target, RecvReq):
                if target.status is None and target.error is None:
                    target.error = self._peer_error(target, peer, reason)
            else:
                w = target.waiter
                err = self._peer_error(w, peer, reason) if w else PeerFailureError(reason, peer=peer)
                self._fail_entry_locked(target, err)
        c = self._conns.get(peer)
        if c is not None:
            with c.send_lock:
                c.broken = reason
                # the head of the queue may be fully handed to the kernel already: its writer decides
                keep = 1 if c.writer is not None and c.queue else 0
                for s in c.queue[keep:]:
                    if s.error is None and s.status is None:
                        s.error = self._peer_error(s, peer, reason)
                del c.queue[keep:]
                c.send_cv.notify_all()
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        super()._fail_peer_locked(peer, reason)

    # -- closing ----------------------------------------------------------------------------------------
    def _fail_inflight_locked(self, err: BaseException) -> None:
        for target in self._inflight.values():
            if isinstance(target, RecvReq):
                if target.status is None and target.error is None:
                    target.error = err
            elif target.waiter is not None:
                target.waiter.error = err
                target.waiter = None
        for c in self._conns.values():
            with c.send_lock:
                for s in c.queue:
                    if s.error is None and s.status is None:
                        s.error = err
                # the writer finishes the frame it is sending (the stream stays well framed); drop the rest
                del c.queue[1 if c.writer is not None and c.queue else 0 :]
                c.send_cv.notify_all()
        self._wake_all()  # readers polling their sockets see the abort (or close) at once

    def _shutdown_sockets(self) -> None:
        self._stop_accept = True
        for c in list(self._conns.values()):
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        me = threading.current_thread()
        for c in list(self._conns.values()):
            if c.writer is not None and c.writer is not me:
                c.writer.join(2.0)
        self._stop_reading()
        for c in list(self._conns.values()):
            try:
                c.sock.close()
            except OSError:
                pass

    def _after_close(self) -> None:
        self._shutdown_sockets()

    def __repr__(self) -> str:
        return f"<TcpTransport rank {self.rank} peers {sorted(self._peers)}{' closed' if self._closed else ''}>"
