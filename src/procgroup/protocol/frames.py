"""Sans-IO frame header codec of the TCP transport.

Every message on a peer connection is one or more *frames*; a frame is a
fixed 24-byte header followed by ``length`` payload bytes::

    offset size field
    0      2    magic    b"PG"
    2      1    version  1
    3      1    flags    bit 0 = MORE: the message continues in the next frame
    4      4    reserved 0
    8      8    tag      u64 < 2**63 (little-endian)
    16     8    length   u64 <= max_frame_size (little-endian)

A message longer than ``max_frame_size`` is split by the sender into frames
with ``MORE`` set on all but the last; the frames of one message are
contiguous on the connection.  The codec never touches payload bytes: the
TCP shell ``recv_into``-s them straight into the posted receive buffer, and
:class:`FrameDecoder` hands them out as zero-copy ``memoryview`` slices of
the bytes it was fed.

Errors are *remote* protocol errors: :class:`~procgroup.errors.ProtocolError`
for garbage (bad magic, version, flags, reserved bits, tag),
:class:`~procgroup.errors.FrameTooLargeError` for a length over the limit.
A connection that produces one is closed.

:class:`FrameDecoder` has two faces over one header parser:

* the *frame* view, :meth:`FrameDecoder.feed`: push bytes, get every
  :class:`FrameHeader` and zero-copy payload slices (used by tools that
  inspect a stream frame by frame);
* the *message* view, the one the TCP transport runs: the I/O shell asks
  :meth:`FrameDecoder.get_buffer` where to ``recv_into`` next, reports the
  count with :meth:`FrameDecoder.buffer_updated` and pulls events with
  :meth:`FrameDecoder.next_event` -- :class:`Message` for a one-frame message
  whose payload is already buffered, :class:`FrameStart` when a frame's
  payload must be placed (the shell answers with
  :meth:`FrameDecoder.set_target`: a slice of the posted receive buffer, a
  fresh buffer, or ``None`` to discard), :class:`MessageEnd` when the last
  frame of a message is in, and :data:`CLOSED` at a clean end of stream.
  Continuation frames are checked here: a frame that continues a message
  must carry its tag, and the stream may not end inside one.
"""

from __future__ import annotations

import struct
from typing import Final, Iterator, List, NamedTuple, Optional, Tuple, Union

from ..errors import FrameTooLargeError, ProtocolError

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "FLAG_MORE",
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameHeader",
    "encode_header",
    "pack_header_into",
    "decode_header",
    "message_frames",
    "FrameDecoder",
    "Message",
    "FrameStart",
    "MessageEnd",
    "ConnectionClosed",
    "CLOSED",
    "Event",
    "DEFAULT_READ_BUFFER",
]

MAGIC = 0x4750  # b"PG" read as little-endian u16
VERSION = 1
FLAG_MORE = 0x01
_KNOWN_FLAGS = FLAG_MORE
_TAG_LIMIT = 1 << 63

#: Default upper bound of one frame's payload (1 GiB); longer messages travel as several frames.
DEFAULT_MAX_FRAME_SIZE = 1 << 30

HEADER = struct.Struct("<HBBIQQ")
HEADER_SIZE = HEADER.size  # 24
_unpack_header = HEADER.unpack_from
assert HEADER_SIZE == 24


#: Size of the decoder's read buffer in the message view (headers and small payloads go through it).
DEFAULT_READ_BUFFER = 64 << 10


class FrameHeader(NamedTuple):
    """One decoded frame header: ``tag``, payload ``length`` and ``flags`` (see the module docstring)."""

    tag: int
    length: int
    flags: int = 0

    @property
    def more(self) -> bool:
        """True when the message continues in the next frame (``FLAG_MORE``)."""
        return bool(self.flags & FLAG_MORE)


class Message(NamedTuple):
    """A whole one-frame message whose payload is buffered: a view into the decoder's read buffer.

    ``payload`` stays valid until the next :meth:`FrameDecoder.get_buffer` call; copy it out before.
    """

    tag: int
    payload: memoryview


class FrameStart(NamedTuple):
    """A frame header whose payload the shell must place: answer with :meth:`FrameDecoder.set_target`.

    ``offset`` counts the payload bytes of the earlier frames of the same message (0 for its first frame);
    ``more`` says that another frame of this message follows this one.
    """

    tag: int
    length: int
    more: bool
    offset: int


class MessageEnd(NamedTuple):
    """The last frame of a message placed with :class:`FrameStart` is complete; ``nbytes`` in all frames."""

    tag: int
    nbytes: int


