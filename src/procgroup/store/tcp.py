"""TCPStore: the client of a :class:`~procgroup.store.StoreServer` (thread-safe, one connection)."""

from __future__ import annotations

import math
import random
import socket
import threading
import time
from typing import Optional, Sequence, TypeVar, Union

from ..config import DEFAULT_TIMEOUT, ENV
from ..deadline import Deadline
from ..errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    ConfigError,
    ConnectError,
    DistTimeoutError,
    ProtocolError,
    StoreError,
    StoreTimeoutError,
)
from ..netutil import format_hostport, resolve
from ..protocol import store_codec as sc
from ..protocol.auth import client_handshake
from ..protocol.store_codec import CLOSED, NEED_DATA, NO_TIMEOUT, StoreCodec
from .base import KeyList, Store, Timeoutish, _key, _keys, _seconds, _value, _with_missing, log

__all__ = ["TCPStore"]

_R = TypeVar("_R")
_RECV = 65536

_WAIT_GRACE = 2.0  # client-side slack beyond the server-side WAIT timeout
_HANDSHAKE_MAX = 60.0
_BACKOFF_MAX = 1.0
#: While the store's host answers "connection refused" (it is up, but nothing listens on the port yet:
#: the usual start-up race, rank 0 still importing), retry at least this often for the first
#: ``_REFUSED_FAST_S`` seconds, so a client finds the store within ~25 ms of it opening instead of after a
#: doubled backoff (up to a second).  A refusal costs a round trip and no work on the server; after the
#: window the normal backoff bounds the retries of a store that is not coming soon.
_REFUSED_BACKOFF_MAX = 0.025
_REFUSED_FAST_S = 10.0


def _oserror_str(e: BaseException) -> str:
    s = getattr(e, "strerror", None)
    if s:
        return str(s)
    if isinstance(e, TimeoutError):  # socket.timeout
        return "timed out"
    return str(e) or type(e).__name__


def _ms(deadline: Deadline) -> int:
    rem = deadline.remaining()
    if rem == math.inf:
        return NO_TIMEOUT
    return min(NO_TIMEOUT - 1, int(math.ceil(rem * 1000)))


