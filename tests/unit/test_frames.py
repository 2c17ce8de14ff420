"""The sans-IO frame codec, both views: whole, byte by byte, trailing, garbage, oversize, continuation, receive-into."""

from __future__ import annotations

import itertools
import struct
from typing import Dict, List, Optional, Set, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procgroup.errors import FrameTooLargeError, ProtocolError
from procgroup.protocol.frames import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_MORE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    FrameDecoder,
    FrameHeader,
    FrameStart,
    Message,
    MessageEnd,
    decode_header,
    encode_header,
    message_frames,
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
    assert collect(dec, [data[i : i + 1] for i in range(len(data))]) == FRAMES
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


# -- the message view (what the TCP transport's reader runs) -------------------------------------------------------

Msg = Tuple[int, bytes]  # tag, whole payload


def message_stream(msgs: List[Msg], max_frame: int) -> bytes:
    """The bytes a sender with ``max_frame`` puts on the wire for ``msgs`` (split into continuation frames)."""
    out = bytearray()
    for tag, payload in msgs:
        for hdr, off, k in message_frames(tag, len(payload), max_frame):
            out += hdr + payload[off : off + k]
    return bytes(out)


class FakeSocket:
    """``recv_into`` from a byte string, at most ``sizes[i]`` bytes per call (cycling); b"" at the end."""

    def __init__(self, data: bytes, sizes: Optional[List[int]] = None) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.sizes = itertools.cycle(sizes or [1 << 30])
        self.calls = 0

    def recv_into(self, view: memoryview) -> int:
        assert view.nbytes > 0, "the decoder asked for a read of 0 bytes"
        self.calls += 1
        k = min(view.nbytes, next(self.sizes), self.data.nbytes - self.pos)
        view[:k] = self.data[self.pos : self.pos + k]
        self.pos += k
        return k


class Shell:
    """A minimal I/O shell over the message view: one fresh buffer per frame, or ``posted`` buffers by tag."""

    def __init__(self, dec: FrameDecoder, sock: FakeSocket, posted: Optional[Dict[int, bytearray]] = None) -> None:
        self.dec, self.sock = dec, sock
        self.posted = posted or {}
        self.got: List[Msg] = []
        self.fast = 0  # messages delivered as one Message event
        self._parts: List[bytearray] = []
        self._tag = -1

    def step(self) -> bool:
        """Handle one event (or one read); False once the stream closed cleanly."""
        dec = self.dec
        ev = dec.next_event()
        if ev is None:
            dec.buffer_updated(self.sock.recv_into(dec.get_buffer()))
        elif ev is CLOSED:
            return False
        elif isinstance(ev, Message):
            self.got.append((ev.tag, bytes(ev.payload)))
            self.fast += 1
        elif isinstance(ev, FrameStart):
            if ev.offset == 0:
                self._parts, self._tag = [], ev.tag
            assert ev.tag == self._tag and ev.offset == sum(len(p) for p in self._parts)
            dest = self.posted.get(ev.tag)
            if dest is not None:
                dec.set_target(memoryview(dest)[ev.offset : ev.offset + ev.length])
                self._parts.append(bytearray(ev.length))  # placeholder: counts the offset
            else:
                buf = bytearray(ev.length)
                self._parts.append(buf)
                dec.set_target(memoryview(buf))
        else:
            assert isinstance(ev, MessageEnd) and ev.tag == self._tag
            assert ev.nbytes == sum(len(p) for p in self._parts)
            dest = self.posted.get(ev.tag)
            self.got.append((ev.tag, bytes(dest[: ev.nbytes]) if dest is not None else b"".join(self._parts)))
        return True

    def run(self) -> List[Msg]:
        while self.step():
            pass
        return self.got


MSGS: List[Msg] = [(1, b"hello"), (2**63 - 1, b""), (0, bytes(range(256)) * 3), (7, b"x"), (9, b"y" * 5000)]


@pytest.mark.parametrize("max_frame", [1, 100, 4096, DEFAULT_MAX_FRAME_SIZE])
@pytest.mark.parametrize("sizes", [None, [1], [7, 1, 30]], ids=["whole", "byte-by-byte", "ragged"])
def test_messages_whole_and_byte_by_byte(max_frame: int, sizes: Optional[List[int]]) -> None:
    dec = FrameDecoder(max_frame, buffer_size=64)
    assert Shell(dec, FakeSocket(message_stream(MSGS, max_frame), sizes)).run() == MSGS
    assert dec.at_boundary
    dec.close()


def test_messages_small_ones_are_one_event_each() -> None:
    small = [(t, bytes([t]) * t) for t in range(10)]
    sh = Shell(FrameDecoder(), FakeSocket(message_stream(small, 1 << 20)))
    assert sh.run() == small and sh.fast == len(small) and sh.sock.calls == 2  # all of it, then EOF


