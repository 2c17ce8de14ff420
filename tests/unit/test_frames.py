"""The sans-IO frame codec: whole, byte by byte, trailing, garbage, oversize, and a fuzz."""

from __future__ import annotations

import struct
from typing import List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procgroup.errors import FrameTooLargeError, ProtocolError
from procgroup.protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_MORE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    FrameDecoder,
    FrameHeader,
    decode_header,
    encode_header,
    pack_header_into,
)

Frame = Tuple[int, bytes, int]  # tag, payload, flags


def stream(frames: List[Frame]) -> bytes:
    return b"".join(encode_header(t, len(p), f) + p for t, p, f in frames)


def collect(dec: FrameDecoder, chunks: List[bytes]) -> List[Frame]:
    out: List[Frame] = []
    cur = None
    for c in chunks:
        for ev in dec.feed(c):
            if isinstance(ev, FrameHeader):
                cur = [ev.tag, bytearray(), ev.flags, ev.length]
                out.append(cur)  # type: ignore[arg-type]
            else:
                assert cur is not None
                cur[1] += ev
    return [(t, bytes(p), f) for t, p, f, n in out if len(p) == n] if out else []  # type: ignore[misc]


FRAMES: List[Frame] = [(1, b"hello", 0), (2**63 - 1, b"", 0), (0, bytes(range(256)) * 3, FLAG_MORE), (7, b"x", 0)]


def test_header_layout() -> None:
    assert HEADER_SIZE == 24
    h = encode_header(5, 10)
    assert h == struct.pack("<HBBIQQ", MAGIC, VERSION, 0, 0, 5, 10)
    assert h[:2] == b"PG"
    assert decode_header(h) == FrameHeader(5, 10, 0)
    buf = bytearray(30)
    pack_header_into(buf, 3, 9, 4, FLAG_MORE)
    assert decode_header(buf, 3) == FrameHeader(9, 4, FLAG_MORE) and decode_header(buf, 3).more


def test_whole() -> None:
    assert collect(FrameDecoder(), [stream(FRAMES)]) == FRAMES


def test_byte_by_byte() -> None:
    data = stream(FRAMES)
    dec = FrameDecoder()
    assert collect(dec, [data[i:i + 1] for i in range(len(data))]) == FRAMES
    assert dec.at_boundary and dec.frames == len(FRAMES)
    dec.close()


def test_trailing_partial_header_and_payload() -> None:
    data = stream(FRAMES)
    extra = encode_header(3, 4) + b"ab"
    dec = FrameDecoder()
    got = collect(dec, [data + extra[:10]])
    assert got == FRAMES and not dec.at_boundary
    with pytest.raises(ProtocolError, match="header"):
        dec.close()
    evs = dec.feed(extra[10:])
    assert evs[0] == FrameHeader(3, 4, 0) and bytes(evs[1]) == b"ab" and dec.payload_left == 2
    with pytest.raises(ProtocolError, match="payload"):
        dec.close()
    assert bytes(dec.feed(b"cd")[0]) == b"cd"
    dec.close()


def test_payload_is_not_copied() -> None:
    data = bytearray(encode_header(1, 5) + b"abcde")
    evs = FrameDecoder().feed(data)
    assert isinstance(evs[1], memoryview) and evs[1].obj is data


def test_skip_payload() -> None:
    dec = FrameDecoder()
    (h,) = dec.feed(encode_header(4, 100))
    assert h.length == 100 and dec.payload_left == 100
    dec.skip_payload(60)  # a shell read 60 bytes straight into the user's buffer
    (chunk,) = dec.feed(b"z" * 40)
    assert len(chunk) == 40 and dec.at_boundary
    with pytest.raises(ValueError):
        dec.skip_payload(1)


@pytest.mark.parametrize(
    "bad, match",
    [
        (struct.pack("<HBBIQQ", 0x1234, VERSION, 0, 0, 1, 1), "magic"),
        (struct.pack("<HBBIQQ", MAGIC, 99, 0, 0, 1, 1), "version"),
        (struct.pack("<HBBIQQ", MAGIC, VERSION, 0x80, 0, 1, 1), "flags"),
        (struct.pack("<HBBIQQ", MAGIC, VERSION, 0, 5, 1, 1), "reserved"),
        (struct.pack("<HBBIQQ", MAGIC, VERSION, 0, 0, 2**63, 1), "tag"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
    ],
)
def test_garbage(bad: bytes, match: str) -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=match):
        dec.feed(encode_header(1, 2) + b"ok" + bad)
    with pytest.raises(ProtocolError):  # broken for good
        dec.feed(encode_header(1, 0))
    with pytest.raises(ProtocolError):
        dec.close()


def test_oversize() -> None:
    dec = FrameDecoder(max_frame_size=1000)
    dec.feed(encode_header(1, 1000) + b"\0" * 1000)
    with pytest.raises(FrameTooLargeError, match="1001"):
        dec.feed(HEADER.pack(MAGIC, VERSION, 0, 0, 1, 1001))
    assert issubclass(FrameTooLargeError, ProtocolError)
    with pytest.raises(FrameTooLargeError):
        decode_header(HEADER.pack(MAGIC, VERSION, 0, 0, 1, 2**64 - 1))
    assert DEFAULT_MAX_FRAME_SIZE == 1 << 30


def test_encode_rejects_local_misuse() -> None:
    with pytest.raises(ValueError):
        encode_header(-1, 0)
    with pytest.raises(ValueError):
        encode_header(2**63, 0)
    with pytest.raises(ValueError):
        encode_header(0, 11, max_frame_size=10)
    with pytest.raises(ValueError):
        encode_header(0, 1, flags=0x40)


frames_st = st.lists(
    st.tuples(st.integers(0, 2**63 - 1), st.binary(max_size=300), st.sampled_from([0, FLAG_MORE])), max_size=12
)


@settings(max_examples=200, deadline=None)
@given(frames=frames_st, cuts=st.lists(st.integers(0, 5000), max_size=20))
def test_fuzz_split_anywhere(frames: List[Frame], cuts: List[int]) -> None:
    data = stream(frames)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in zip(points, points[1:])]
    dec = FrameDecoder()
    assert collect(dec, chunks) == frames
    assert dec.at_boundary
    dec.close()


@settings(max_examples=300, deadline=None)
@given(prefix=frames_st, junk=st.binary(min_size=1, max_size=200))
def test_fuzz_garbage_only_raises_protocol_error(prefix: List[Frame], junk: bytes) -> None:
    dec = FrameDecoder(max_frame_size=1 << 16)
    try:
        dec.feed(stream(prefix) + junk)
        dec.close()
    except ProtocolError:
        pass
