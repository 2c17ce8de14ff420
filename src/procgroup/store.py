"""The rendezvous key-value store: torch.distributed's ``Store`` family without torch.

* :class:`Store` -- the interface (``set``/``get``/``add``/``compare_set``/
  ``wait``/``check``/``multi_get``/``multi_set``/``delete_key``/``num_keys``).
  ``get``, ``wait`` and ``multi_get`` block until the keys exist or the
  deadline passes (:class:`~procgroup.errors.StoreTimeoutError`, whose
  ``missing`` attribute lists the keys that never appeared).
* :class:`StoreServer` -- one thread, one ``selectors`` loop, non-blocking
  sockets; each connection is a small state machine (HMAC handshake, then the
  sans-IO :class:`~procgroup.protocol.store_codec.StoreCodec`).  Blocking
  WAITs are parked in the server and answered when their keys are set or
  their timeout expires, so thousands of waiting clients cost no threads.
* :class:`TCPStore` -- the client; thread-safe, one connection.
* :class:`FileStore` -- a log-structured file shared by processes on one host
  (or a shared filesystem), serialised with ``fcntl`` locks.
* :class:`HashStore` -- in-process, for tests with ranks as threads.
* :class:`PrefixStore` -- a namespace (``prefix/key``) over another store.

Keys are ``str``; values are ``bytes`` (a ``str`` value is UTF-8 encoded).
``add`` keeps its counter as ASCII decimal, as torch does.
"""

from __future__ import annotations

import abc
import errno
import fcntl
import heapq
import itertools
import logging
import math
import os
import random
import re
import selectors
import socket
import struct
import threading
import time
from typing import Iterable, Optional, Sequence, Union

from .config import DEFAULT_TIMEOUT, ENV
from .deadline import Deadline, as_deadline
from .errors import (
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
from .netutil import bind_listener, format_hostport, resolve
from .protocol import store_codec as sc
from .protocol.auth import MAC_LEN, REPLY_LEN, ServerHandshake, client_handshake
from .protocol.store_codec import CLOSED, NEED_DATA, NO_TIMEOUT, StoreCodec

__all__ = ["Store", "StoreServer", "TCPStore", "FileStore", "HashStore", "PrefixStore"]

log = logging.getLogger("procgroup.store")

KeyList = Union[str, Iterable[str]]
Timeoutish = Union[None, float, Deadline]  # also datetime.timedelta

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_INT_RE = re.compile(rb"-?[0-9]+")
_FAIL = bytes(MAC_LEN)  # the handshake's "rejected" message


# ---------------------------------------------------------------- helpers


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}: {key!r}")
    return key


def _keys(keys: KeyList) -> tuple[str, ...]:
    if isinstance(keys, str):
        return (keys,)
    return tuple(_key(k) for k in keys)