@pytest.mark.parametrize("cut", [1, 10, 23, 24, 25, 30])
def test_messages_trailing_partial_frame_is_truncation(cut: int) -> None:
    tail = message_stream([(3, b"abcdefgh")], 1 << 20)[:cut]
    dec = FrameDecoder()
    sh = Shell(dec, FakeSocket(message_stream(MSGS, 1 << 20) + tail))
    with pytest.raises(ProtocolError, match="header" if cut < HEADER_SIZE else "payload"):
        sh.run()
    assert sh.got == MSGS
    for call in (dec.next_event, dec.get_buffer, lambda: dec.buffer_updated(1), lambda: dec.set_target(None)):
        with pytest.raises(ProtocolError, match="closed inside"):  # broken for good, whatever the call
            call()
    assert not dec.at_boundary


def test_messages_eof_inside_a_multi_frame_message() -> None:
    data = message_stream([(5, b"0123456789")], 4)
    last_frame = HEADER_SIZE + 2
    dec = FrameDecoder(4)
    with pytest.raises(ProtocolError, match="multi-frame message"):
        Shell(dec, FakeSocket(data[:-last_frame])).run()


def test_messages_continuation_must_keep_its_tag() -> None:
    data = encode_header(5, 2, FLAG_MORE) + b"ab" + encode_header(6, 2) + b"cd"
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="continuation frame with tag 6 inside a message with tag 5"):
        Shell(dec, FakeSocket(data)).run()
    with pytest.raises(ProtocolError, match="continuation"):
        dec.get_buffer()


def test_continuation_frames_report_offsets() -> None:
    dec = FrameDecoder(4)
    data = message_stream([(5, b"0123456789")], 4)
    sock = FakeSocket(data)
    starts = []
    while True:
        ev = dec.next_event()
        if ev is None:
            dec.buffer_updated(sock.recv_into(dec.get_buffer()))
        elif isinstance(ev, FrameStart):
            starts.append(ev)
            dec.set_target(None)
        else:
            assert ev == MessageEnd(5, 10)
            break
    assert starts == [FrameStart(5, 4, True, 0), FrameStart(5, 4, True, 4), FrameStart(5, 2, False, 8)]


