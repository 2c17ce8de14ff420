"""The key-value store's semantics, once, as a sans-IO state machine.

Every store procgroup ships serves its semantics through :class:`StoreState`:
the TCP :class:`~procgroup.store.StoreServer` (requests off the wire), the
in-process :class:`~procgroup.store.HashStore` and the
:class:`~procgroup.store.FileStore` (which replays its append-only log into
one).  The state machine owns the data and nothing else: no sockets, no
locks, no clocks, no threads.

The events are the request dataclasses of
:mod:`~procgroup.protocol.store_codec` (frozen, one per operation), and the
replies its response dataclasses, so the server hands a decoded request
straight in and encodes the reply straight out::

    state = StoreState()
    out = state.apply(Set("k", b"v"))        # Outcome(reply=Ok(), wake=("k",))
    out = state.apply(Wait(("a", "b"), 500), now=12.0)
    # Outcome(reply=Park(keys=("a", "b"), missing=("a", "b"), deadline=12.5), wake=())

:meth:`StoreState.apply` returns an :class:`Outcome`: the ``reply`` and the
keys to ``wake`` (those that were written; a waiter for such a key re-checks
or counts it off).  A WAIT whose keys are not all present, and whose timeout
is not zero, is answered with :class:`Park` -- the wait expressed as data:
the shell parks the caller, counts its ``missing`` keys off as they come back
in ``wake`` lists, answers :class:`~procgroup.protocol.store_codec.Ok` when
none is left, and :func:`timeout_reply` at ``deadline``.  Time only enters
as the ``now`` argument of :meth:`StoreState.apply`.

Semantics (torch's, which the tests pin down):

* SET / MULTI_SET store values and wake their keys.  MULTI_SET assumes as
  many values as keys (the codec and the store front ends check this).
* GET / MULTI_GET never block: an absent key is ``Timeout(missing)``.
* ADD keeps its counter as ASCII decimal (absent = 0); a value that is not a
  decimal integer, or a result outside a signed 64-bit integer, is an
  :class:`~procgroup.protocol.store_codec.Error` reply and changes nothing.
* COMPARE_SET: an absent key with ``expected == b""`` is set to ``desired``;
  a present key equal to ``expected`` is set to ``desired``; the reply is the
  value after the op, and for an absent key with a non-empty ``expected`` it
  is ``expected`` (nothing is stored).  It wakes its key when it stored.
* WAIT: ``Ok`` when every key exists; otherwise ``Timeout(missing)`` for a
  zero timeout, else :class:`Park`.
* CHECK: ``Bool(all exist)``; DELETE: ``Bool(existed)`` (wakes nothing);
  NUM_KEYS: ``Int(count)``; PING: ``Ok``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Union

from .store_codec import (
    NO_TIMEOUT,
    Add,
    Bool,
    Check,
    CompareSet,
    DeleteKey,
    Error,
    Get,
    Int,
    MultiGet,
    MultiSet,
    NumKeys,
    Ok,
    Ping,
    Request,
    Response,
    Set,
    Timeout,
    Value,
    Values,
    Wait,
)

__all__ = ["StoreState", "Outcome", "Park", "Reply", "timeout_reply", "compare_set", "I64_MIN", "I64_MAX"]

#: Bounds of an ADD counter (a signed 64-bit integer, as in torch).
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
_INT_RE = re.compile(rb"-?[0-9]+")
_NO_KEYS: tuple[str, ...] = ()
_OK = Ok()  # immutable, so one instance serves every OK reply


@dataclass(frozen=True)
class Park:
    """A WAIT that cannot be answered yet: park the caller.

    ``keys`` are the requested keys in request order (duplicates kept),
    ``missing`` the distinct ones absent now (in request order), and
    ``deadline`` the time (in the clock of the ``now`` passed to
    :meth:`StoreState.apply`) at which to answer :func:`timeout_reply`, or
    None to wait forever.
    """

    keys: tuple[str, ...]
    missing: tuple[str, ...]
    deadline: Optional[float]


#: What :meth:`StoreState.apply` answers: a protocol response, or :class:`Park`.
Reply = Union[Response, Park]


class Outcome(NamedTuple):
    """The result of one :meth:`StoreState.apply`: the ``reply`` and the keys written (``wake``).

    A named tuple (not a dataclass) because the server builds one per request.
    """

    reply: Reply
    wake: tuple[str, ...] = _NO_KEYS


_outcome = tuple.__new__  # builds an Outcome without NamedTuple.__new__'s Python-level call


def timeout_reply(keys: tuple[str, ...], still_missing: "set[str] | frozenset[str]") -> Timeout:
    """The TIMEOUT reply of a parked wait: the keys of ``keys`` still missing, in order, once each."""
    return Timeout(tuple(k for k in dict.fromkeys(keys) if k in still_missing))


def compare_set(cur: Optional[bytes], expected: bytes, desired: bytes) -> tuple[Optional[bytes], bytes]:
    """torch's compare_set on one value: (value to store, or None to leave the key absent; reply).

    When the result is ``cur`` itself (a mismatch), nothing needs storing.
    """
    if cur is None:
        if expected == b"":
            return desired, desired
        return None, expected  # torch replies `expected` for an absent key
    if cur == expected:
        return desired, desired
    return cur, cur


class StoreState:
    """The store's data and the one implementation of every operation on it.

    ``apply(event, now)`` executes one request (a store_codec request
    dataclass) and returns an :class:`Outcome`.  It never raises for a
    well-formed request: store-level failures (a non-integer counter, an
    ADD overflow) are :class:`~procgroup.protocol.store_codec.Error` replies
    carrying the message the front ends raise as ``StoreError``.  Not
    thread-safe: the owner serialises calls (the server's single thread,
    HashStore's lock, FileStore's file lock).  ``data`` is the key -> value
    dict; read it freely, change it only through :meth:`apply`.
    """

    __slots__ = ("data",)
    _ops: ClassVar[dict[type, Callable[[StoreState, Any, float], Outcome]]]

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self.data)

    def get(self, key: str) -> Optional[bytes]:
        """The value of ``key``, or None if absent (a read that is not a request)."""
        return self.data.get(key)

    def missing(self, keys: tuple[str, ...]) -> list[str]:
        """The distinct keys of ``keys`` that are absent, in order."""
        data = self.data
        return [k for k in dict.fromkeys(keys) if k not in data]

    def apply(self, ev: Request, now: float = 0.0) -> Outcome:
        """Execute request ``ev``; ``now`` (any monotonic clock, seconds) dates a parked WAIT's deadline.

        Raises TypeError for an object that is not a store request.
        """
        op = self._ops.get(type(ev))
        if op is None:
            raise TypeError(f"not a store request: {ev!r}")
        return op(self, ev, now)

    # One method per request type, dispatched on the exact type (the server applies one per request,
    # so this path is kept lean: plain tuples built with tuple.__new__, shared immutable OK replies).

    def _set(self, ev: Set, now: float) -> Outcome:
        self.data[ev.key] = ev.value
        return _outcome(Outcome, (_OK, (ev.key,)))

    def _get(self, ev: Get, now: float) -> Outcome:
        v = self.data.get(ev.key)
        return _outcome(Outcome, (Value(v) if v is not None else Timeout((ev.key,)), _NO_KEYS))

    def _wait(self, ev: Wait, now: float) -> Outcome:
        data = self.data
        for k in ev.keys:
            if k not in data:
                break
        else:
            return _outcome(Outcome, (_OK, _NO_KEYS))
        missing = tuple(self.missing(ev.keys))
        if ev.timeout_ms == 0:
            return _outcome(Outcome, (Timeout(missing), _NO_KEYS))
        deadline = None if ev.timeout_ms == NO_TIMEOUT else now + ev.timeout_ms / 1000.0
        return _outcome(Outcome, (Park(ev.keys, missing, deadline), _NO_KEYS))

    def _compare_set(self, ev: CompareSet, now: float) -> Outcome:
        k = ev.key
        cur = self.data.get(k)
        new, reply = compare_set(cur, ev.expected, ev.desired)
        if new is not None and new is not cur:
            self.data[k] = new
            return _outcome(Outcome, (Value(reply), (k,)))
        return _outcome(Outcome, (Value(reply), _NO_KEYS))

    def _check(self, ev: Check, now: float) -> Outcome:
        data = self.data
        return _outcome(Outcome, (Bool(all(k in data for k in ev.keys)), _NO_KEYS))

    def _multi_get(self, ev: MultiGet, now: float) -> Outcome:
        missing = self.missing(ev.keys)
        if missing:
            return _outcome(Outcome, (Timeout(tuple(missing)), _NO_KEYS))
        data = self.data
        return _outcome(Outcome, (Values(tuple(data[k] for k in ev.keys)), _NO_KEYS))

    def _multi_set(self, ev: MultiSet, now: float) -> Outcome:
        self.data.update(zip(ev.keys, ev.values))
        return _outcome(Outcome, (_OK, ev.keys))

    def _delete(self, ev: DeleteKey, now: float) -> Outcome:
        return _outcome(Outcome, (Bool(self.data.pop(ev.key, None) is not None), _NO_KEYS))

    def _num_keys(self, ev: NumKeys, now: float) -> Outcome:
        return _outcome(Outcome, (Int(len(self.data)), _NO_KEYS))

    def _ping(self, ev: Ping, now: float) -> Outcome:
        return _outcome(Outcome, (_OK, _NO_KEYS))

    def _add(self, ev: Add, now: float) -> Outcome:
        k = ev.key
        cur = self.data.get(k)
        if cur is None:
            n = ev.amount
        elif _INT_RE.fullmatch(cur):
            n = int(cur) + ev.amount
        else:
            return Outcome(Error(f"add({k!r}): the key holds {cur[:40]!r}, which is not a decimal integer"))
        if not I64_MIN <= n <= I64_MAX:
            return Outcome(Error(f"add({k!r}, {ev.amount}) overflows a signed 64-bit counter"))
        self.data[k] = str(n).encode()
        return _outcome(Outcome, (Int(n), (k,)))

    _ops = {  # noqa: RUF012 - a fixed table, never mutated
        Set: _set,
        Get: _get,
        Add: _add,
        CompareSet: _compare_set,
        Wait: _wait,
        Check: _check,
        MultiGet: _multi_get,
        MultiSet: _multi_set,
        DeleteKey: _delete,
        NumKeys: _num_keys,
        Ping: _ping,
    }
