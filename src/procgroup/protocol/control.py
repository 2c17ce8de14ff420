"""Sans-IO codec of the launcher's control link: the head node <-> agent messages, and the
agent <-> agent records the agents exchange through their store.

The head node starts one agent per host over ssh.  It writes to the agent's stdin
(:class:`Hello` first, then :class:`Usr1` whenever the head gets SIGUSR1); the agent
answers with control lines on its stdout (:class:`PortAnnounce`, :class:`Report`),
mixed into the workers' output and marked with a nonce by :mod:`procgroup.launcher.control`.

Wire format: one JSON object per line, ``{"event": NAME, ...fields}`` followed by ``\\n``,
at most ``max_line`` bytes including the newline.  No I/O happens here: :func:`encode`
turns a message into bytes, :func:`decode_line` turns one line back, and
:class:`ControlDecoder` is fed bytes in arbitrary pieces and hands out whole messages.
Every malformed input raises :class:`ControlMessageError` naming what was wrong.

Agent <-> agent: the agents of a multi-node job publish values in the store node 0's agent hosts
(:mod:`procgroup.launcher.gang`): records (an agent's join info, a failure or abort record: JSON
objects) via :func:`encode_record` / :func:`decode_record`, and each node's worker pids via
:func:`encode_pids` / :func:`decode_pids`.  Both are bounded by :data:`MAX_LINE` too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from ..errors import ProtocolError

__all__ = [
    "MAX_LINE",
    "HELLO_MAX_LINE",
    "ControlMessageError",
    "Hello",
    "Usr1",
    "PortAnnounce",
    "Report",
    "ControlMessage",
    "encode",
    "decode_line",
    "ControlDecoder",
    "encode_record",
    "decode_record",
    "encode_pids",
    "decode_pids",
]

#: Longest control line an agent writes (the output pump's own line limit, so a report is never split).
MAX_LINE = 1 << 20
#: Longest line the agent accepts on its stdin from the head (the hello carries only a secret and a nonce).
HELLO_MAX_LINE = 1 << 16


class ControlMessageError(ProtocolError, ValueError):
    """A control line that is not a valid message: bad JSON, an unknown event, a missing or mistyped
    field, or a line longer than the decoder's ``max_line``."""


@dataclass(frozen=True)
class Hello:
    """Head -> agent, the first line on the agent's stdin: the job secret and the nonce that marks
    the agent's control lines on its stdout."""

    secret: str
    nonce: str


@dataclass(frozen=True)
class Usr1:
    """Head -> agent: the head received SIGUSR1; the agent passes it on to its workers."""


@dataclass(frozen=True)
class PortAnnounce:
    """Agent (node 0) -> head: the port where node 0's agent hosts the agents' store."""

    port: int


@dataclass(frozen=True)
class Report:
    """Agent -> head: this node's final result (``result`` is :func:`~procgroup.launcher.report.result_to_json`'s
    object, already parsed)."""

    node: Optional[int]
    host: str
    exit_code: int
    result: dict[str, Any] = field(default_factory=dict, hash=False)


ControlMessage = Union[Hello, Usr1, PortAnnounce, Report]

_EVENTS: dict[type, str] = {Hello: "hello", Usr1: "usr1", PortAnnounce: "port", Report: "report"}


def encode(msg: ControlMessage) -> bytes:
    """One message as its wire line (JSON object + ``\\n``).

    Raises :class:`ControlMessageError` for an object that is not a control message, or whose
    fields do not serialise to JSON.
    """
    event = _EVENTS.get(type(msg))
    if event is None:
        raise ControlMessageError(
            f"cannot encode {type(msg).__name__}: not a control message ({', '.join(t.__name__ for t in _EVENTS)})"
        )
    obj: dict[str, Any] = {"event": event}
    obj.update(vars(msg))
    try:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ControlMessageError(f"cannot encode {event} message: {e}") from None
    return text.encode("ascii") + b"\n"


def _field(obj: dict[str, Any], event: str, name: str, kind: Any, optional: bool = False) -> Any:
    if name not in obj:
        raise ControlMessageError(f"control message {event!r} has no field {name!r}")
    v = obj[name]
    if v is None and optional:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ControlMessageError(f"control message {event!r}: field {name!r} is {v!r}, not {kind.__name__}")
    return v


