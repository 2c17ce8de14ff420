"""HashStore: the in-process store, for ranks running as threads."""

from __future__ import annotations

import math
import threading
from typing import Sequence, Union

from ..config import DEFAULT_TIMEOUT
from ..deadline import Deadline
from ..errors import ClosedError, ConfigError
from ..protocol import store_codec as sc
from ..protocol.store_state import StoreState
from .base import KeyList, Store, Timeoutish, _key, _keys, _result, _value

__all__ = ["HashStore"]


class HashStore(Store):
    """In-process store for ranks running as threads.

    A :class:`~procgroup.protocol.store_state.StoreState` (the one
    implementation of the store's semantics) behind a condition variable:
    every call applies one request under the lock; a blocking call whose keys
    are missing sleeps on the condition until a write wakes it or its
    deadline passes (:class:`~procgroup.errors.StoreTimeoutError`).  After
    :meth:`close` every call raises :class:`~procgroup.errors.ClosedError`.
    """

    def __init__(self, timeout: object = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._state = StoreState()
        self._cond = threading.Condition()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._where()} was closed")

    def _apply(self, ev: sc.Request) -> sc.Response:
        """Apply ``ev`` (caller holds the lock); wake the sleepers if it wrote; StoreError for an Error reply."""
        self._check_open()
        out = self._state.apply(ev)
        if out.wake:
            self._cond.notify_all()
        return _result(out)

    def _wait_locked(self, op: str, keys: tuple[str, ...], deadline: Deadline) -> None:
        """Sleep until every key exists (caller holds the lock); StoreTimeoutError at the deadline."""
        probe = sc.Wait(keys, 0)
        while True:
            r = self._apply(probe)
            if not isinstance(r, sc.Timeout):
                return
            rem = deadline.remaining()
            if rem <= 0:
                raise self._timeout_error(op, keys, r.missing, deadline)
            self._cond.wait(None if rem == math.inf else rem)

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """Store ``value`` under ``key`` and wake everyone waiting for it."""
        ev = sc.Set(_key(key), _value(value))
        with self._cond:
            self._apply(ev)

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        """The value of ``key``, blocking until it exists (StoreTimeoutError at the deadline)."""
        k = _key(key)
        ev = sc.Get(k)
        with self._cond:
            r = self._apply(ev)
            if not isinstance(r, sc.Value):
                self._wait_locked(f"get({k!r})", (k,), self._deadline(timeout))
                r = self._apply(ev)
            assert isinstance(r, sc.Value)
            return r.value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal counter ``key`` (absent = 0); the new value.

        StoreError if the key holds something else or the result leaves the signed 64-bit range.
        """
        ev = sc.Add(_key(key), int(amount))
        with self._cond:
            r = self._apply(ev)
        assert isinstance(r, sc.Int)
        return r.value

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """torch's compare_set (see :class:`~procgroup.store.Store`); returns the value after the op."""
        ev = sc.CompareSet(_key(key), _value(expected), _value(desired))
        with self._cond:
            r = self._apply(ev)
        assert isinstance(r, sc.Value)
        return r.value

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        """Block until every key exists; StoreTimeoutError (``.missing``) at the deadline."""
        ks = _keys(keys)
        with self._cond:
            self._wait_locked("wait", ks, self._deadline(timeout))

    def check(self, keys: KeyList) -> bool:
        """True if every key exists right now (never blocks)."""
        ev = sc.Check(_keys(keys))
        with self._cond:
            r = self._apply(ev)
        assert isinstance(r, sc.Bool)
        return r.value

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        """The values of ``keys``, blocking until all exist."""
        ks = _keys(keys)
        ev = sc.MultiGet(ks)
        with self._cond:
            r = self._apply(ev)
            if not isinstance(r, sc.Values):
                self._wait_locked("multi_get", ks, self._deadline(timeout))
                r = self._apply(ev)
            assert isinstance(r, sc.Values)
            return list(r.values)

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        """Set several keys atomically; ConfigError if the counts differ."""
        ks, vs = _keys(keys), tuple(_value(v) for v in values)
        if len(ks) != len(vs):
            raise ConfigError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        with self._cond:
            self._apply(sc.MultiSet(ks, vs))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        ev = sc.DeleteKey(_key(key))
        with self._cond:
            r = self._apply(ev)
        assert isinstance(r, sc.Bool)
        return r.value

    def num_keys(self) -> int:
        """Number of keys in the store."""
        with self._cond:
            r = self._apply(sc.NumKeys())
        assert isinstance(r, sc.Int)
        return r.value

    def close(self) -> None:
        """Wake every sleeper; later calls raise ClosedError.  Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
