"""Sans-IO codec of the rendezvous key-value store protocol (h11-style).

The codec only transforms bytes into events and events into bytes; it never
touches a socket, so the server (one selector thread, thousands of
connections), the client and the tests all drive the same state machine::

    codec = StoreCodec("server")          # parses requests, emits responses
    codec.receive_data(chunk)             # b"" means the peer closed (EOF)
    while (ev := codec.next_event()) is not NEED_DATA:
        if ev is CLOSED: ...              # clean EOF between frames
        out += codec.send(handle(ev))     # raises ProtocolError on bad input

Wire format
-----------

All integers are big-endian.  Every frame is::

    +-------------+----------+---------------------------+
    | length: u32 | type: u8 | body: length - 1 bytes    |
    +-------------+----------+---------------------------+

``length`` counts the type byte and the body: ``1 <= length <= MAX_FRAME``
(64 MiB).  A header announcing more is rejected as soon as its 4 bytes
arrive (:class:`~procgroup.errors.FrameTooLargeError`), so nothing is ever
buffered for it.  Body fields:

=========  =====================================  =========================================
name       layout                                 bound
=========  =====================================  =========================================
key        ``n: u16`` + ``n`` bytes of UTF-8       ``n <= MAX_KEY_LEN`` (4096); valid UTF-8
keys       ``count: u32`` + ``count`` x key         ``count <= MAX_KEYS`` (65536)
blob       ``n: u32`` + ``n`` bytes                 inside the frame
blobs      ``count: u32`` + ``count`` x blob        ``count <= MAX_KEYS``
i64        8 bytes, two's complement
u64        8 bytes
bool       ``u8``, 0 or 1
=========  =====================================  =========================================

A frame whose body ends before its fields are complete, or that has bytes
left over after them, is a :class:`~procgroup.errors.ProtocolError`, as is
an unknown type byte or a message of the wrong direction.

Requests (client -> server) and their responses:

====  ============  ==========================================  ==============================
type  request       body                                        response
====  ============  ==========================================  ==============================
0x01  SET           key, blob value                             OK
0x02  GET           key                                         VALUE, or TIMEOUT([key]) if absent
0x03  ADD           key, i64 amount                             INT (new value)
0x04  COMPARE_SET   key, blob expected, blob desired            VALUE (value after the op)
0x05  WAIT          u64 timeout_ms, keys                        OK when all exist, or
                                                                TIMEOUT(missing) at the timeout
0x06  CHECK         keys                                        BOOL (all exist)
0x07  MULTI_GET     keys                                        VALUES, or TIMEOUT(missing)
0x08  MULTI_SET     keys, blobs (same count)                    OK
0x09  DELETE        key                                         BOOL (existed)
0x0A  NUM_KEYS      (empty)                                     INT
0x0B  PING          (empty)                                     OK
====  ============  ==========================================  ==============================

====  ========  ==================
type  response  body
====  ========  ==================
0x81  OK        (empty)
0x82  VALUE     blob
0x83  INT       i64
0x84  BOOL      bool
0x85  VALUES    blobs
0x86  TIMEOUT   keys (the missing ones)
0x87  ERROR     blob (UTF-8 message)
====  ========  ==================

Notes: GET / MULTI_GET never block on the server; a non-blocking read of an
absent key is a wait with a zero timeout, hence TIMEOUT.  ``timeout_ms =
NO_TIMEOUT`` (2**64 - 1) waits forever.  ADD stores its counter as ASCII
decimal (as torch does), so ``get`` after ``add`` returns e.g. ``b"5"``.
COMPARE_SET follows torch: an absent key with ``expected == b""`` is set to
``desired``; a present key equal to ``expected`` is set to ``desired``; the
reply is the value after the op (for an absent key with a non-empty
``expected``, torch replies ``expected`` and so do we).  Requests on one
connection are answered in order, one at a time.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, Sequence, Union

from ..errors import ConfigError, FrameTooLargeError, ProtocolError

__all__ = [
    "MAX_FRAME",
    "MAX_KEY_LEN",
    "MAX_KEYS",
    "NO_TIMEOUT",
    "HEADER_LEN",
    "NEED_DATA",
    "CLOSED",
    "StoreCodec",
    "encode",
    # requests
    "Set",
    "Get",
    "Add",
    "CompareSet",
    "Wait",
    "Check",
    "MultiGet",
    "MultiSet",
    "DeleteKey",
    "NumKeys",
    "Ping",
    # responses
    "Ok",
    "Value",
    "Int",
    "Bool",
    "Values",
    "Timeout",
    "Error",
    "Request",
    "Response",
    "REQUEST_TYPES",
    "RESPONSE_TYPES",
]

#: Largest frame (type byte + body) either side accepts or produces.
MAX_FRAME = 64 * 1024 * 1024
#: Largest key, in UTF-8 bytes.
MAX_KEY_LEN = 4096
#: Most keys (or values) in one request / response.
MAX_KEYS = 65536
#: ``Wait.timeout_ms`` value meaning "no server-side timeout".
NO_TIMEOUT = 2**64 - 1
HEADER_LEN = 4

_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")


class _Sentinel:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: ``next_event()`` needs more bytes before it can produce an event.
NEED_DATA = _Sentinel("NEED_DATA")
#: The peer closed the connection cleanly, between frames.
CLOSED = _Sentinel("CLOSED")


# ---------------------------------------------------------------- events
# Requests -----------------------------------------------------------------


@dataclass(frozen=True)
class Set:
    key: str
    value: bytes


@dataclass(frozen=True)
class Get:
    key: str


@dataclass(frozen=True)
class Add:
    key: str
    amount: int


@dataclass(frozen=True)
class CompareSet:
    key: str
    expected: bytes
    desired: bytes


@dataclass(frozen=True)
class Wait:
    keys: tuple[str, ...]
    timeout_ms: int = NO_TIMEOUT


@dataclass(frozen=True)
class Check:
    keys: tuple[str, ...]


@dataclass(frozen=True)
class MultiGet:
    keys: tuple[str, ...]


@dataclass(frozen=True)
class MultiSet:
    keys: tuple[str, ...]
    values: tuple[bytes, ...]


@dataclass(frozen=True)
class DeleteKey:
    key: str


@dataclass(frozen=True)
class NumKeys:
    pass


@dataclass(frozen=True)
class Ping:
    pass


# Responses -----------------------------------------------------------------


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Value:
    value: bytes


@dataclass(frozen=True)
class Int:
    value: int


@dataclass(frozen=True)
class Bool:
    value: bool


@dataclass(frozen=True)
class Values:
    values: tuple[bytes, ...]


@dataclass(frozen=True)
class Timeout:
    missing: tuple[str, ...]


@dataclass(frozen=True)
class Error:
    message: str


Request = Union[Set, Get, Add, CompareSet, Wait, Check, MultiGet, MultiSet, DeleteKey, NumKeys, Ping]
Response = Union[Ok, Value, Int, Bool, Values, Timeout, Error]

REQUEST_TYPES: dict[type, int] = {
    Set: 0x01,
    Get: 0x02,
    Add: 0x03,
    CompareSet: 0x04,
    Wait: 0x05,
    Check: 0x06,
    MultiGet: 0x07,
    MultiSet: 0x08,
    DeleteKey: 0x09,
    NumKeys: 0x0A,
    Ping: 0x0B,
}
RESPONSE_TYPES: dict[type, int] = {
    Ok: 0x81,
    Value: 0x82,
    Int: 0x83,
    Bool: 0x84,
    Values: 0x85,
    Timeout: 0x86,
    Error: 0x87,
}
_NAMES = {code: cls.__name__.upper() for cls, code in {**REQUEST_TYPES, **RESPONSE_TYPES}.items()}


# ---------------------------------------------------------------- encoding


class _Writer:
    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def raw(self, b: bytes) -> None:
        self.parts.append(b)
        self.size += len(b)

    def key(self, k: str) -> None:
        if not isinstance(k, str):
            raise TypeError(f"store keys are str, got {type(k).__name__}: {k!r}")
        b = k.encode("utf-8")
        if len(b) > MAX_KEY_LEN:
            raise ConfigError(
                f"store key {k[:64]!r}... is {len(b)} bytes of UTF-8; the limit is {MAX_KEY_LEN}: use a shorter key"
            )
        self.raw(_U16.pack(len(b)))
        self.raw(b)

    def count(self, n: int, what: str) -> None:
        if n > MAX_KEYS:
            raise ConfigError(f"{n} {what} in one store request; the limit is {MAX_KEYS}: split the request")
        self.raw(_U32.pack(n))

    def keys(self, ks: Sequence[str]) -> None:
        self.count(len(ks), "keys")
        for k in ks:
            self.key(k)

    def blob(self, b: bytes) -> None:
        b = bytes(b)
        if len(b) > MAX_FRAME:
            raise ConfigError(f"store value of {len(b)} bytes exceeds the {MAX_FRAME}-byte frame limit")
        self.raw(_U32.pack(len(b)))
        self.raw(b)

    def blobs(self, bs: Sequence[bytes]) -> None:
        self.count(len(bs), "values")
        for b in bs:
            self.blob(b)

    def i64(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or not _I64_MIN <= n <= _I64_MAX:
            raise ConfigError(f"store integer {n!r} does not fit in a signed 64-bit integer")
        self.raw(_I64.pack(n))

    def u64(self, n: int) -> None:
        if not isinstance(n, int) or not 0 <= n <= NO_TIMEOUT:
            raise ConfigError(f"timeout_ms={n!r} must be an integer in [0, 2**64-1]")
        self.raw(_U64.pack(n))


def _encode_body(ev: object, w: _Writer) -> None:
    if isinstance(ev, Set):
        w.key(ev.key)
        w.blob(ev.value)
    elif isinstance(ev, (Get, DeleteKey)):
        w.key(ev.key)
    elif isinstance(ev, Add):
        w.key(ev.key)
        w.i64(ev.amount)
    elif isinstance(ev, CompareSet):
        w.key(ev.key)
        w.blob(ev.expected)
        w.blob(ev.desired)
    elif isinstance(ev, Wait):
        w.u64(ev.timeout_ms)
        w.keys(ev.keys)
    elif isinstance(ev, (Check, MultiGet)):
        w.keys(ev.keys)
    elif isinstance(ev, Timeout):
        w.keys(ev.missing)
    elif isinstance(ev, MultiSet):
        if len(ev.keys) != len(ev.values):
            raise ConfigError(f"multi_set got {len(ev.keys)} keys but {len(ev.values)} values")
        w.keys(ev.keys)
        w.blobs(ev.values)
    elif isinstance(ev, (NumKeys, Ping, Ok)):
        pass
    elif isinstance(ev, Value):
        w.blob(ev.value)
    elif isinstance(ev, Int):
        w.i64(ev.value)
    elif isinstance(ev, Bool):
        w.raw(b"\x01" if ev.value else b"\x00")
    elif isinstance(ev, Values):
        w.blobs(ev.values)
    elif isinstance(ev, Error):
        w.blob(ev.message.encode("utf-8", "replace"))
    else:  # pragma: no cover - guarded by the callers
        raise TypeError(f"not a store protocol event: {ev!r}")


def encode(ev: object) -> bytes:
    """One complete frame for ``ev`` (a request or a response)."""
    code = REQUEST_TYPES.get(type(ev))
    if code is None:
        code = RESPONSE_TYPES.get(type(ev))
    if code is None:
        raise TypeError(f"not a store protocol event: {ev!r}")
    w = _Writer()
    _encode_body(ev, w)
    length = 1 + w.size
    if length > MAX_FRAME:
        raise ConfigError(
            f"store {_NAMES[code]} message of {length} bytes exceeds the {MAX_FRAME}-byte limit; "
            "the store is for small metadata: split the data or send it over a process group"
        )
    return _U32.pack(length) + bytes((code,)) + b"".join(w.parts)


# ---------------------------------------------------------------- decoding


class _Reader:
    __slots__ = ("buf", "pos", "end", "name")

    def __init__(self, buf: memoryview, name: str) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)
        self.name = name

    def _take(self, n: int, what: str) -> memoryview:
        if n > self.end - self.pos:
            raise ProtocolError(
                f"truncated {self.name} frame: {what} needs {n} bytes at offset {self.pos} "
                f"but the frame body has only {self.end - self.pos} left"
            )
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def u8(self, what: str) -> int:
        return self._take(1, what)[0]

    def u16(self, what: str) -> int:
        v: int = _U16.unpack(self._take(2, what))[0]
        return v

    def u32(self, what: str) -> int:
        v: int = _U32.unpack(self._take(4, what))[0]
        return v

    def u64(self, what: str) -> int:
        v: int = _U64.unpack(self._take(8, what))[0]
        return v

    def i64(self, what: str) -> int:
        v: int = _I64.unpack(self._take(8, what))[0]
        return v

    def key(self) -> str:
        n = self.u16("key length")
        if n > MAX_KEY_LEN:
            raise ProtocolError(f"{self.name} frame has a key of {n} bytes; the limit is {MAX_KEY_LEN}")
        raw = self._take(n, "key")
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"{self.name} frame has a key that is not valid UTF-8: {e.reason}") from None

    def count(self, what: str, min_item: int) -> int:
        n = self.u32(f"{what} count")
        if n > MAX_KEYS:
            raise ProtocolError(f"{self.name} frame announces {n} {what}; the limit is {MAX_KEYS}")
        # every item takes at least min_item bytes: reject impossible counts
        # before building anything
        if n * min_item > self.end - self.pos:
            raise ProtocolError(
                f"truncated {self.name} frame: {n} {what} need at least {n * min_item} bytes "
                f"but the frame body has only {self.end - self.pos} left"
            )
        return n

    def keys(self) -> tuple[str, ...]:
        return tuple(self.key() for _ in range(self.count("keys", 2)))

    def blob(self, what: str = "value") -> bytes:
        n = self.u32(f"{what} length")
        return bytes(self._take(n, what))

    def blobs(self) -> tuple[bytes, ...]:
        return tuple(self.blob() for _ in range(self.count("values", 4)))

    def bool(self) -> bool:
        b = self.u8("bool")
        if b > 1:
            raise ProtocolError(f"{self.name} frame has bool byte {b}; expected 0 or 1")
        return b == 1

    def finish(self) -> None:
        if self.pos != self.end:
            raise ProtocolError(f"{self.name} frame has {self.end - self.pos} trailing bytes after its fields")


def _decode(code: int, body: memoryview) -> object:
    r = _Reader(body, _NAMES.get(code, hex(code)))
    ev: object
    if code == 0x01:
        ev = Set(r.key(), r.blob())
    elif code == 0x02:
        ev = Get(r.key())
    elif code == 0x03:
        ev = Add(r.key(), r.i64("amount"))
    elif code == 0x04:
        k = r.key()
        ev = CompareSet(k, r.blob("expected"), r.blob("desired"))
    elif code == 0x05:
        t = r.u64("timeout_ms")
        ev = Wait(r.keys(), t)
    elif code == 0x06:
        ev = Check(r.keys())
    elif code == 0x07:
        ev = MultiGet(r.keys())
    elif code == 0x08:
        ks = r.keys()
        vs = r.blobs()
        if len(ks) != len(vs):
            raise ProtocolError(f"MULTI_SET frame has {len(ks)} keys but {len(vs)} values")
        ev = MultiSet(ks, vs)
    elif code == 0x09:
        ev = DeleteKey(r.key())
    elif code == 0x0A:
        ev = NumKeys()
    elif code == 0x0B:
        ev = Ping()
    elif code == 0x81:
        ev = Ok()
    elif code == 0x82:
        ev = Value(r.blob())
    elif code == 0x83:
        ev = Int(r.i64("integer"))
    elif code == 0x84:
        ev = Bool(r.bool())
    elif code == 0x85:
        ev = Values(r.blobs())
    elif code == 0x86:
        ev = Timeout(r.keys())
    elif code == 0x87:
        ev = Error(str(r.blob("message"), "utf-8", "replace"))
    else:  # pragma: no cover - filtered by the caller
        raise ProtocolError(f"unknown store message type 0x{code:02x}")
    r.finish()
    return ev


_REQUEST_CODES = frozenset(REQUEST_TYPES.values())
_RESPONSE_CODES = frozenset(RESPONSE_TYPES.values())


class StoreCodec:
    """One side of one store connection.

    ``role="server"`` parses requests and encodes responses; ``role="client"``
    the reverse.  Memory is bounded: at most one frame (``<= MAX_FRAME``) plus
    whatever the caller fed since its last :meth:`next_event` call is buffered.
    After a :class:`ProtocolError` the codec is dead (every later call raises
    the same error): the connection must be closed.
    """

    __slots__ = ("role", "_buf", "_pos", "_eof", "_error", "_accept", "_emit", "_need")

    def __init__(self, role: Literal["client", "server"]) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role must be 'client' or 'server', not {role!r}")
        self.role = role
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self._error: ProtocolError | None = None
        self._accept = _REQUEST_CODES if role == "server" else _RESPONSE_CODES
        self._emit = RESPONSE_TYPES if role == "server" else REQUEST_TYPES
        self._need = HEADER_LEN  # bytes needed before next_event can make progress

    # -- input ---------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by :meth:`next_event`."""
        return len(self._buf) - self._pos

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has been received but not all of it."""
        return self.buffered > 0

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed its side (EOF)."""
        if self._eof:
            if data:
                raise RuntimeError("receive_data() after EOF")
            return
        if not data:
            self._eof = True
            return
        self._buf += data

    def eof(self) -> None:
        """Note that the peer closed; raise ProtocolError if it closed mid-frame.

        Complete frames still buffered are not an error (``next_event`` still
        returns them); only a trailing partial frame is.
        """
        self.receive_data(b"")
        pos = self._pos
        n = len(self._buf)
        while pos < n:
            if n - pos < HEADER_LEN:
                break
            length = _U32.unpack_from(self._buf, pos)[0]
            if length > MAX_FRAME or length == 0 or n - pos - HEADER_LEN < length:
                break
            pos += HEADER_LEN + length
        if pos < n:
            raise ProtocolError(self._truncated_msg(pos))

    def _truncated_msg(self, pos: int) -> str:
        have = len(self._buf) - pos
        if have < HEADER_LEN:
            return f"truncated frame: connection closed after {have} of {HEADER_LEN} header bytes"
        length = _U32.unpack_from(self._buf, pos)[0]
        return f"truncated frame: connection closed mid-frame after {have - HEADER_LEN} of {length} announced bytes"

    def next_event(self) -> object:
        """The next complete event, :data:`NEED_DATA`, or :data:`CLOSED` (clean EOF).

        Raises :class:`ProtocolError` for malformed input (and
        :class:`FrameTooLargeError` for an oversize length header, as soon
        as the header arrives) and for EOF in the middle of a frame.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except ProtocolError as e:
            self._error = e
            self._buf = bytearray()
            self._pos = 0
            raise

    def _next(self) -> object:
        buf = self._buf
        pos = self._pos
        have = len(buf) - pos
        if have >= HEADER_LEN:
            length = _U32.unpack_from(buf, pos)[0]
            if length > MAX_FRAME:
                raise FrameTooLargeError(
                    f"store frame header announces {length} bytes; the limit is {MAX_FRAME} "
                    "(is the peer speaking procgroup's store protocol?)"
                )
            if length == 0:
                raise ProtocolError("empty store frame (length 0, no type byte)")
            if have - HEADER_LEN >= length:
                code = buf[pos + HEADER_LEN]
                start = pos + HEADER_LEN + 1
                end = pos + HEADER_LEN + length
                if code not in self._accept:
                    if code in _NAMES:
                        raise ProtocolError(
                            f"unexpected {_NAMES[code]} message (type 0x{code:02x}) sent to the store {self.role}"
                        )
                    raise ProtocolError(f"unknown store message type 0x{code:02x}")
                with memoryview(buf) as mv:
                    body = mv[start:end]
                    try:
                        ev = _decode(code, body)
                    finally:
                        body.release()
                self._consume(end)
                return ev
        if self._eof:
            if have == 0:
                return CLOSED
            raise ProtocolError(self._truncated_msg(pos))
        return NEED_DATA

    def _consume(self, end: int) -> None:
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif end > 65536 and end * 2 > len(self._buf):
            del self._buf[:end]
            self._pos = 0
        else:
            self._pos = end

    # -- output --------------------------------------------------------------

    def send(self, ev: object) -> bytes:
        """Encode ``ev`` (a request for a client codec, a response for a server one)."""
        if type(ev) not in self._emit:
            kind = "response" if self.role == "server" else "request"
            raise TypeError(f"a store {self.role} sends {kind}s, not {ev!r}")
        return encode(ev)