def decode_line(line: bytes) -> ControlMessage:
    """The message in one line (with or without its trailing ``\\n``).

    Raises :class:`ControlMessageError` when the line is not UTF-8 JSON, not an object, names an
    unknown event, or lacks a field or has one of the wrong type.
    """
    if line.endswith(b"\n"):
        line = line[:-1]
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ControlMessageError(f"control line is not JSON ({e}): {line[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ControlMessageError(f"control line is not a JSON object: {line[:80]!r}")
    event = obj.get("event")
    if event == "hello":
        return Hello(secret=_field(obj, event, "secret", str), nonce=_field(obj, event, "nonce", str))
    if event == "usr1":
        return Usr1()
    if event == "port":
        port = _field(obj, event, "port", int)
        if not 0 < port < 65536:
            raise ControlMessageError(f"control message 'port': {port} is not a TCP port (1..65535)")
        return PortAnnounce(port=port)
    if event == "report":
        return Report(
            node=_field(obj, event, "node", int, optional=True),
            host=_field(obj, event, "host", str),
            exit_code=_field(obj, event, "exit_code", int),
            result=_field(obj, event, "result", dict),
        )
    raise ControlMessageError(f"unknown control event {event!r} (known: {', '.join(_EVENTS.values())})")


class ControlDecoder:
    """Incremental decoder: feed bytes with :meth:`receive_data`, take messages with :meth:`next_message`.

    Bytes may arrive in any pieces.  A malformed line raises :class:`ControlMessageError` from
    :meth:`next_message` once; the line is dropped and the lines after it still decode.  A line
    longer than ``max_line`` (newline included) raises as soon as that is known, and the rest of
    it, up to the next newline, is skipped.  :meth:`eof` tells a clean end (at a line boundary)
    from a truncated last line.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        if max_line < 2:
            raise ValueError(f"max_line {max_line} must be >= 2 (one byte and the newline)")
        self.max_line = max_line
        self._buf = bytearray()
        self._skipping = False  # inside an over-long line, dropping bytes until its newline

    def receive_data(self, data: bytes) -> None:
        """Append ``data`` (any length, possibly empty) to the input; never raises."""
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole line."""
        return len(self._buf)

    def next_message(self) -> Optional[ControlMessage]:
        """The next whole message, or None until more bytes arrive.

        Raises :class:`ControlMessageError` for a malformed or over-long line (which is consumed).
        """
        while True:
            nl = self._buf.find(b"\n")
            if self._skipping:
                if nl < 0:
                    self._buf.clear()
                    return None
                del self._buf[: nl + 1]
                self._skipping = False
                continue
            if nl < 0:
                if len(self._buf) >= self.max_line:
                    self._buf.clear()
                    self._skipping = True
                    raise ControlMessageError(f"control line longer than {self.max_line} bytes")
                return None
            if nl + 1 > self.max_line:
                del self._buf[: nl + 1]
                raise ControlMessageError(f"control line of {nl + 1} bytes is longer than {self.max_line}")
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            return decode_line(line)

    def eof(self) -> None:
        """The input ended.  Raises :class:`ControlMessageError` when it ended inside a line."""
        if self._buf or self._skipping:
            n = len(self._buf)
            self._buf.clear()
            self._skipping = False
            raise ControlMessageError(f"control stream ended inside a line ({n} bytes without a newline)")


# --------------------------------------------------------------------------- agent <-> agent (store values)


def encode_record(record: Mapping[str, Any]) -> bytes:
    """A record (a JSON object: an agent's join info, a failure or abort record) as a store value.

    Raises :class:`ControlMessageError` when it does not serialise to JSON or exceeds :data:`MAX_LINE`.
    """
    try:
        data = json.dumps(dict(record), separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ControlMessageError(f"cannot encode the record: {e}") from None
    if len(data) > MAX_LINE:
        raise ControlMessageError(f"record of {len(data)} bytes is longer than {MAX_LINE}")
    return data


def decode_record(data: Union[bytes, str]) -> dict[str, Any]:
    """The record in a store value.  Raises :class:`ControlMessageError` (a ValueError) when it is
    too long, not UTF-8 JSON, or not a JSON object."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_LINE:
        raise ControlMessageError(f"record of {len(raw)} bytes is longer than {MAX_LINE}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ControlMessageError(f"record is not JSON ({e}): {raw[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ControlMessageError(f"record is not a JSON object: {raw[:80]!r}")
    return obj


def encode_pids(rows: Sequence[Sequence[int]]) -> bytes:
    """One node's workers as ``[[rank, local_rank, pid], ...]``, as a store value."""
    return json.dumps([[int(x) for x in row] for row in rows], separators=(",", ":")).encode("ascii")


def decode_pids(data: Union[bytes, str]) -> list[list[int]]:
    """The rows :func:`encode_pids` wrote.  Raises :class:`ControlMessageError` unless the value is a
    list of ``[rank, local_rank, pid]`` integer triples."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_LINE:
        raise ControlMessageError(f"pid table of {len(raw)} bytes is longer than {MAX_LINE}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ControlMessageError(f"pid table is not JSON ({e}): {raw[:80]!r}") from None
    if not isinstance(obj, list) or not all(
        isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r) for r in obj
    ):
        raise ControlMessageError(f"pid table is not a list of [rank, local_rank, pid]: {raw[:80]!r}")
    return obj
