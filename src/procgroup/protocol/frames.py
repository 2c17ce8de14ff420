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
"""

from __future__ import annotations

import struct
from typing import Iterator, List, NamedTuple, Optional, Union

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
    "FrameDecoder",
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
assert HEADER_SIZE == 24


class FrameHeader(NamedTuple):
    tag: int
    length: int
    flags: int = 0

    @property
    def more(self) -> bool:
        return bool(self.flags & FLAG_MORE)


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


def decode_header(buf: Union[bytes, bytearray, memoryview], offset: int = 0, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> FrameHeader:
    """Parse and validate the header at ``buf[offset:offset+24]``."""
    magic, version, flags, reserved, tag, length = HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad frame magic {magic:#06x} (expected {MAGIC:#06x}): the peer is not speaking procgroup's "
            "transport protocol, or the stream is out of sync"
        )
    if version != VERSION:
        raise ProtocolError(f"frame version {version} is not supported (this side speaks version {VERSION}); "
                            "run the same procgroup version on every rank")
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


class FrameDecoder:
    """Incremental decoder: feed bytes, get headers and zero-copy payload chunks.

    >>> d = FrameDecoder()
    >>> evs = d.feed(encode_header(7, 3) + b"abc")
    >>> evs[0], bytes(evs[1])
    (FrameHeader(tag=7, length=3, flags=0), b'abc')

    :meth:`feed` returns, in stream order, a :class:`FrameHeader` for each
    frame and then its payload as one or more ``memoryview`` slices of the
    fed data (never copied; a zero-length frame yields no chunk).  Only a
    partial *header* is buffered between calls (at most 23 bytes).  After an
    error the decoder is broken: every later call raises the same error.

    :meth:`skip_payload` lets an I/O shell that read payload bytes directly
    from the socket tell the decoder so; :meth:`close` at EOF raises
    :class:`ProtocolError` when the stream ends inside a frame.
    """

    __slots__ = ("max_frame_size", "_hdr", "_payload_left", "_error", "_frames")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size < 0:
            raise ValueError("max_frame_size must be >= 0")
        self.max_frame_size = max_frame_size
        self._hdr = bytearray()
        self._payload_left = 0
        self._error: Optional[ProtocolError] = None
        self._frames = 0

    @property
    def payload_left(self) -> int:
        """Payload bytes of the current frame not yet fed."""
        return self._payload_left

    @property
    def at_boundary(self) -> bool:
        """True between frames (a clean place for the stream to end)."""
        return self._payload_left == 0 and not self._hdr

    @property
    def frames(self) -> int:
        """How many headers were decoded so far."""
        return self._frames

    def feed(self, data: Union[bytes, bytearray, memoryview]) -> List[Union[FrameHeader, memoryview]]:
        """Decode ``data``; returns the events it completes (see the class docstring)."""
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
                yield mv[pos:pos + k]
                pos += k
                continue
            need = HEADER_SIZE - len(self._hdr)
            if self._hdr or n - pos < HEADER_SIZE:
                take = min(need, n - pos)
                self._hdr += mv[pos:pos + take]
                pos += take
                if len(self._hdr) < HEADER_SIZE:
                    return
                src: Union[bytearray, memoryview] = self._hdr
                off = 0
            else:
                src, off = mv, pos
                pos += HEADER_SIZE
            try:
                h = decode_header(src, off, self.max_frame_size)
            except ProtocolError as e:
                self._error = e
                raise
            self._hdr = bytearray()
            self._payload_left = h.length
            self._frames += 1
            yield h

    def skip_payload(self, n: int) -> None:
        """Account for ``n`` payload bytes of the current frame read outside :meth:`feed`."""
        if n < 0 or n > self._payload_left:
            raise ValueError(f"cannot skip {n} payload bytes: {self._payload_left} left in the frame")
        self._payload_left -= n

    def close(self) -> None:
        """Declare EOF; raises ProtocolError if the stream stopped inside a frame."""
        if self._error is not None:
            raise self._error
        if self._hdr:
            raise ProtocolError(f"connection closed inside a frame header ({len(self._hdr)}/{HEADER_SIZE} bytes)")
        if self._payload_left:
            raise ProtocolError(f"connection closed inside a frame payload ({self._payload_left} bytes missing)")