def _value(value: Union[bytes, bytearray, memoryview, str]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values are bytes or str, got {type(value).__name__}")


def _seconds(timeout: object) -> Optional[float]:
    if timeout is None:
        return None
    if hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()  # type: ignore[union-attr]
    t = float(timeout)  # type: ignore[arg-type]
    if not t >= 0:
        raise ConfigError(f"store timeout must be >= 0 seconds, got {timeout!r}")
    return t


def _parse_counter(key: str, cur: Optional[bytes]) -> int:
    if cur is None:
        return 0
    if not _INT_RE.fullmatch(cur):
        raise StoreError(f"add({key!r}): the key holds {cur[:40]!r}, which is not a decimal integer")
    return int(cur)


def _fmt_keys(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += f", ... ({len(keys) - limit} more)"
    return "[" + shown + "]"


def _compare_set(cur: Optional[bytes], expected: bytes, desired: bytes) -> tuple[Optional[bytes], bytes]:
    """torch's compare_set: (new stored value or None to leave absent, reply)."""
    if cur is None:
        if expected == b"":
            return desired, desired
        return None, expected  # torch replies `expected` for an absent key
    if cur == expected:
        return desired, desired
    return cur, cur


class Store(abc.ABC):
    """The key-value store interface (torch.distributed.Store-shaped).

    ``timeout`` (seconds, or None for "forever") is the default deadline of
    the blocking calls; every blocking call also takes ``timeout=`` (seconds,
    ``datetime.timedelta`` or a :class:`~procgroup.deadline.Deadline`).
    """

    timeout: Optional[float]

    def __init__(self, timeout: object = DEFAULT_TIMEOUT) -> None:
        self.timeout = _seconds(timeout)

    # -- the interface --------------------------------------------------------

    @abc.abstractmethod
    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Store ``value`` under ``key`` and wake everyone waiting for it."""

    @abc.abstractmethod
    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        """The value of ``key``, blocking until it exists (StoreTimeoutError at the deadline)."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (absent = 0); returns the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected`` is empty).

        Returns the value after the operation (torch semantics: for an absent
        key and a non-empty ``expected``, returns ``expected`` and sets nothing).
        """

    @abc.abstractmethod
    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        """Block until every key exists; StoreTimeoutError (``.missing``) at the deadline."""

    @abc.abstractmethod
    def check(self, keys: KeyList) -> bool:
        """True if every key exists right now (never blocks)."""

    @abc.abstractmethod
    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        """The values of ``keys``, blocking until all exist."""

    @abc.abstractmethod
    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        """Set several keys at once (atomically on the TCP and in-process stores)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Number of keys in the store."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; later calls raise ClosedError.  Idempotent."""

    # -- conveniences -----------------------------------------------------------

    def set_timeout(self, timeout: object) -> None:
        """torch compatibility: change the default deadline (seconds or timedelta)."""
        self.timeout = _seconds(timeout)

    def _deadline(self, timeout: Timeoutish) -> Deadline:
        return as_deadline(self.timeout if timeout is None else timeout)

    def _where(self) -> str:
        return type(self).__name__

    def _timeout_error(self, op: str, keys: Sequence[str], missing: Sequence[str], deadline: Deadline) -> StoreTimeoutError:
        total = deadline.timeout
        what = f"key {missing[0]!r} was never set" if len(missing) == 1 else (
            f"{len(missing)} of {len(keys)} keys were never set: {_fmt_keys(list(missing))}"
        )
        err = StoreTimeoutError(
            f"{op} on {self._where()} timed out after {deadline.elapsed():.2f}s"
            + (f" (timeout {total:.2f}s)" if total is not None else "")
            + f": {what}; the process that should set "
            + ("it" if len(missing) == 1 else "them")
            + " may have failed or not started yet; pass a larger timeout= or set "
            f"{ENV.TIMEOUT} to wait longer"
        )
        err.missing = list(missing)  # type: ignore[attr-defined]
        return err

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- HashStore


class HashStore(Store):
    """In-process store for ranks running as threads (a dict and a condition variable)."""

    def __init__(self, timeout: object = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._where()} was closed")

    def _wait_locked(self, op: str, keys: tuple[str, ...], deadline: Deadline) -> None:
        while True:
            self._check_open()
            missing = [k for k in dict.fromkeys(keys) if k not in self._data]
            if not missing:
                return
            rem = deadline.remaining()
            if rem <= 0:
                raise self._timeout_error(op, keys, missing, deadline)
            self._cond.wait(None if rem == math.inf else rem)

    def set(self, key: str, value: Union[bytes, str]) -> None:
        k, v = _key(key), _value(value)
        with self._cond:
            self._check_open()
            self._data[k] = v
            self._cond.notify_all()

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        k = _key(key)
        with self._cond:
            self._wait_locked(f"get({k!r})", (k,), self._deadline(timeout))
            return self._data[k]

    def add(self, key: str, amount: int) -> int:
        k = _key(key)
        with self._cond:
            self._check_open()
            n = _parse_counter(k, self._data.get(k)) + int(amount)
            if not _I64_MIN <= n <= _I64_MAX:
                raise StoreError(f"add({k!r}, {amount}) overflows a signed 64-bit counter")
            self._data[k] = str(n).encode()
            self._cond.notify_all()
            return n

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        k = _key(key)
        with self._cond:
            self._check_open()
            new, reply = _compare_set(self._data.get(k), _value(expected), _value(desired))
            if new is not None:
                self._data[k] = new
                self._cond.notify_all()
            return reply

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        ks = _keys(keys)
        with self._cond:
            self._wait_locked("wait", ks, self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        ks = _keys(keys)
        with self._cond:
            self._check_open()
            return all(k in self._data for k in ks)

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        ks = _keys(keys)
        with self._cond:
            self._wait_locked("multi_get", ks, self._deadline(timeout))
            return [self._data[k] for k in ks]

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        ks, vs = _keys(keys), [_value(v) for v in values]
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        with self._cond:
            self._check_open()
            self._data.update(zip(ks, vs))
            self._cond.notify_all()

    def delete_key(self, key: str) -> bool:
        k = _key(key)
        with self._cond:
            self._check_open()
            return self._data.pop(k, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            self._check_open()
            return len(self._data)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# ---------------------------------------------------------------- PrefixStore


class PrefixStore(Store):
    """Keys of ``store`` under ``prefix + "/"``; ``num_keys`` counts the whole underlying store
    (as in torch).  ``close()`` does not close the underlying store, which its creator owns."""

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a Store, got {type(store).__name__}")
        self.prefix = str(prefix)
        self.underlying_store = store
        self._closed = False

    @property  # type: ignore[override]
    def timeout(self) -> Optional[float]:
        return self.underlying_store.timeout

    @timeout.setter
    def timeout(self, value: object) -> None:
        self.underlying_store.timeout = _seconds(value)

    def _k(self, key: str) -> str:
        if self._closed:
            raise ClosedError(f"PrefixStore({self.prefix!r}) was closed")
        return f"{self.prefix}/{_key(key)}"

    def _ks(self, keys: KeyList) -> list[str]:
        return [self._k(k) for k in _keys(keys)]

    def _unprefix(self, e: StoreTimeoutError) -> StoreTimeoutError:
        """The same error in the caller's namespace (keys without our prefix)."""
        p = self.prefix + "/"
        missing = list(getattr(e, "missing", None) or ())
        msg = str(e)
        for m in missing:
            if m.startswith(p):
                msg = msg.replace(repr(m), repr(m[len(p):]))
        out = StoreTimeoutError(f"{msg} [keys of PrefixStore {self.prefix!r}]")
        out.missing = [m[len(p):] if m.startswith(p) else m for m in missing]  # type: ignore[attr-defined]
        out.__traceback__ = e.__traceback__
        return out

    def _where(self) -> str:
        return f"PrefixStore({self.prefix!r}) over {self.underlying_store._where()}"

    def set(self, key: str, value: Union[bytes, str]) -> None:
        self.underlying_store.set(self._k(key), value)

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        try:
            return self.underlying_store.get(self._k(key), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        return self.underlying_store.compare_set(self._k(key), expected, desired)

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        try:
            self.underlying_store.wait(self._ks(keys), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def check(self, keys: KeyList) -> bool:
        return self.underlying_store.check(self._ks(keys))

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        try:
            return self.underlying_store.multi_get(self._ks(keys), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        self.underlying_store.multi_set(self._ks(keys), values)

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        if self._closed:
            raise ClosedError(f"PrefixStore({self.prefix!r}) was closed")
        return self.underlying_store.num_keys()

    def close(self) -> None:
        self._closed = True


# ---------------------------------------------------------------- FileStore

_FS_MAGIC = b"PGFSTORE1\n"
_FS_SET, _FS_DEL = 0x53, 0x44  # 'S', 'D'
_FS_HDR = struct.Struct(">BI")  # op, key length
_FS_LEN = struct.Struct(">I")
_path_locks: dict[tuple[int, int], threading.Lock] = {}
_path_locks_guard = threading.Lock()


class FileStore(Store):
    """A store in one file, shared by every process that opens the same path.

    Layout: the magic line ``PGFSTORE1\\n`` followed by append-only records
    ``op:u8 ('S' set | 'D' delete) | key_len:u32 | key | [value_len:u32 | value]``.
    Each process replays the records it has not seen yet into a local dict.
    Writers append under an exclusive ``fcntl.lockf`` lock, readers read under
    a shared one (POSIX locks also work on NFS, so ``file://`` on a shared
    filesystem works across hosts).  Blocking calls poll with backoff
    (1 ms doubling to 10 ms) until their deadline.

    The file is never deleted by the store: use a fresh path per job (a stale
    file from an earlier job would hand out its old keys).
    """

    def __init__(self, path: str, timeout: object = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        p = str(path)
        if p.startswith("file://"):
            p = p[len("file://"):]
        if not p:
            raise ConfigError("FileStore needs a path (init_method='file:///path/to/file')")
        self.path = os.path.abspath(p)
        try:
            self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConfigError(
                f"cannot open the FileStore file {self.path}: {e.strerror}; "
                "check that the directory exists and is writable (init_method=file://...)"
            ) from e
        st = os.fstat(self._fd)
        with _path_locks_guard:
            self._plock = _path_locks.setdefault((st.st_dev, st.st_ino), threading.Lock())
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._closed = False
        with self._locked(exclusive=True):
            size = os.fstat(self._fd).st_size
            if size == 0:
                self._write_all(_FS_MAGIC)
            else:
                head = os.pread(self._fd, len(_FS_MAGIC), 0)
                if head != _FS_MAGIC[: len(head)] or (len(head) < len(_FS_MAGIC) and size > len(head)):
                    os.close(self._fd)
                    self._fd = None
                    raise ConfigError(
                        f"{self.path} exists and is not a procgroup FileStore; remove it or choose another path "
                        "(init_method=file://...)"
                    )
                if len(head) < len(_FS_MAGIC):  # a creator died mid-magic
                    os.ftruncate(self._fd, 0)
                    self._write_all(_FS_MAGIC)
            self._offset = len(_FS_MAGIC)
            self._refresh_locked(repair=True)

    def _where(self) -> str:
        return f"FileStore {self.path}"

    # -- locking and the log ------------------------------------------------------

    class _Lock:
        def __init__(self, store: "FileStore", exclusive: bool) -> None:
            self.store, self.exclusive = store, exclusive

        def __enter__(self) -> None:
            s = self.store
            s._plock.acquire()
            try:
                if s._closed or s._fd is None:
                    raise ClosedError(f"{s._where()} was closed")
                fcntl.lockf(s._fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
            except BaseException:
                s._plock.release()
                raise

        def __exit__(self, *exc: object) -> None:
            s = self.store
            try:
                if s._fd is not None:
                    fcntl.lockf(s._fd, fcntl.LOCK_UN)
            finally:
                s._plock.release()

    def _locked(self, exclusive: bool) -> "FileStore._Lock":
        return FileStore._Lock(self, exclusive)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def _refresh_locked(self, repair: bool = False) -> None:
        """Replay records appended since our last look (caller holds the lock)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos, n = 0, len(data)
        while pos + _FS_HDR.size <= n:
            op, klen = _FS_HDR.unpack_from(data, pos)
            if op not in (_FS_SET, _FS_DEL) or klen > sc.MAX_KEY_LEN:
                raise StoreError(
                    f"{self._where()} is corrupt at byte {self._offset + pos}; "
                    "remove the file and restart the job with a fresh init_method=file://... path"
                )
            end = pos + _FS_HDR.size + klen
            if end > n:
                break
            key = data[pos + _FS_HDR.size:end].decode("utf-8", "replace")
            if op == _FS_DEL:
                self._data.pop(key, None)
                pos = end
                continue
            if end + 4 > n:
                break
            (vlen,) = _FS_LEN.unpack_from(data, end)
            if end + 4 + vlen > n:
                break
            self._data[key] = data[end + 4:end + 4 + vlen]
            pos = end + 4 + vlen
        self._offset += pos
        if pos < n and repair:
            # Under the exclusive lock a partial tail can only be a writer that died mid-append.
            log.warning("%s: discarding a partial record of %d bytes (a writer died mid-write)", self._where(), n - pos)
            os.ftruncate(self._fd, self._offset)

    def _append(self, records: Sequence[tuple[int, str, Optional[bytes]]]) -> None:
        parts = []
        for op, key, value in records:
            kb = key.encode("utf-8")
            if len(kb) > sc.MAX_KEY_LEN:
                raise ConfigError(f"store key of {len(kb)} bytes exceeds the {sc.MAX_KEY_LEN}-byte limit")
            parts.append(_FS_HDR.pack(op, len(kb)) + kb)
            if value is not None:
                parts.append(_FS_LEN.pack(len(value)) + value)
        data = b"".join(parts)
        self._write_all(data)
        self._offset += len(data)
        for op, key, value in records:  # our own records are not re-read: apply them here
            if op == _FS_SET:
                assert value is not None
                self._data[key] = value
            else:
                self._data.pop(key, None)

    def _update(self, fn):  # type: ignore[no-untyped-def]
        with self._locked(exclusive=True):
            self._refresh_locked(repair=True)
            return fn()

    def _poll(self, op: str, keys: tuple[str, ...], deadline: Deadline) -> dict[str, bytes]:
        delay = 0.001
        seen = -1
        missing: list[str] = []
        while True:
            fd = self._fd
            try:
                size = os.fstat(fd).st_size if fd is not None else -2
            except OSError:
                size = -2  # closed under us: the locked path raises ClosedError
            if size != seen:  # only re-read (under the lock) when the file grew
                with self._locked(exclusive=False):
                    self._refresh_locked()
                    seen = self._offset
                    missing = [k for k in dict.fromkeys(keys) if k not in self._data]
                    if not missing:
                        return {k: self._data[k] for k in keys}
            rem = deadline.remaining()
            if rem <= 0:
                raise self._timeout_error(op, keys, missing, deadline)
            time.sleep(min(delay, rem))
            delay = min(delay * 2, 0.01)

    # -- the interface ------------------------------------------------------------

    def set(self, key: str, value: Union[bytes, str]) -> None:
        k, v = _key(key), _value(value)
        self._update(lambda: self._append([(_FS_SET, k, v)]))

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        k = _key(key)
        return self._poll(f"get({k!r})", (k,), self._deadline(timeout))[k]

    def add(self, key: str, amount: int) -> int:
        k = _key(key)

        def fn() -> int:
            n = _parse_counter(k, self._data.get(k)) + int(amount)
            if not _I64_MIN <= n <= _I64_MAX:
                raise StoreError(f"add({k!r}, {amount}) overflows a signed 64-bit counter")
            self._append([(_FS_SET, k, str(n).encode())])
            return n

        return self._update(fn)

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        k, e, d = _key(key), _value(expected), _value(desired)

        def fn() -> bytes:
            new, reply = _compare_set(self._data.get(k), e, d)
            if new is not None and self._data.get(k) != new:
                self._append([(_FS_SET, k, new)])
            return reply

        return self._update(fn)

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        self._poll("wait", _keys(keys), self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        ks = _keys(keys)
        with self._locked(exclusive=False):
            self._refresh_locked()
            return all(k in self._data for k in ks)

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        ks = _keys(keys)
        got = self._poll("multi_get", ks, self._deadline(timeout))
        return [got[k] for k in ks]

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        ks, vs = _keys(keys), [_value(v) for v in values]
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        self._update(lambda: self._append([(_FS_SET, k, v) for k, v in zip(ks, vs)]))

    def delete_key(self, key: str) -> bool:
        k = _key(key)

        def fn() -> bool:
            if k not in self._data:
                return False
            self._append([(_FS_DEL, k, None)])
            return True

        return self._update(fn)

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            self._refresh_locked()
            return len(self._data)

    def close(self) -> None:
        with self._plock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._closed = True

    def __del__(self) -> None:  # pragma: no cover - best effort
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


# ---------------------------------------------------------------- StoreServer

_AUTH, _READY, _LINGER, _DEAD = range(4)
_RECV = 65536
_OUT_HIGH = 1 << 20  # stop parsing requests while this much output is unsent
_READ_PAUSE = 1 << 20  # stop reading from a connection that is parked with this much input buffered
_LINGER_S = 2.0  # after refusing a client, how long we drain its input so it reads our reply
_LINGER_MAX = 1 << 20


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


class StoreServer:
    """The TCP store server: one background thread multiplexing every client.

    ``StoreServer(host, port, secret=...)``; :meth:`start` binds (``port=0``
    picks a free port), starts the daemon thread and returns the port;
    :meth:`close` stops it and closes every socket.  Each accepted connection
    must pass the HMAC challenge of :mod:`procgroup.protocol.auth` within
    ``auth_timeout`` seconds before any request is served.  A client that
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
        auth_timeout: float = 30.0,
        backlog: int = 4096,
        sock: Optional[socket.socket] = None,
    ) -> None:
        if secret is None:
            raise ConfigError(f"StoreServer needs the job secret (secret=...; see {ENV.SECRET})")
        self.host = host
        self._requested_port = int(port)
        self._port: Optional[int] = None
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.auth_timeout = float(auth_timeout)
        self._backlog = backlog
        self._lsock: Optional[socket.socket] = sock
        self._sel: Optional[selectors.BaseSelector] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._closed = False
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._conns: dict[int, _Conn] = {}
        self._data: dict[str, bytes] = {}
        self._waiting: dict[str, set[_Waiter]] = {}
        self._timers: list[tuple[float, int, int, object]] = []
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
        return len(self._conns)

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

    def _add_timer(self, when: float, kind: int, obj: object) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), kind, obj))
        if len(self._timers) > 1024 and len(self._timers) > 4 * (len(self._conns) + 1):
            self._timers = [t for t in self._timers if self._timer_live(t[2], t[3])]
            heapq.heapify(self._timers)

    def _timer_live(self, kind: int, obj: object) -> bool:
        if kind == self._T_AUTH:
            return obj.state == _AUTH  # type: ignore[attr-defined]
        if kind == self._T_LINGER:
            return obj.state == _LINGER  # type: ignore[attr-defined]
        if kind == self._T_WAIT:
            return not obj.done  # type: ignore[attr-defined]
        return True

    def _run_timers(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, obj = heapq.heappop(timers)
            if not self._timer_live(kind, obj):
                continue
            if kind == self._T_AUTH:
                conn = obj
                log.warning(
                    "store server: refused %s: no handshake within %.1fs (not a procgroup client?)",
                    conn.peer, self.auth_timeout,  # type: ignore[attr-defined]
                )
                self._close_conn(conn)  # type: ignore[arg-type]
            elif kind == self._T_LINGER:
                self._close_conn(obj)  # type: ignore[arg-type]
            elif kind == self._T_WAIT:
                w: _Waiter = obj  # type: ignore[assignment]
                self._finish_wait(w, sc.Timeout(tuple(k for k in dict.fromkeys(w.keys) if k in w.missing)))
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
                    now = time.monotonic()
                    if now - self._last_emfile_log > 10:
                        self._last_emfile_log = now
                        log.warning(
                            "store server: cannot accept more connections (%s) with %d open; "
                            "raise the open-files limit (ulimit -n)", e.strerror, len(self._conns),
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
            self._add_timer(time.monotonic() + self.auth_timeout, self._T_AUTH, conn)
            assert conn.hs is not None
            self._write(conn, conn.hs.hello())
            self._update_interest(conn)

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
                    "store server: refused %s: %s (wrong %s? every rank must use the job's secret)",
                    conn.peer, e, ENV.SECRET,
                )
                self._refuse(conn, _FAIL)
                return
            conn.state = _READY
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
                resp = self._handle(conn, ev)
            except StoreError as e:
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

    def _finish_wait(self, w: _Waiter, resp: object) -> None:
        self._cancel_wait(w)
        conn = w.conn
        if conn.waiter is not w or conn.state != _READY:
            return
        conn.waiter = None
        assert conn.codec is not None
        self._write(conn, conn.codec.send(resp))
        self._resume.append(conn)

    def _handle(self, conn: _Conn, ev: object) -> object:
        data = self._data
        t = type(ev)
        if t is sc.Set:
            data[ev.key] = ev.value  # type: ignore[attr-defined]
            self._notify(ev.key)  # type: ignore[attr-defined]
            return sc.Ok()
        if t is sc.Get:
            v = data.get(ev.key)  # type: ignore[attr-defined]
            return sc.Value(v) if v is not None else sc.Timeout((ev.key,))  # type: ignore[attr-defined]
        if t is sc.Add:
            k = ev.key  # type: ignore[attr-defined]
            n = _parse_counter(k, data.get(k)) + ev.amount  # type: ignore[attr-defined]
            if not _I64_MIN <= n <= _I64_MAX:
                raise StoreError(f"add({k!r}, {ev.amount}) overflows a signed 64-bit counter")  # type: ignore[attr-defined]
            data[k] = str(n).encode()
            self._notify(k)
            return sc.Int(n)
        if t is sc.CompareSet:
            k = ev.key  # type: ignore[attr-defined]
            new, reply = _compare_set(data.get(k), ev.expected, ev.desired)  # type: ignore[attr-defined]
            if new is not None and data.get(k) is not new:
                data[k] = new
                self._notify(k)
            return sc.Value(reply)
        if t is sc.Wait:
            missing = {k for k in ev.keys if k not in data}  # type: ignore[attr-defined]
            if not missing:
                return sc.Ok()
            if ev.timeout_ms == 0:  # type: ignore[attr-defined]
                return sc.Timeout(tuple(k for k in dict.fromkeys(ev.keys) if k in missing))  # type: ignore[attr-defined]
            w = _Waiter(conn, ev.keys, missing)  # type: ignore[attr-defined]
            for k in missing:
                self._waiting.setdefault(k, set()).add(w)
            conn.waiter = w
            if ev.timeout_ms != NO_TIMEOUT:  # type: ignore[attr-defined]
                self._add_timer(time.monotonic() + ev.timeout_ms / 1000.0, self._T_WAIT, w)  # type: ignore[attr-defined]
            return None
        if t is sc.Check:
            return sc.Bool(all(k in data for k in ev.keys))  # type: ignore[attr-defined]
        if t is sc.MultiGet:
            missing_l = [k for k in dict.fromkeys(ev.keys) if k not in data]  # type: ignore[attr-defined]
            if missing_l:
                return sc.Timeout(tuple(missing_l))
            return sc.Values(tuple(data[k] for k in ev.keys))  # type: ignore[attr-defined]
        if t is sc.MultiSet:
            for k, v in zip(ev.keys, ev.values):  # type: ignore[attr-defined]
                data[k] = v
            for k in ev.keys:  # type: ignore[attr-defined]
                self._notify(k)
            return sc.Ok()
        if t is sc.DeleteKey:
            return sc.Bool(data.pop(ev.key, None) is not None)  # type: ignore[attr-defined]
        if t is sc.NumKeys:
            return sc.Int(len(data))
        if t is sc.Ping:
            return sc.Ok()
        raise StoreError(f"unsupported request {ev!r}")  # pragma: no cover - the codec only yields requests


# ---------------------------------------------------------------- TCPStore

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
                err.missing = list(req.keys) if isinstance(req, sc.Wait) else []  # type: ignore[attr-defined]
                raise err from None
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
                self._lost = (
                    f"the store at {self._hp} closed the connection; did rank 0 / the launcher exit?"
                )
                raise BrokenError(f"{what}: {self._lost}")
        if isinstance(ev, sc.Error):
            raise StoreError(f"{what}: the store at {self._hp} answered: {ev.message}")
        return ev

    def _expect(self, ev: object, *types: type) -> object:
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
        k = _key(key)
        self._expect(self._call(sc.Set(k, _value(value)), f"set({k!r})"), sc.Ok)

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        k = _key(key)
        what = f"get({k!r})"
        deadline = self._deadline(timeout)
        while True:
            r = self._expect(self._call(sc.Get(k), what), sc.Value, sc.Timeout)
            if isinstance(r, sc.Value):
                return r.value
            self._wait_keys(what, (k,), (k,), deadline)

    def add(self, key: str, amount: int) -> int:
        k = _key(key)
        r = self._expect(self._call(sc.Add(k, int(amount)), f"add({k!r}, {amount})"), sc.Int)
        return r.value  # type: ignore[attr-defined]

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        k = _key(key)
        r = self._expect(
            self._call(sc.CompareSet(k, _value(expected), _value(desired)), f"compare_set({k!r})"), sc.Value
        )
        return r.value  # type: ignore[attr-defined]

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        ks = _keys(keys)
        self._wait_keys("wait", ks, ks, self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        r = self._expect(self._call(sc.Check(_keys(keys)), "check"), sc.Bool)
        return r.value  # type: ignore[attr-defined]

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
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
            self._wait_keys("multi_get", ks, r.missing, deadline)  # type: ignore[attr-defined]

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        ks, vs = _keys(keys), tuple(_value(v) for v in values)
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        self._expect(self._call(sc.MultiSet(ks, vs), "multi_set"), sc.Ok)

    def delete_key(self, key: str) -> bool:
        k = _key(key)
        r = self._expect(self._call(sc.DeleteKey(k), f"delete_key({k!r})"), sc.Bool)
        return r.value  # type: ignore[attr-defined]

    def num_keys(self) -> int:
        r = self._expect(self._call(sc.NumKeys(), "num_keys"), sc.Int)
        return r.value  # type: ignore[attr-defined]

    def ping(self) -> None:
        """One round trip to the server (raises if it is gone)."""
        self._expect(self._call(sc.Ping(), "ping"), sc.Ok)

    def close(self) -> None:
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