def _peer_name(addr: object) -> str:
    """A socket address as ``host:port`` (IPv6 in brackets), as :class:`~procgroup.store.StoreServer` names peers."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return format_hostport(str(addr[0]), int(addr[1]))
    return str(addr)


class TCPStore(Store):
    """Client of a :class:`StoreServer`.

    Connects (retrying with backoff until ``connect_timeout``, default
    ``timeout``; quickly while the host refuses, i.e. the store is about to
    open) and proves the job secret.  One connection, guarded by a
    lock, so it is safe to share between threads (requests are serialised:
    a thread blocked in ``wait`` holds the connection).  Blocking calls
    (``get``, ``wait``, ``multi_get``) are parked on the server with the
    remaining timeout; the client's own socket deadline is a little longer,
    and if even that passes the connection is closed (so a late reply cannot
    be mistaken for the answer to a later request) and re-opened on next use.
    If the server goes away mid-request, :class:`BrokenError` names it and
    every later call fails the same way.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: Union[bytes, str],
        timeout: object = DEFAULT_TIMEOUT,
        connect_timeout: object = None,
    ) -> None:
        super().__init__(timeout)
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise ConfigError(f"store port {port!r} is not a number; set MASTER_PORT to a port number") from None
        if not 0 < port < 65536:
            raise ConfigError(f"store port {port} is out of range 1-65535; set MASTER_PORT to a valid port")
        if secret is None:
            raise ConfigError(f"TCPStore needs the job secret (secret=...; set {ENV.SECRET})")
        self.host = host
        self.port = port
        self._hp = format_hostport(host, port)
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.connect_timeout = self.timeout if connect_timeout is None else _seconds(connect_timeout)
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._codec: Optional[StoreCodec] = None
        self._closed = False
        self._lost: Optional[str] = None
        with self._lock:
            self._connect(Deadline.after(self.connect_timeout))

    def __repr__(self) -> str:
        return f"TCPStore({self._hp})"

    def _where(self) -> str:
        return f"the store at {self._hp}"

    @property
    def local_address(self) -> Optional[str]:
        """``host:port`` of this end of the connection (what the server's ``peers()`` lists); None when closed."""
        s = self._sock
        try:
            return _peer_name(s.getsockname()) if s is not None else None
        except OSError:
            return None

    # -- connection ------------------------------------------------------------------

    def _connect(self, deadline: Deadline) -> None:
        attempts = 0
        addrs: list[str] = []
        last = "no attempt made"
        delay = 0.02
        while True:
            try:
                addrs = resolve(self.host, self.port)
            except ConfigError as e:
                last = str(e)
                addrs_now: list[str] = []
            else:
                addrs_now = addrs
            refused_only = bool(addrs_now)  # every attempt of this round: "connection refused"
            for addr in addrs_now:
                attempts += 1
                fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
                s = socket.socket(fam, socket.SOCK_STREAM)
                try:
                    rem = deadline.remaining()
                    s.settimeout(max(0.05, min(rem, 30.0)))
                    s.connect((addr, self.port))
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError as e:
                    s.close()
                    last = f"{format_hostport(addr, self.port)}: {_oserror_str(e)}"
                    refused_only = refused_only and isinstance(e, ConnectionRefusedError)
                    continue
                refused_only = False
                try:
                    client_handshake(s, self._secret, deadline.sooner(_HANDSHAKE_MAX))
                except AuthenticationError as e:
                    s.close()
                    raise AuthenticationError(f"authenticating to the store at {self._hp}: {e}") from None
                except (BrokenError, DistTimeoutError, OSError) as e:
                    s.close()
                    last = f"{format_hostport(addr, self.port)}: connected, but the handshake failed: {e}"
                    continue
                s.settimeout(None)
                self._sock = s
                self._codec = StoreCodec("client")
                if attempts > 1:
                    log.debug("connected to the store at %s after %d attempts", self._hp, attempts)
                return
            rem = deadline.remaining()
            if rem <= 0:
                break
            wait = delay
            if refused_only and deadline.elapsed() < _REFUSED_FAST_S:
                wait = min(wait, _REFUSED_BACKOFF_MAX)
            time.sleep(min(rem, wait * random.uniform(0.75, 1.25)))
            delay = min(delay * 2, _BACKOFF_MAX)
        resolved = ", ".join(addrs) if addrs else "did not resolve"
        raise ConnectError(
            f"could not connect to the store at {self._hp} (resolved to: {resolved}): "
            f"{attempts} attempt{'s' if attempts != 1 else ''} in {deadline.elapsed():.2f}s, "
            f"last error: {last}. Is rank 0 / the launcher running? Is {ENV.MASTER_ADDR} reachable from "
            f"this host ({socket.gethostname()})? Set {ENV.MASTER_ADDR}/{ENV.MASTER_PORT} to the store's "
            f"address, or raise {ENV.TIMEOUT} to wait longer"
        )

    def _drop(self) -> None:
        s, self._sock, self._codec = self._sock, None, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass

    def _call(self, req: object, what: str, deadline: Optional[Deadline] = None, grace: float = 0.0) -> object:
        """Send one request and return its response event (not ERROR)."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"{what}: this TCPStore ({self._hp}) was closed")
            if self._lost is not None:
                raise BrokenError(f"{what}: {self._lost}")
            if self._sock is None:
                self._connect(Deadline.after(self.connect_timeout))
            sock, codec = self._sock, self._codec
            assert sock is not None and codec is not None
            frame = codec.send(req)  # ConfigError for oversize input: nothing was sent
            dl = deadline if deadline is not None else Deadline.after(self.timeout)
            sock_dl = dl if grace == 0 or dl.at == math.inf else Deadline(dl.at + grace, dl.start)
            try:
                rem = sock_dl.remaining()
                sock.settimeout(None if rem == math.inf else max(rem, 0.001))
                sock.sendall(frame)
                while True:
                    ev = codec.next_event()
                    if ev is not NEED_DATA:
                        break
                    rem = sock_dl.remaining()
                    if rem <= 0:
                        raise socket.timeout()
                    sock.settimeout(None if rem == math.inf else rem)
                    codec.receive_data(sock.recv(_RECV))
            except socket.timeout:
                self._drop()
                err = StoreTimeoutError(
                    f"{what}: no reply from the store at {self._hp} within {sock_dl.elapsed():.2f}s; "
                    f"the connection was reset and will be re-opened on next use; pass a larger timeout= or "
                    f"set {ENV.TIMEOUT}"
                )
                raise _with_missing(err, req.keys if isinstance(req, sc.Wait) else ()) from None
            except ProtocolError as e:
                self._drop()
                self._lost = f"the store at {self._hp} broke the protocol ({e})"
                raise ProtocolError(f"{what}: the store at {self._hp} sent a malformed reply: {e}") from None
            except OSError as e:
                self._drop()
                self._lost = (
                    f"the connection to the store at {self._hp} was lost ({_oserror_str(e)}); "
                    "did rank 0 / the launcher exit?"
                )
                raise BrokenError(f"{what}: {self._lost}") from None
            if ev is CLOSED:
                self._drop()
                self._lost = f"the store at {self._hp} closed the connection; did rank 0 / the launcher exit?"
                raise BrokenError(f"{what}: {self._lost}")
        if isinstance(ev, sc.Error):
            raise StoreError(f"{what}: the store at {self._hp} answered: {ev.message}")
        return ev

    def _expect(self, ev: object, *types: type[_R]) -> _R:
        """``ev`` if it is one of ``types``; otherwise the connection is dropped for good (ProtocolError)."""
        if not isinstance(ev, types):
            with self._lock:
                self._drop()
                self._lost = f"the store at {self._hp} sent an unexpected {type(ev).__name__} reply"
            raise ProtocolError(self._lost)
        return ev

    def _wait_keys(self, what: str, keys: tuple[str, ...], missing: tuple[str, ...], deadline: Deadline) -> None:
        """Park on the server until ``missing`` exist; raise StoreTimeoutError listing the rest."""
        if deadline.expired():
            raise self._timeout_error(what, keys, missing, deadline)
        r = self._expect(self._call(sc.Wait(missing, _ms(deadline)), what, deadline, _WAIT_GRACE), sc.Ok, sc.Timeout)
        if isinstance(r, sc.Timeout):
            raise self._timeout_error(what, keys, r.missing, deadline)

    # -- the interface -----------------------------------------------------------------

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Store ``value`` under ``key`` on the server (which wakes its waiters)."""
        k = _key(key)
        self._expect(self._call(sc.Set(k, _value(value)), f"set({k!r})"), sc.Ok)

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        """The value of ``key``, parked on the server until it exists (StoreTimeoutError at the deadline)."""
        k = _key(key)
        what = f"get({k!r})"
        deadline = self._deadline(timeout)
        while True:
            r = self._expect(self._call(sc.Get(k), what), sc.Value, sc.Timeout)
            if isinstance(r, sc.Value):
                return r.value
            self._wait_keys(what, (k,), (k,), deadline)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` on the server; the new value.

        StoreError if the key holds something else or the result overflows a signed 64-bit integer.
        """
        k = _key(key)
        r = self._expect(self._call(sc.Add(k, int(amount)), f"add({k!r}, {amount})"), sc.Int)
        return r.value

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """torch's compare_set, atomic on the server; returns the value after the op."""
        k = _key(key)
        r = self._expect(
            self._call(sc.CompareSet(k, _value(expected), _value(desired)), f"compare_set({k!r})"), sc.Value
        )
        return r.value

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        """Park on the server until every key exists; StoreTimeoutError (``.missing``) at the deadline."""
        ks = _keys(keys)
        self._wait_keys("wait", ks, ks, self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        """True if every key exists on the server right now (never blocks)."""
        r = self._expect(self._call(sc.Check(_keys(keys)), "check"), sc.Bool)
        return r.value

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        """The values of ``keys``, parked on the server until all exist."""
        ks = _keys(keys)
        deadline = self._deadline(timeout)
        while True:
            r = self._expect(self._call(sc.MultiGet(ks), "multi_get"), sc.Values, sc.Timeout)
            if isinstance(r, sc.Values):
                if len(r.values) != len(ks):
                    with self._lock:
                        self._drop()
                        self._lost = f"the store at {self._hp} answered multi_get with the wrong number of values"
                    raise ProtocolError(self._lost)
                return list(r.values)
            assert isinstance(r, sc.Timeout)
            self._wait_keys("multi_get", ks, r.missing, deadline)

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        """Set several keys atomically on the server; ConfigError if the counts differ."""
        ks, vs = _keys(keys), tuple(_value(v) for v in values)
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        self._expect(self._call(sc.MultiSet(ks, vs), "multi_set"), sc.Ok)

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` on the server; True if it existed."""
        k = _key(key)
        r = self._expect(self._call(sc.DeleteKey(k), f"delete_key({k!r})"), sc.Bool)
        return r.value

    def num_keys(self) -> int:
        """Number of keys on the server."""
        r = self._expect(self._call(sc.NumKeys(), "num_keys"), sc.Int)
        return r.value

    def ping(self) -> None:
        """One round trip to the server (raises if it is gone)."""
        self._expect(self._call(sc.Ping(), "ping"), sc.Ok)

    def close(self) -> None:
        """Close the connection; later calls raise ClosedError.  Idempotent."""
        with self._lock:
            self._closed = True
            self._drop()

    def __del__(self) -> None:  # pragma: no cover - best effort
        s = getattr(self, "_sock", None)
        if s is not None:
            try:
                s.close()
            except OSError:
                pass