def test_receive_into_target_reads_the_payload_straight_into_the_posted_buffer() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = encode_header(42, len(payload)) + payload
    posted = bytearray(len(payload))
    dec = FrameDecoder(buffer_size=1024)
    sock = FakeSocket(data, [70000])  # the first read fills the read buffer: header + 1000 payload bytes
    reads_into_target = 0
    ev = None
    while ev is None or isinstance(ev, FrameStart):
        ev = dec.next_event()
        if isinstance(ev, FrameStart):
            assert ev == FrameStart(42, len(payload), False, 0)
            dec.set_target(memoryview(posted))
            assert dec.payload_left == len(payload) - 1000  # the buffered part was copied once
        elif ev is None:
            view = dec.get_buffer()
            if view.obj is posted:
                reads_into_target += 1
                assert view.nbytes == dec.payload_left  # never more than the frame still needs
            dec.buffer_updated(sock.recv_into(view))
    assert ev == MessageEnd(42, len(payload)) and bytes(posted) == payload
    assert reads_into_target == -(-(len(payload) - 1000) // 70000) and sock.calls == 1 + reads_into_target
    assert dec.target is None  # no export of the caller's buffer is kept


def test_receive_into_posted_buffers_across_continuation_frames() -> None:
    msgs = [(1, b"a" * 10000), (2, b"b" * 3), (1, b"c" * 9000)]
    posted = {1: bytearray(10000)}
    dec = FrameDecoder(4096, buffer_size=512)
    got = Shell(dec, FakeSocket(message_stream(msgs, 4096), [333]), posted).run()
    assert got == msgs  # the posted buffer is reused per message: the second one overwrote a prefix
    assert bytes(posted[1]) == b"c" * 9000 + b"a" * 1000


def test_discard_and_drop_target() -> None:
    dec = FrameDecoder(buffer_size=32)
    data = encode_header(1, 100) + b"x" * 100 + encode_header(2, 3) + b"end"
    sock = FakeSocket(data, [50])
    target = bytearray(100)
    evs: List[object] = []
    while not evs or evs[-1] is not CLOSED:
        ev = dec.next_event()
        if ev is None:
            if dec.payload_left and dec.payload_left < 60:
                dec.drop_target()  # the receive failed meanwhile: the rest of the payload is discarded
            dec.buffer_updated(sock.recv_into(dec.get_buffer()))
            continue
        if isinstance(ev, FrameStart):
            dec.set_target(memoryview(target))
        evs.append(ev if not isinstance(ev, Message) else (ev.tag, bytes(ev.payload)))
    assert evs == [FrameStart(1, 100, False, 0), MessageEnd(1, 100), (2, b"end"), CLOSED]
    assert 0 < target.count(b"x") < 100 and target.count(b"x") + target.count(0) == 100


def test_message_view_misuse_is_a_local_error() -> None:
    dec = FrameDecoder()
    with pytest.raises(RuntimeError, match="none is pending"):
        dec.set_target(None)
    sock = FakeSocket(encode_header(1, 10) + b"0123")
    assert dec.next_event() is None
    dec.buffer_updated(sock.recv_into(dec.get_buffer()))
    ev = dec.next_event()
    assert ev == FrameStart(1, 10, False, 0)
    with pytest.raises(RuntimeError, match="set_target"):
        dec.next_event()
    with pytest.raises(RuntimeError, match="call next_event"):
        dec.get_buffer()
    with pytest.raises(ValueError, match="receive target of 5 bytes"):
        dec.set_target(memoryview(bytearray(5)))
    dec.set_target(None)
    with pytest.raises(ValueError, match="exceeds"):
        dec.buffer_updated(7)
    with pytest.raises(RuntimeError, match="one view per decoder"):
        dec.feed(b"")
    fed = FrameDecoder()
    fed.feed(encode_header(1, 0))
    with pytest.raises(RuntimeError, match="one view per decoder"):
        fed.get_buffer()
    with pytest.raises(ValueError):
        FrameDecoder(buffer_size=HEADER_SIZE - 1)


@pytest.mark.parametrize(
    "bad, match",
    [
        (struct.pack("<HBBIQQ", 0x1234, VERSION, 0, 0, 1, 1), "magic"),
        (struct.pack("<HBBIQQ", MAGIC, VERSION, 0x80, 0, 1, 1), "flags"),
        (struct.pack("<HBBIQQ", MAGIC, VERSION, 0, 0, 1, 1001), "1001 bytes exceeds"),
    ],
)
def test_message_view_garbage_and_oversize(bad: bytes, match: str) -> None:
    dec = FrameDecoder(max_frame_size=1000)
    sh = Shell(dec, FakeSocket(message_stream([(1, b"ok")], 1000) + bad + b"\0" * 40))
    with pytest.raises(ProtocolError, match=match):
        sh.run()
    assert sh.got == [(1, b"ok")]
    with pytest.raises(ProtocolError, match=match):
        dec.buffer_updated(1)


def test_message_frames_split() -> None:
    assert message_frames(3, 0, 10) == [(encode_header(3, 0), 0, 0)]
    assert [(o, k) for _, o, k in message_frames(3, 25, 10)] == [(0, 10), (10, 10), (20, 5)]
    assert [decode_header(h).more for h, _, _ in message_frames(3, 25, 10)] == [True, True, False]
    assert len(message_frames(3, 20, 10)) == 2
    with pytest.raises(ValueError):
        message_frames(3, 1, 0)
    with pytest.raises(ValueError):
        message_frames(2**63, 1, 10)


msgs_st = st.lists(st.tuples(st.integers(0, 2**63 - 1), st.binary(max_size=700)), max_size=10)


@settings(max_examples=200, deadline=None)
@given(
    msgs=msgs_st,
    max_frame=st.sampled_from([1, 3, 24, 100, 1 << 20]),
    sizes=st.lists(st.integers(1, 800), min_size=1, max_size=8),
    buffer_size=st.sampled_from([24, 25, 64, 4096]),
    post=st.sets(st.integers(0, 3)),
)
def test_fuzz_messages_split_anywhere(
    msgs: List[Msg], max_frame: int, sizes: List[int], buffer_size: int, post: Set[int]
) -> None:
    msgs = [(t % 4 if i % 2 else t, p) for i, (t, p) in enumerate(msgs)]  # some tags repeat, some are posted
    posted = {t: bytearray(700) for t in post}
    dec = FrameDecoder(max_frame, buffer_size=buffer_size)
    assert Shell(dec, FakeSocket(message_stream(msgs, max_frame), sizes), posted).run() == msgs
    assert dec.at_boundary


@settings(max_examples=300, deadline=None)
@given(prefix=msgs_st, junk=st.binary(min_size=1, max_size=200), sizes=st.lists(st.integers(1, 64), min_size=1))
def test_fuzz_message_view_garbage_only_raises_protocol_error(prefix: List[Msg], junk: bytes, sizes: List[int]) -> None:
    dec = FrameDecoder(max_frame_size=1 << 16, buffer_size=48)
    try:
        Shell(dec, FakeSocket(message_stream(prefix, 64) + junk, sizes)).run()
    except ProtocolError:
        with pytest.raises(ProtocolError):
            dec.next_event()
