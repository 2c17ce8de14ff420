"""FileStore: a store in one append-only file, shared by the processes that open it."""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar, Union

from ..config import DEFAULT_TIMEOUT
from ..deadline import Deadline
from ..errors import ClosedError, ConfigError, StoreError
from ..protocol import store_codec as sc
from ..protocol.store_state import Outcome, StoreState
from .base import KeyList, Store, Timeoutish, _key, _keys, _result, _value, log

__all__ = ["FileStore"]

_FS_MAGIC = b"PGFSTORE1\n"
_FS_SET, _FS_DEL = 0x53, 0x44  # 'S', 'D'
_FS_HDR = struct.Struct(">BI")  # op, key length
_FS_LEN = struct.Struct(">I")
_Record = tuple[int, str, Optional[bytes]]  # op, key, value (None for a delete)
_path_locks: dict[tuple[int, int], threading.Lock] = {}
_path_locks_guard = threading.Lock()
_T = TypeVar("_T")


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
            p = p[len("file://") :]
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
        self._state = StoreState()
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
        """Replay the records appended since our last look into the state machine (caller holds the lock).

        With ``repair`` (only under the exclusive lock) a partial record at the end, left by a writer
        that died mid-append, is cut off.  StoreError if the log is corrupt.
        """
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        state = self._state
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
            key = data[pos + _FS_HDR.size : end].decode("utf-8", "replace")
            if op == _FS_DEL:
                state.apply(sc.DeleteKey(key))
                pos = end
                continue
            if end + 4 > n:
                break
            (vlen,) = _FS_LEN.unpack_from(data, end)
            if end + 4 + vlen > n:
                break
            state.apply(sc.Set(key, data[end + 4 : end + 4 + vlen]))
            pos = end + 4 + vlen
        self._offset += pos
        if pos < n and repair:
            # Under the exclusive lock a partial tail can only be a writer that died mid-append.
            log.warning("%s: discarding a partial record of %d bytes (a writer died mid-write)", self._where(), n - pos)
            os.ftruncate(self._fd, self._offset)

    def _encode(self, records: Sequence[_Record]) -> bytes:
        """The log bytes of ``records`` ((op, key, value or None)); ConfigError for an oversize key."""
        parts = []
        for op, key, value in records:
            kb = key.encode("utf-8")
            if len(kb) > sc.MAX_KEY_LEN:
                raise ConfigError(f"store key of {len(kb)} bytes exceeds the {sc.MAX_KEY_LEN}-byte limit")
            parts.append(_FS_HDR.pack(op, len(kb)) + kb)
            if value is not None:
                parts.append(_FS_LEN.pack(len(value)) + value)
        return b"".join(parts)

    def _records(self, ev: sc.Request, out: Outcome, prior: Optional[bytes]) -> list[_Record]:
        """The log records that persist what ``ev`` just did to the state (``prior``: a COMPARE_SET's old value)."""
        if isinstance(ev, sc.Set):
            return [(_FS_SET, ev.key, ev.value)]
        if isinstance(ev, sc.MultiSet):
            return [(_FS_SET, k, v) for k, v in zip(ev.keys, ev.values)]
        if isinstance(ev, sc.DeleteKey):
            return [(_FS_DEL, ev.key, None)] if out.reply == sc.Bool(True) else []
        recs: list[_Record] = []
        for k in out.wake:  # ADD, COMPARE_SET: the key they stored, unless it holds what it held
            v = self._state.get(k)
            if v is not None and not (isinstance(ev, sc.CompareSet) and v == prior):
                recs.append((_FS_SET, k, v))
        return recs

    def _update(self, ev: sc.Request) -> sc.Response:
        """Apply a write under the exclusive lock and append its records to the log; its reply.

        The state machine decides (on the state replayed from the log); the records follow from what it
        did.  If they cannot be written (an oversize key: ConfigError; an I/O error) the state is
        rebuilt from the file, so memory never holds what the log does not.  StoreError for an Error reply.
        """
        with self._locked(exclusive=True):
            self._refresh_locked(repair=True)
            prior = self._state.get(ev.key) if isinstance(ev, sc.CompareSet) else None
            out = self._state.apply(ev)
            try:
                data = self._encode(self._records(ev, out, prior))
                self._write_all(data)
            except BaseException:
                self._state = StoreState()
                self._offset = len(_FS_MAGIC)
                self._refresh_locked(repair=True)
                raise
            self._offset += len(data)  # our own records are not re-read: the state has them already
            return _result(out)

    def _read(self, ev: sc.Request) -> sc.Response:
        """Catch up with the log under the shared lock, then apply the read-only request ``ev``."""
        with self._locked(exclusive=False):
            self._refresh_locked()
            return _result(self._state.apply(ev))

    def _poll(self, op: str, keys: tuple[str, ...], deadline: Deadline) -> tuple[bytes, ...]:
        """The values of ``keys`` once all exist, re-reading the log (with backoff) as it grows."""
        delay = 0.001
        seen = -1
        missing: tuple[str, ...] = ()
        probe = sc.MultiGet(keys)
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
                    r = _result(self._state.apply(probe))
                if isinstance(r, sc.Values):
                    return r.values
                assert isinstance(r, sc.Timeout)
                missing = r.missing
            rem = deadline.remaining()
            if rem <= 0:
                raise self._timeout_error(op, keys, missing, deadline)
            time.sleep(min(delay, rem))
            delay = min(delay * 2, 0.01)

    def under_lock(self, fn: Callable[[Callable[[str], Optional[bytes]]], _T]) -> _T:
        """``fn(get)`` under the file's exclusive lock, after catching up with the log: ``get(key)`` reads the
        replayed state without blocking, and no other process writes meanwhile (a decision nobody may race,
        such as taking over a stale file).  ``fn`` must not call this store's other methods."""
        with self._locked(exclusive=True):
            self._refresh_locked(repair=True)
            return fn(self._state.get)

    def names_path(self) -> bool:
        """True while :attr:`path` still names the file this store has open (not renamed or replaced)."""
        try:
            return self._fd is not None and os.path.samestat(os.stat(self.path), os.fstat(self._fd))
        except OSError:
            return False

    # -- the interface ------------------------------------------------------------

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Append ``key = value`` to the log."""
        self._update(sc.Set(_key(key), _value(value)))

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        """The value of ``key``, polling the log until it exists (StoreTimeoutError at the deadline)."""
        k = _key(key)
        return self._poll(f"get({k!r})", (k,), self._deadline(timeout))[0]

    def add(self, key: str, amount: int) -> int:
        """Atomically (under the file lock) add ``amount`` to the decimal counter ``key``; the new value.

        StoreError if the key holds something else or the result leaves the signed 64-bit range.
        """
        r = self._update(sc.Add(_key(key), int(amount)))
        assert isinstance(r, sc.Int)
        return r.value

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """torch's compare_set (see :class:`~procgroup.store.Store`), atomic under the file lock."""
        r = self._update(sc.CompareSet(_key(key), _value(expected), _value(desired)))
        assert isinstance(r, sc.Value)
        return r.value

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        """Poll the log until every key exists; StoreTimeoutError (``.missing``) at the deadline."""
        self._poll("wait", _keys(keys), self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        """True if every key exists in the log right now (never blocks)."""
        r = self._read(sc.Check(_keys(keys)))
        assert isinstance(r, sc.Bool)
        return r.value

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        """The values of ``keys``, polling until all exist."""
        ks = _keys(keys)
        return list(self._poll("multi_get", ks, self._deadline(timeout)))

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        """Append several keys in one write; ConfigError if the counts differ."""
        ks, vs = _keys(keys), tuple(_value(v) for v in values)
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        self._update(sc.MultiSet(ks, vs))

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` (a delete record); True if it existed."""
        r = self._update(sc.DeleteKey(_key(key)))
        assert isinstance(r, sc.Bool)
        return r.value

    def num_keys(self) -> int:
        """Number of keys in the store."""
        r = self._read(sc.NumKeys())
        assert isinstance(r, sc.Int)
        return r.value

    def close(self) -> None:
        """Close the file (the file itself stays); later calls raise ClosedError.  Idempotent."""
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
