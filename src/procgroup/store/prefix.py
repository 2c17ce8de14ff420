"""PrefixStore: a namespace (``prefix/key``) over another store."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from ..errors import ClosedError, StoreTimeoutError
from .base import KeyList, Store, Timeoutish, _key, _keys, _seconds, _with_missing

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Keys of ``store`` under ``prefix + "/"``; ``num_keys`` counts the whole underlying store
    (as in torch).  ``close()`` does not close the underlying store, which its creator owns."""

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a Store, got {type(store).__name__}")
        self.prefix = str(prefix)
        self.underlying_store = store
        self._closed = False

    @property
    def timeout(self) -> Optional[float]:
        """The underlying store's default timeout (seconds, or None for forever)."""
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
                msg = msg.replace(repr(m), repr(m[len(p) :]))
        out = _with_missing(
            StoreTimeoutError(f"{msg} [keys of PrefixStore {self.prefix!r}]"),
            [m[len(p) :] if m.startswith(p) else m for m in missing],
        )
        out.__traceback__ = e.__traceback__
        return out

    def _where(self) -> str:
        return f"PrefixStore({self.prefix!r}) over {self.underlying_store._where()}"

    def set(self, key: str, value: Union[bytes, str]) -> None:
        """``underlying.set(prefix/key, value)``."""
        self.underlying_store.set(self._k(key), value)

    def get(self, key: str, timeout: Timeoutish = None) -> bytes:
        """``underlying.get(prefix/key)``; a timeout names the key without the prefix."""
        try:
            return self.underlying_store.get(self._k(key), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def add(self, key: str, amount: int) -> int:
        """``underlying.add(prefix/key, amount)``."""
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes:
        """``underlying.compare_set(prefix/key, expected, desired)``."""
        return self.underlying_store.compare_set(self._k(key), expected, desired)

    def wait(self, keys: KeyList, timeout: Timeoutish = None) -> None:
        """``underlying.wait`` on the prefixed keys; a timeout names them without the prefix."""
        try:
            self.underlying_store.wait(self._ks(keys), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def check(self, keys: KeyList) -> bool:
        """``underlying.check`` on the prefixed keys."""
        return self.underlying_store.check(self._ks(keys))

    def multi_get(self, keys: KeyList, timeout: Timeoutish = None) -> list[bytes]:
        """``underlying.multi_get`` on the prefixed keys; a timeout names them without the prefix."""
        try:
            return self.underlying_store.multi_get(self._ks(keys), timeout)
        except StoreTimeoutError as e:
            raise self._unprefix(e) from None

    def multi_set(self, keys: KeyList, values: Sequence[Union[bytes, str]]) -> None:
        """``underlying.multi_set`` on the prefixed keys."""
        self.underlying_store.multi_set(self._ks(keys), values)

    def delete_key(self, key: str) -> bool:
        """``underlying.delete_key(prefix/key)``."""
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        """The number of keys in the whole underlying store (as in torch)."""
        if self._closed:
            raise ClosedError(f"PrefixStore({self.prefix!r}) was closed")
        return self.underlying_store.num_keys()

    def close(self) -> None:
        """Refuse later calls (ClosedError); the underlying store stays open."""
        self._closed = True
