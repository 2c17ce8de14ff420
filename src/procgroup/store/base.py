"""The store interface and the helpers every store shares.

:class:`Store` is the torch.distributed.Store-shaped interface; the helpers
normalise keys, values and timeouts and build the timeout error, so every
front end reports the same messages.
"""

from __future__ import annotations

import abc
import logging
from typing import Iterable, Optional, Sequence, SupportsFloat, Union, cast

from ..config import DEFAULT_TIMEOUT, ENV
from ..deadline import Deadline, as_deadline
from ..errors import ConfigError, StoreError, StoreTimeoutError
from ..protocol import store_codec as sc
from ..protocol.store_state import Outcome, Park

__all__ = ["Store", "KeyList", "Timeoutish", "log"]

#: Every store module logs here (one logger name, as before the split).
log = logging.getLogger("procgroup.store")

KeyList = Union[str, Iterable[str]]
Timeoutish = Union[None, float, Deadline]  # also datetime.timedelta


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
    """``timeout`` (seconds, a timedelta or None) as seconds; ConfigError if negative or NaN."""
    if timeout is None:
        return None
    total = getattr(timeout, "total_seconds", None)
    value = total() if total is not None else timeout
    t = float(cast(SupportsFloat, value))
    if not t >= 0:
        raise ConfigError(f"store timeout must be >= 0 seconds, got {timeout!r}")
    return t


def _fmt_keys(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += f", ... ({len(keys) - limit} more)"
    return "[" + shown + "]"


def _with_missing(err: StoreTimeoutError, missing: Iterable[str]) -> StoreTimeoutError:
    """``err`` with its ``missing`` attribute (the keys that never appeared) set; returns ``err``."""
    err.missing = list(missing)  # type: ignore[attr-defined]  # errors.py declares no field; callers read it
    return err


def _result(out: Outcome) -> sc.Response:
    """The reply of a :class:`~procgroup.protocol.store_state.StoreState` outcome.

    An Error reply raises :class:`~procgroup.errors.StoreError` with its message.
    """
    reply = out.reply
    if isinstance(reply, Park):  # pragma: no cover - the front ends only apply zero-timeout WAITs
        raise TypeError("a parked WAIT reached a store front end that never parks")
    if isinstance(reply, sc.Error):
        raise StoreError(reply.message)
    return reply


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

    def _timeout_error(
        self, op: str, keys: Sequence[str], missing: Sequence[str], deadline: Deadline
    ) -> StoreTimeoutError:
        total = deadline.timeout
        what = (
            f"key {missing[0]!r} was never set"
            if len(missing) == 1
            else (f"{len(missing)} of {len(keys)} keys were never set: {_fmt_keys(list(missing))}")
        )
        err = StoreTimeoutError(
            f"{op} on {self._where()} timed out after {deadline.elapsed():.2f}s"
            + (f" (timeout {total:.2f}s)" if total is not None else "")
            + f": {what}; the process that should set "
            + ("it" if len(missing) == 1 else "them")
            + " may have failed or not started yet; pass a larger timeout= or set "
            f"{ENV.TIMEOUT} to wait longer"
        )
        return _with_missing(err, missing)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
