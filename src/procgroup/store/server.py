"""StoreServer: the TCP store server, an I/O shell around the store's sans-IO cores.

One thread, one ``selectors`` loop, non-blocking sockets.  Each connection is
a small state machine (HMAC handshake, then the sans-IO
:class:`~procgroup.protocol.store_codec.StoreCodec`); every decoded request
is applied to the one :class:`~procgroup.protocol.store_state.StoreState`.
Blocking WAITs come back from it as :class:`~procgroup.protocol.store_state.Park`
data: the server parks the connection, counts its keys off as writes wake
them, and answers when none is left or its timer fires, so thousands of
waiting clients cost no threads.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import resource
import selectors
import socket
import threading
import time
from typing import Optional, Union, cast

from ..config import ENV, store_auth_timeout
from ..errors import AuthenticationError, ClosedError, ConfigError, ProtocolError, StoreError
from ..netutil import bind_listener, format_hostport
from ..protocol import store_codec as sc
from ..protocol.auth import MAC_LEN, REPLY_LEN, ServerHandshake, describe_secret
from ..protocol.store_codec import CLOSED, NEED_DATA, StoreCodec
from ..protocol.store_state import Park, StoreState, timeout_reply
from .base import log

__all__ = ["StoreServer"]

_FAIL = bytes(MAC_LEN)  # the handshake's "rejected" message
# ---------------------------------------------------------------- StoreServer

_AUTH, _READY, _LINGER, _DEAD = range(4)
_RECV = 65536
_OUT_HIGH = 1 << 20  # stop parsing requests while this much output is unsent
_READ_PAUSE = 1 << 20  # stop reading from a connection that is parked with this much input buffered
_LINGER_S = 2.0  # after refusing a client, how long we drain its input so it reads our reply
_LINGER_MAX = 1 << 20
#: connections that have not authenticated may hold at most this share of the open-files limit; beyond it
#: (or when accept() finds no descriptor left) the oldest of them are closed to make room
_UNAUTH_SHARE = 4
_UNAUTH_MIN = 16


def _unauth_cap() -> int:
    """Most unauthenticated connections kept open at once: a quarter of RLIMIT_NOFILE's soft limit (>= 16)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1 << 30
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1 << 30
    return max(_UNAUTH_MIN, int(soft) // _UNAUTH_SHARE)


def _peer_str(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return format_hostport(str(addr[0]), int(addr[1]))
    return str(addr)


class _Waiter:
    __slots__ = ("conn", "keys", "missing", "done")

    def __init__(self, conn: "_Conn", keys: tuple[str, ...], missing: set[str]) -> None:
        self.conn = conn
        self.keys = keys
        self.missing = missing
        self.done = False


class _Conn:
    __slots__ = ("sock", "peer", "state", "hs", "authbuf", "codec", "out", "waiter", "mask", "shut", "drained", "eof")

    def __init__(self, sock: socket.socket, peer: str, hs: ServerHandshake) -> None:
        self.sock = sock
        self.peer = peer
        self.state = _AUTH
        self.hs: Optional[ServerHandshake] = hs
        self.authbuf = bytearray()
        self.codec: Optional[StoreCodec] = None
        self.out = bytearray()
        self.waiter: Optional[_Waiter] = None
        self.mask = 0
        self.shut = False
        self.drained = 0
        self.eof = False  # the peer half-closed; stop reading


_TimerObj = Union[_Conn, _Waiter, None]  # what a timer acts on: a connection, a parked wait, or nothing


class StoreServer:
    """The TCP store server: one background thread multiplexing every client.

    ``StoreServer(host, port, secret=...)``; :meth:`start` binds (``port=0``
    picks a free port), starts the daemon thread and returns the port;
    :meth:`close` stops it and closes every socket.  Each accepted connection
    must pass the HMAC challenge of :mod:`procgroup.protocol.auth` within
    ``auth_timeout`` seconds (default ``PROCGROUP_STORE_AUTH_TIMEOUT``, 5 s) before any request is
    served.  Connections still authenticating may hold at most a quarter of the open-files limit, and
    when ``accept`` runs out of descriptors the oldest of them are closed first, so idle strangers
    cannot keep genuine clients out.  A client that
    fails it, sends malformed frames or an oversize length header is answered
    (the handshake's failure message or an ERROR frame) and disconnected; the
    refusal is logged at WARNING with its address.  Everyone else is unaffected.

    ``sock`` serves on an already bound and listening socket (e.g. one the
    launcher reserved with :func:`~procgroup.netutil.bind_listener`) instead
    of binding ``host:port``; the server owns and closes it.
    """

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        secret: Union[bytes, str],
        auth_timeout: Optional[float] = None,
        backlog: int = 4096,
        sock: Optional[socket.socket] = None,
    ) -> None:
        if secret is None:
            raise ConfigError(f"StoreServer needs the job secret (secret=...; see {ENV.SECRET})")
        self.host = host
        self._requested_port = int(port)
        self._port: Optional[int] = None
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.auth_timeout = float(auth_timeout) if auth_timeout is not None else store_auth_timeout()
        #: connections still in the handshake, oldest first (dicts keep insertion order)
        self._unauth: dict[int, _Conn] = {}
        self._unauth_cap = _unauth_cap()
        self._evicted = 0
        self._last_evict_log = 0.0
        self._backlog = backlog
        self._lsock: Optional[socket.socket] = sock
        self._sel: Optional[selectors.BaseSelector] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._closed = False
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._conns: dict[int, _Conn] = {}
        self._state = StoreState()
        self._waiting: dict[str, set[_Waiter]] = {}
        self._timers: list[tuple[float, int, int, _TimerObj]] = []
        self._seq = itertools.count()
        self._resume: list[_Conn] = []
        self._accept_paused = False
        self._last_emfile_log = 0.0
        self._start_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the requested one before :meth:`start`)."""
        if self._port is not None:
            return self._port
        if self._lsock is not None and self._lsock.fileno() != -1:
            return int(self._lsock.getsockname()[1])
        return self._requested_port

    @property
    def num_connections(self) -> int:
        """Open client connections (authenticated or not)."""
        return len(self._conns)

    def peers(self) -> set[str]:
        """``host:port`` of every open client connection, as the clients' own ``local_address`` names it
        (the launcher's node 0 finds a killed agent by its connection closing).  Safe from any thread."""
        return {c.peer for c in list(self._conns.values()) if c.state != _DEAD}

    def start(self) -> int:
        """Bind (unless given a socket), start the serving thread, return the port."""
        with self._start_lock:
            if self._closed:
                raise ClosedError("StoreServer was closed")
            if self._thread is not None:
                return self.port
            if self._lsock is None:
                self._lsock = bind_listener(self.host, self._requested_port, self._backlog)
            self._lsock.setblocking(False)
            self._sel = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel.register(self._lsock, selectors.EVENT_READ, "listener")
            self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            port = self._port = int(self._lsock.getsockname()[1])
            self._thread = threading.Thread(target=self._run, name=f"procgroup-store-server:{port}", daemon=True)
            self._thread.start()
            log.debug("store server listening on %s", format_hostport(self.host, port))
            return port

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close every socket (idempotent)."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            t = self._thread
        if t is not None:
            self._wakeup()
            if t is not threading.current_thread():
                t.join(timeout)
                if t.is_alive():
                    log.warning("store server thread did not stop within %.1fs", timeout)
        else:
            if self._lsock is not None:
                self._lsock.close()

    def __enter__(self) -> "StoreServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wakeup(self) -> None:
        w = self._wake_w
        if w is not None:
            try:
                w.send(b"x")
            except OSError:
                pass

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stop:
                events = sel.select(self._select_timeout())
                for key, mask in events:
                    data = key.data
                    if data == "listener":
                        self._accept()
                    elif data == "wake":
                        try:
                            while self._wake_r is not None and self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._on_event(data, mask)
                self._run_timers()
                self._drain_resume()
        except Exception:  # pragma: no cover - a bug; make it loud
            log.exception("store server on port %d crashed; clients will see the connection drop", self.port)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            self._close_conn(conn)
        for s in (self._lsock, self._wake_r, self._wake_w):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        if self._sel is not None:
            self._sel.close()
        self._waiting.clear()
        self._timers.clear()

    def _select_timeout(self) -> Optional[float]:
        if self._resume:
            return 0.0
        if not self._timers:
            return None
        return max(0.0, self._timers[0][0] - time.monotonic())

    def _on_event(self, conn: _Conn, mask: int) -> None:
        try:
            if conn.state == _DEAD:
                return
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
                if conn.state == _READY:
                    self._process(conn)
            if mask & selectors.EVENT_READ and conn.state != _DEAD:
                self._on_readable(conn)
        except Exception:  # pragma: no cover - a bug in one connection must not stop the server
            log.exception("store server: internal error on the connection from %s; dropping it", conn.peer)
            self._close_conn(conn)

    # -- timers -------------------------------------------------------------------------

    _T_AUTH, _T_LINGER, _T_WAIT, _T_ACCEPT = range(4)

    def _add_timer(self, when: float, kind: int, obj: _TimerObj) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), kind, obj))
        if len(self._timers) > 1024 and len(self._timers) > 4 * (len(self._conns) + 1):
            self._timers = [t for t in self._timers if self._timer_live(t[2], t[3])]
            heapq.heapify(self._timers)

    def _timer_live(self, kind: int, obj: _TimerObj) -> bool:
        if kind == self._T_AUTH:
            return isinstance(obj, _Conn) and obj.state == _AUTH
        if kind == self._T_LINGER:
            return isinstance(obj, _Conn) and obj.state == _LINGER
        if kind == self._T_WAIT:
            return isinstance(obj, _Waiter) and not obj.done
        return True

    def _run_timers(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, obj = heapq.heappop(timers)
            if not self._timer_live(kind, obj):
                continue
            if kind == self._T_AUTH and isinstance(obj, _Conn):
                log.warning(
                    "store server: refused %s: no handshake within %.1fs (not a procgroup client?)",
                    obj.peer,
                    self.auth_timeout,
                )
                self._close_conn(obj)
            elif kind == self._T_LINGER and isinstance(obj, _Conn):
                self._close_conn(obj)
            elif kind == self._T_WAIT and isinstance(obj, _Waiter):
                self._finish_wait(obj, timeout_reply(obj.keys, obj.missing))
            elif kind == self._T_ACCEPT:
                self._resume_accept()

    # -- accepting ----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._lsock is not None and self._sel is not None
        for _ in range(512):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if e.errno in (errno.EMFILE, errno.ENFILE) and self._evict_unauth(1, "no file descriptor left"):
                        continue  # one descriptor freed: accept the waiting client with it
                    now = time.monotonic()
                    if now - self._last_emfile_log > 10:
                        self._last_emfile_log = now
                        log.warning(
                            "store server: cannot accept more connections (%s) with %d open; "
                            "raise the open-files limit (ulimit -n)",
                            e.strerror,
                            len(self._conns),
                        )
                    self._sel.unregister(self._lsock)
                    self._accept_paused = True
                    self._add_timer(now + 0.1, self._T_ACCEPT, None)
                    return
                continue  # ECONNABORTED and friends: that client is gone
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, _peer_str(addr), ServerHandshake(self._secret))
            self._conns[sock.fileno()] = conn
            self._unauth[id(conn)] = conn
            if len(self._unauth) > self._unauth_cap:
                self._evict_unauth(len(self._unauth) - self._unauth_cap, "too many connections still authenticating")
            self._add_timer(time.monotonic() + self.auth_timeout, self._T_AUTH, conn)
            assert conn.hs is not None
            self._write(conn, conn.hs.hello())
            self._update_interest(conn)

    def _evict_unauth(self, n: int, why: str) -> int:
        """Close up to ``n`` connections that have not authenticated, oldest first; how many were closed."""
        victims = list(itertools.islice(self._unauth.values(), n))
        for conn in victims:
            self._close_conn(conn)
        self._evicted += len(victims)
        now = time.monotonic()
        if victims and now - self._last_evict_log > 10:
            self._last_evict_log = now
            log.warning(
                "store server: %s; closed %d connection(s) that had not proven the job secret, oldest first "
                "(%d so far; %d open; each has %.1fs to authenticate: %s)",
                why,
                len(victims),
                self._evicted,
                len(self._conns),
                self.auth_timeout,
                ENV.STORE_AUTH_TIMEOUT,
            )
        return len(victims)

    def _resume_accept(self) -> None:
        if self._accept_paused and self._sel is not None and self._lsock is not None:
            self._accept_paused = False
            self._sel.register(self._lsock, selectors.EVENT_READ, "listener")

    # -- per-connection I/O ---------------------------------------------------------------

    def _update_interest(self, conn: _Conn) -> None:
        if conn.state == _DEAD or self._sel is None:
            return
        reading = not conn.eof
        if reading and conn.state == _READY and (conn.waiter is not None or len(conn.out) >= _OUT_HIGH):
            assert conn.codec is not None
            reading = conn.codec.buffered < _READ_PAUSE
        mask = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if conn.out else 0)
        if mask == conn.mask:
            return
        if conn.mask == 0:
            self._sel.register(conn.sock, mask, conn)
        elif mask == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, mask, conn)
        conn.mask = mask

    def _write(self, conn: _Conn, data: bytes) -> None:
        conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                log.debug("store server: %s went away while we wrote to it: %s", conn.peer, e)
                self._close_conn(conn)
                return
            del conn.out[:n]
        if not conn.out and conn.state == _LINGER and not conn.shut:
            conn.shut = True
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close_conn(conn)
                return
        self._update_interest(conn)

    def _close_conn(self, conn: _Conn) -> None:
        if conn.state == _DEAD:
            return
        conn.state = _DEAD
        self._unauth.pop(id(conn), None)
        if conn.waiter is not None:
            self._cancel_wait(conn.waiter)
            conn.waiter = None
        if conn.mask and self._sel is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.mask = 0
        try:
            fd = conn.sock.fileno()
            if self._conns.get(fd) is conn:
                del self._conns[fd]
        except OSError:
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.out = bytearray()

    def _refuse(self, conn: _Conn, reply: bytes) -> None:
        """Send ``reply``, then half-close and drain the peer for a moment so it can read it."""
        conn.state = _LINGER
        self._unauth.pop(id(conn), None)
        if conn.waiter is not None:
            self._cancel_wait(conn.waiter)
            conn.waiter = None
        conn.codec = None
        conn.out.clear()
        self._add_timer(time.monotonic() + _LINGER_S, self._T_LINGER, conn)
        self._write(conn, reply)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("store server: connection from %s lost: %s", conn.peer, e)
            self._close_conn(conn)
            return
        if conn.state == _LINGER:
            conn.drained += len(data)
            if not data or conn.drained > _LINGER_MAX:
                self._close_conn(conn)
            return
        if conn.state == _AUTH:
            if not data:
                if conn.authbuf:
                    log.warning(
                        "store server: refused %s: it closed the connection in the middle of the handshake",
                        conn.peer,
                    )
                else:
                    log.debug("store server: %s connected and closed without a handshake", conn.peer)
                self._close_conn(conn)
                return
            conn.authbuf += data
            if len(conn.authbuf) < REPLY_LEN:
                return
            reply, rest = bytes(conn.authbuf[:REPLY_LEN]), bytes(conn.authbuf[REPLY_LEN:])
            assert conn.hs is not None
            try:
                final = conn.hs.check(reply)
            except AuthenticationError as e:
                log.warning(
                    "store server: refused %s: client failed authentication (%s); secrets differ: this side uses "
                    "%s (every rank must use the same %s or secret file)",
                    conn.peer,
                    e,
                    describe_secret(self._secret),
                    ENV.SECRET,
                )
                self._refuse(conn, _FAIL)
                return
            conn.state = _READY
            self._unauth.pop(id(conn), None)
            conn.hs = None
            conn.authbuf = bytearray()
            conn.codec = StoreCodec("server")
            self._write(conn, final)
            if conn.state != _READY:
                return
            data = rest
            if not data:
                return
        assert conn.codec is not None
        if not data:
            if conn.waiter is not None:
                log.debug("store server: %s closed while waiting", conn.peer)
                self._close_conn(conn)
                return
            conn.eof = True  # answer what is buffered, then _process sees CLOSED
        conn.codec.receive_data(data)
        self._process(conn)
        if conn.state == _READY:
            self._update_interest(conn)

    def _process(self, conn: _Conn) -> None:
        """Answer the requests buffered on ``conn``, one at a time, until it must wait."""
        codec = conn.codec
        while conn.state == _READY and conn.waiter is None and len(conn.out) < _OUT_HIGH:
            assert codec is not None
            try:
                ev = codec.next_event()
            except ProtocolError as e:
                log.warning("store server: dropped %s: protocol error: %s", conn.peer, e)
                self._refuse(conn, sc.encode(sc.Error(f"protocol error: {e}")))
                return
            if ev is NEED_DATA:
                break
            if ev is CLOSED:
                log.debug("store server: %s disconnected", conn.peer)
                self._close_conn(conn)
                return
            try:
                resp = self._handle(conn, cast(sc.Request, ev))  # a server codec only yields requests
            except StoreError as e:  # pragma: no cover - the state machine answers Error replies instead
                resp = sc.Error(str(e))
            if resp is None:  # parked
                break
            try:
                frame = codec.send(resp)
            except ConfigError as e:  # e.g. a MULTI_GET reply over the frame limit
                frame = codec.send(sc.Error(f"reply too large: {e}"))
            self._write(conn, frame)
        if conn.state == _READY:
            self._update_interest(conn)

    def _drain_resume(self) -> None:
        while self._resume:
            batch, self._resume = self._resume, []
            for conn in batch:
                if conn.state == _READY:
                    self._process(conn)

    # -- the key-value state ----------------------------------------------------------------

    def _notify(self, key: str) -> None:
        ws = self._waiting.pop(key, None)
        if not ws:
            return
        for w in ws:
            if w.done:
                continue
            w.missing.discard(key)
            if not w.missing:
                self._finish_wait(w, sc.Ok())

    def _cancel_wait(self, w: _Waiter) -> None:
        w.done = True
        for k in w.missing:
            s = self._waiting.get(k)
            if s is not None:
                s.discard(w)
                if not s:
                    del self._waiting[k]

    def _finish_wait(self, w: _Waiter, resp: sc.Response) -> None:
        self._cancel_wait(w)
        conn = w.conn
        if conn.waiter is not w or conn.state != _READY:
            return
        conn.waiter = None
        assert conn.codec is not None
        self._write(conn, conn.codec.send(resp))
        self._resume.append(conn)

    def _handle(self, conn: _Conn, ev: sc.Request) -> Optional[sc.Response]:
        """Apply one request to the state machine; its reply, or None when ``conn`` was parked.

        Writes wake the waiters of their keys; a :class:`~procgroup.protocol.store_state.Park` reply
        parks ``conn`` (no more of its requests are read) until its keys are set or its deadline.
        """
        out = self._state.apply(ev, time.monotonic())
        for k in out.wake:
            self._notify(k)
        reply = out.reply
        if not isinstance(reply, Park):
            return reply
        w = _Waiter(conn, reply.keys, set(reply.missing))
        for k in reply.missing:
            self._waiting.setdefault(k, set()).add(w)
        conn.waiter = w
        if reply.deadline is not None:
            self._add_timer(reply.deadline, self._T_WAIT, w)
        return None