class ConnectionClosed:
    """The stream ended cleanly, between two messages (the single instance is :data:`CLOSED`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CLOSED"


_tuple_new = tuple.__new__

#: The event that :meth:`FrameDecoder.next_event` returns once the peer closed at a message boundary.
CLOSED: Final = ConnectionClosed()

#: Everything :meth:`FrameDecoder.next_event` returns (None: read more bytes first).
Event = Union[Message, FrameStart, MessageEnd, ConnectionClosed]

# states of the message view
_HEADER = 0  # reading headers through the read buffer
_TARGET = 1  # a FrameStart was returned: waiting for set_target()
_PAYLOAD = 2  # placing the current frame's payload into the target (or discarding it)
_DEAD = 3  # a ProtocolError was raised (self._error): every call raises it again


def encode_header(tag: int, length: int, flags: int = 0, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The 24 header bytes of a frame (local misuse raises ValueError, not ProtocolError)."""
    if not 0 <= tag < _TAG_LIMIT:
        raise ValueError(f"frame tag {tag} is outside [0, 2**63)")
    if not 0 <= length <= max_frame_size:
        raise ValueError(f"frame length {length} is outside [0, {max_frame_size}]")
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown frame flags {flags:#x}")
    return HEADER.pack(MAGIC, VERSION, flags, 0, tag, length)


def pack_header_into(buf: Union[bytearray, memoryview], offset: int, tag: int, length: int, flags: int = 0) -> None:
    """Hot-path variant of :func:`encode_header` into a preallocated buffer (caller validated)."""
    HEADER.pack_into(buf, offset, MAGIC, VERSION, flags, 0, tag, length)


def decode_header(
    buf: Union[bytes, bytearray, memoryview], offset: int = 0, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> FrameHeader:
    """Parse and validate the header at ``buf[offset:offset+24]``."""
    magic, version, flags, reserved, tag, length = HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {magic:#06x} (expected {MAGIC:#06x}): the peer is not speaking procgroup's "
            "transport protocol, or the stream is out of sync"
        )
    if version != VERSION:
        raise ProtocolError(
            f"frame version {version} is not supported (this side speaks version {VERSION}); "
            "run the same procgroup version on every rank"
        )
    if flags & ~_KNOWN_FLAGS or reserved:
        raise ProtocolError(f"frame header has unknown flags {flags:#x} / reserved bits {reserved:#x}")
    if tag >= _TAG_LIMIT:
        raise ProtocolError(f"frame tag {tag} is outside [0, 2**63)")
    if length > max_frame_size:
        raise FrameTooLargeError(
            f"frame of {length} bytes exceeds the maximum frame size of {max_frame_size} bytes "
            "(a corrupt header, or the ranks were configured with different max_frame_size)"
        )
    return FrameHeader(tag, length, flags)


def message_frames(tag: int, nbytes: int, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> List[Tuple[bytes, int, int]]:
    """The frames of one message of ``nbytes`` payload bytes: ``(header, offset, length)`` each, in order.

    Every frame carries at most ``max_frame_size`` bytes, and all but the last have ``FLAG_MORE``; an
    empty message is one empty frame.  ValueError for a bad tag, a negative size or a limit under 1.
    """
    if max_frame_size < 1:
        raise ValueError(f"max_frame_size={max_frame_size} must be >= 1 to split a message")
    if nbytes < 0:
        raise ValueError(f"message size {nbytes} is negative")
    if not 0 <= tag < _TAG_LIMIT:
        raise ValueError(f"frame tag {tag} is outside [0, 2**63)")
    out: List[Tuple[bytes, int, int]] = []
    off = 0
    while True:
        k = min(max_frame_size, nbytes - off)
        more = off + k < nbytes
        out.append((HEADER.pack(MAGIC, VERSION, FLAG_MORE if more else 0, 0, tag, k), off, k))
        off += k
        if not more:
            return out


class FrameDecoder:
    """Incremental, bounded decoder of one connection's frames (see the module docstring for the two views).

    Frame view (push):

    >>> d = FrameDecoder()
    >>> evs = d.feed(encode_header(7, 3) + b"abc")
    >>> evs[0], bytes(evs[1])
    (FrameHeader(tag=7, length=3, flags=0), b'abc')

    :meth:`feed` returns, in stream order, a :class:`FrameHeader` for each
    frame and then its payload as one or more ``memoryview`` slices of the
    fed data (never copied; a zero-length frame yields no chunk).  Only a
    partial *header* is buffered between calls (at most 23 bytes).
    :meth:`skip_payload` lets an I/O shell that read payload bytes directly
    from the socket tell the decoder so; :meth:`close` at EOF raises
    :class:`ProtocolError` when the stream ends inside a frame.

    Message view (pull, the TCP transport's reader)::

        while True:
            ev = dec.next_event()
            if ev is None:                                   # read more
                n = sock.recv_into(dec.get_buffer())
                dec.buffer_updated(n)                        # 0 = EOF
            elif isinstance(ev, FrameStart):                 # place this frame's payload
                dec.set_target(dest[ev.offset:ev.offset + ev.length])   # or None: discard it
            ...                                              # Message, MessageEnd, CLOSED

    Headers go through a read buffer of ``buffer_size`` bytes; a frame's
    payload is read straight into the target the shell gave (after the part
    that was already buffered, which is copied once), so a large payload
    lands in the posted receive buffer with no intermediate copy.  Memory is
    bounded: the read buffer, plus nothing per frame (``length`` is checked
    against ``max_frame_size`` before it is used).

    After a :class:`ProtocolError` the decoder is broken, in both views:
    every later call raises the same error.  Use one view per decoder.
    Not thread-safe: one reader drives it.
    """

    __slots__ = (
        "max_frame_size",
        "buffer_size",
        "_hdr",
        "_payload_left",
        "_error",
        "_frames",
        "_buf",
        "_mv",
        "_start",
        "_end",
        "_state",
        "_eof",
        "_target",
        "_tpos",
        "_cur_tag",
        "_cur_len",
        "_cur_more",
        "_msg_tag",
        "_msg_total",
    )

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *, buffer_size: int = DEFAULT_READ_BUFFER) -> None:
        """A decoder at the start of a stream; ValueError for a negative limit or a buffer under one header."""
        if max_frame_size < 0:
            raise ValueError("max_frame_size must be >= 0")
        if buffer_size < HEADER_SIZE:
            raise ValueError(f"buffer_size must be >= {HEADER_SIZE} (one frame header)")
        self.max_frame_size = max_frame_size
        self.buffer_size = buffer_size
        self._hdr = bytearray()
        self._payload_left = 0
        self._error: Optional[ProtocolError] = None
        self._frames = 0
        # message view
        self._buf: Optional[bytearray] = None  # allocated by the first get_buffer()
        self._mv = memoryview(b"")
        self._start = 0  # first unparsed byte of the read buffer
        self._end = 0  # end of the bytes read into it
        self._state = _HEADER
        self._eof = False
        self._target: Optional[memoryview] = None
        self._tpos = 0
        self._cur_tag = 0
        self._cur_len = 0
        self._cur_more = False
        self._msg_tag: Optional[int] = None  # tag of the message whose next frame must follow (MORE was set)
        self._msg_total = 0

    @property
    def payload_left(self) -> int:
        """Payload bytes of the current frame not yet fed (frame view) or placed (message view)."""
        return self._payload_left

    @property
    def at_boundary(self) -> bool:
        """True between frames (frame view) or between messages (message view): a clean place to end."""
        return (
            self._payload_left == 0
            and not self._hdr
            and self._start == self._end
            and self._msg_tag is None
            and self._state == _HEADER
        )

    @property
    def frames(self) -> int:
        """How many headers were decoded so far."""
        return self._frames

    # -- frame view -------------------------------------------------------------------------------
    def feed(self, data: Union[bytes, bytearray, memoryview]) -> List[Union[FrameHeader, memoryview]]:
        """Decode ``data``; returns the events it completes (see the class docstring).

        Raises :class:`ProtocolError` on garbage (and from then on), RuntimeError if the message view is in use.
        """
        if self._buf is not None:
            raise RuntimeError("feed() on a FrameDecoder driven through get_buffer(): use one view per decoder")
        return list(self._feed(data))

    def _feed(self, data: Union[bytes, bytearray, memoryview]) -> Iterator[Union[FrameHeader, memoryview]]:
        if self._error is not None:
            raise self._error
        mv = data if isinstance(data, memoryview) else memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        pos, n = 0, len(mv)
        while pos < n:
            if self._payload_left:
                k = min(self._payload_left, n - pos)
                self._payload_left -= k
                yield mv[pos : pos + k]
                pos += k
                continue
            need = HEADER_SIZE - len(self._hdr)
            if self._hdr or n - pos < HEADER_SIZE:
                take = min(need, n - pos)
                self._hdr += mv[pos : pos + take]
                pos += take
                if len(self._hdr) < HEADER_SIZE:
                    return
                src: Union[bytearray, memoryview] = self._hdr
                off = 0
            else:
                src, off = mv, pos
                pos += HEADER_SIZE
            h = self._decode(src, off)
            self._hdr = bytearray()
            self._payload_left = h.length
            yield h

    def skip_payload(self, n: int) -> None:
        """Account for ``n`` payload bytes of the current frame read outside :meth:`feed` (ValueError if too many)."""
        if n < 0 or n > self._payload_left:
            raise ValueError(f"cannot skip {n} payload bytes: {self._payload_left} left in the frame")
        self._payload_left -= n

    def close(self) -> None:
        """Declare EOF; raises ProtocolError if the stream stopped inside a frame (or a multi-frame message)."""
        if self._error is not None:
            raise self._error
        if self._hdr or self._end - self._start:
            raise ProtocolError(
                f"connection closed inside a frame header "
                f"({len(self._hdr) or self._end - self._start}/{HEADER_SIZE} bytes)"
            )
        if self._payload_left or self._state == _TARGET:
            raise ProtocolError(f"connection closed inside a frame payload ({self._payload_left} bytes missing)")
        if self._msg_tag is not None and (self._state == _HEADER or self._cur_more):
            raise ProtocolError("connection closed inside a multi-frame message")

    def _decode(self, src: Union[bytearray, memoryview], off: int) -> FrameHeader:
        try:
            h = decode_header(src, off, self.max_frame_size)
        except ProtocolError as e:
            self._error = e
            self._state = _DEAD
            raise
        self._frames += 1
        return h

    def _fail(self, err: ProtocolError) -> ProtocolError:
        self._error = err
        self._state = _DEAD
        return err

    # -- message view -----------------------------------------------------------------------------
    def next_event(self) -> Optional[Event]:
        """The next event of the stream, or None when more bytes must be read first (see the class docstring).

        Raises :class:`ProtocolError` for garbage, an oversized frame, or a continuation frame with
        another tag than its message; RuntimeError when a :class:`FrameStart` still awaits :meth:`set_target`.
        """
        st = self._state
        if st == _PAYLOAD and self._payload_left:  # hot: a payload is being read (a dead decoder is _DEAD)
            return None
        if self._error is not None:
            raise self._error
        while True:
            st = self._state
            if st == _HEADER:
                start, end = self._start, self._end
                if end - start < HEADER_SIZE:
                    return CLOSED if self._eof else None
                magic, version, flags, reserved, tag, length = _unpack_header(self._mv, start)
                if (
                    magic != MAGIC
                    or version != VERSION
                    or flags & ~_KNOWN_FLAGS
                    or reserved
                    or tag >= _TAG_LIMIT
                    or length > self.max_frame_size
                ):
                    self._decode(self._mv, start)  # raises the precise ProtocolError
                    raise AssertionError("decode_header() accepted a header that the fast check refused")
                self._frames += 1
                start += HEADER_SIZE
                more = flags & FLAG_MORE
                mt = self._msg_tag
                if mt is None:
                    if not more and end - start >= length:  # the common small message: one event, no target
                        self._start = start + length
                        return _tuple_new(Message, (tag, self._mv[start : start + length]))  # Message(), minus a frame
                    self._msg_tag = tag
                elif tag != mt:
                    raise self._fail(ProtocolError(f"continuation frame with tag {tag} inside a message with tag {mt}"))
                self._start = start
                self._cur_tag, self._cur_len, self._cur_more = tag, length, bool(more)
                self._state = _TARGET
                return FrameStart(tag, length, bool(more), self._msg_total)
            if st == _PAYLOAD:
                if self._payload_left:
                    return None
                self._target = None  # keep no export of the shell's buffer
                self._state = _HEADER
                self._msg_total += self._cur_len
                if self._cur_more:
                    continue
                tag, total = self._cur_tag, self._msg_total
                self._msg_tag = None
                self._msg_total = 0
                return MessageEnd(tag, total)
            raise RuntimeError("answer the FrameStart with set_target() before asking for the next event")

    def set_target(self, target: Optional[memoryview]) -> None:
        """Answer a :class:`FrameStart`: its payload goes to the first ``length`` bytes of ``target``.

        ``target`` is a writable byte view of at least ``length`` bytes (a slice of the posted receive buffer,
        or a fresh buffer), or None to discard the payload.  The part already buffered is copied now; the
        rest is read straight into ``target`` through :meth:`get_buffer`.  RuntimeError when no FrameStart
        is pending, ValueError when ``target`` is too small.
        """
        if self._state != _TARGET:
            if self._error is not None:
                raise self._error
            raise RuntimeError("set_target() answers a FrameStart, and none is pending")
        length = self._cur_len
        if target is not None and target.nbytes < length:
            raise ValueError(f"receive target of {target.nbytes} bytes for a frame payload of {length} bytes")
        start = self._start
        avail = min(self._end - start, length)
        if avail:
            if target is not None:
                target[:avail] = self._mv[start : start + avail]
            self._start = start + avail
        self._target = target
        self._tpos = avail
        self._payload_left = length - avail
        self._state = _PAYLOAD

    def drop_target(self) -> None:
        """Discard the rest of the current frame's payload instead of writing it to the target.

        For a shell whose receive failed meanwhile (abort, close): the caller's buffer is its own again.
        No-op outside a payload.
        """
        if self._state == _PAYLOAD:
            self._target = None

    @property
    def target(self) -> Optional[memoryview]:
        """Where the current frame's payload goes (None: discarded, or no frame in progress)."""
        return self._target

    def get_buffer(self) -> memoryview:
        """Where the shell's next ``recv_into`` must write: the target's unfilled part, or the read buffer.

        Call it only after :meth:`next_event` returned None, then report with :meth:`buffer_updated`.
        The returned view is never longer than what the current frame still needs (payload) or than the
        read buffer's free space (headers).  RuntimeError when an event is still pending.
        """
        st = self._state
        if st == _PAYLOAD and self._payload_left:  # hot: a payload is being read (a dead decoder is _DEAD)
            t = self._target
            if t is not None:
                p = self._tpos
                return t[p : p + self._payload_left]
            self._start = self._end = 0  # discarding: read into the (empty) read buffer, then forget
            return self._mv[: min(self.buffer_size, self._payload_left)]
        if self._error is not None:
            raise self._error
        if st != _HEADER or self._eof:
            raise RuntimeError("get_buffer() while an event is pending: call next_event() first")
        buf = self._buf
        if buf is None:
            if self._frames or self._hdr or self._payload_left:
                raise RuntimeError("get_buffer() on a FrameDecoder fed through feed(): use one view per decoder")
            buf = self._buf = bytearray(self.buffer_size)
            self._mv = memoryview(buf)
        start, end = self._start, self._end
        if start:  # move the partial header (< 24 bytes) to the front
            n = end - start
            if n:
                self._mv[:n] = self._mv[start:end]
            self._start = 0
            self._end = end = n
        return self._mv[end:]

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the last :meth:`get_buffer` view; 0 means the peer closed the stream.

        At EOF inside a frame header, a frame payload or a multi-frame message this raises
        :class:`ProtocolError`; at a message boundary :meth:`next_event` then returns :data:`CLOSED`.
        """
        left = self._payload_left
        if 0 < nbytes <= left and self._state == _PAYLOAD:  # hot: payload bytes (a dead decoder is _DEAD)
            self._payload_left = left - nbytes
            if self._target is not None:
                self._tpos += nbytes
            return
        if self._error is not None:
            raise self._error
        if nbytes == 0:
            if self._state == _PAYLOAD and self._payload_left:
                got = self._cur_len - self._payload_left
                msg = f"connection closed inside a frame payload ({got}/{self._cur_len} bytes)"
                raise self._fail(ProtocolError(msg))
            if self._end - self._start:
                n = self._end - self._start
                raise self._fail(ProtocolError(f"connection closed inside a frame header ({n}/{HEADER_SIZE} bytes)"))
            if self._msg_tag is not None:
                raise self._fail(ProtocolError("connection closed inside a multi-frame message"))
            self._eof = True
            return
        if nbytes < 0:
            raise ValueError(f"buffer_updated({nbytes}): a byte count is >= 0")
        if self._state == _PAYLOAD and self._payload_left:
            if nbytes > self._payload_left:
                raise ValueError(f"buffer_updated({nbytes}) exceeds the {self._payload_left} bytes asked for")
            self._payload_left -= nbytes
            if self._target is not None:
                self._tpos += nbytes
            return
        if self._end + nbytes > self.buffer_size:
            raise ValueError(f"buffer_updated({nbytes}) exceeds the read buffer's free space")
        self._end += nbytes
