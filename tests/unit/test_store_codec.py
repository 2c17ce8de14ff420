"""Tests for the sans-IO store codec (procgroup.protocol.store_codec)."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from procgroup.errors import ConfigError, FrameTooLargeError, ProtocolError
from procgroup.protocol import store_codec as sc
from procgroup.protocol.store_codec import (
    CLOSED,
    MAX_FRAME,
    MAX_KEY_LEN,
    MAX_KEYS,
    NEED_DATA,
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
    Set,
    StoreCodec,
    Timeout,
    Value,
    Values,
    Wait,
)

REQUESTS = [
    Set("key", b"value"),
    Set("", b""),
    Set("ключ/ü/🔑", bytes(range(256))),
    Get("a/b"),
    Add("counter", 1),
    Add("counter", -(2**63)),
    Add("counter", 2**63 - 1),
    CompareSet("k", b"", b"desired"),
    CompareSet("k", b"old", b""),
    Wait(("a", "b", "c"), 1500),
    Wait((), 0),
    Wait(("x",), NO_TIMEOUT),
    Check(("a",)),
    Check(()),
    MultiGet(("a", "b")),
    MultiSet(("a", "b"), (b"1", b"22")),
    MultiSet((), ()),
    DeleteKey("gone"),
    NumKeys(),
    Ping(),
]

RESPONSES = [
    Ok(),
    Value(b""),
    Value(b"\x00" * 1000),
    Int(0),
    Int(-1),
    Int(2**63 - 1),
    Bool(True),
    Bool(False),
    Values(()),
    Values((b"a", b"", b"ccc")),
    Timeout(("missing/1", "missing/2")),
    Error("key 'x' holds b'abc', not an integer"),
    Error(""),
]

CASES = [("client", "server", ev) for ev in REQUESTS] + [("server", "client", ev) for ev in RESPONSES]
IDS = [f"{type(ev).__name__}-{i}" for i, (_, _, ev) in enumerate(CASES)]


def drain(codec: StoreCodec) -> list:
    out = []
    while True:
        ev = codec.next_event()
        if ev is NEED_DATA or ev is CLOSED:
            return out
        out.append(ev)


def frame(code: int, body: bytes) -> bytes:
    return struct.pack(">I", 1 + len(body)) + bytes((code,)) + body


def key(k: bytes) -> bytes:
    return struct.pack(">H", len(k)) + k


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_roundtrip_whole(sender, receiver, ev):
    data = StoreCodec(sender).send(ev)
    rx = StoreCodec(receiver)
    rx.receive_data(data)
    assert rx.next_event() == ev
    assert rx.next_event() is NEED_DATA
    rx.eof()
    assert rx.next_event() is CLOSED


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_roundtrip_byte_by_byte(sender, receiver, ev):
    data = StoreCodec(sender).send(ev)
    rx = StoreCodec(receiver)
    for i in range(len(data) - 1):
        rx.receive_data(data[i : i + 1])
        assert rx.next_event() is NEED_DATA
        assert rx.mid_frame
    rx.receive_data(data[-1:])
    assert rx.next_event() == ev
    assert not rx.mid_frame


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_roundtrip_with_partial_next_frame(sender, receiver, ev):
    tx = StoreCodec(sender)
    data = tx.send(ev)
    nxt = tx.send(Ping() if sender == "client" else Ok())
    rx = StoreCodec(receiver)
    rx.receive_data(data + data + nxt[:3])
    assert rx.next_event() == ev
    assert rx.next_event() == ev
    assert rx.next_event() is NEED_DATA
    rx.receive_data(nxt[3:])
    assert rx.next_event() == (Ping() if sender == "client" else Ok())
    assert rx.next_event() is NEED_DATA


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_roundtrip_then_garbage(sender, receiver, ev):
    data = StoreCodec(sender).send(ev)
    rx = StoreCodec(receiver)
    rx.receive_data(data + b"\x00\x00\x00\x05GARBAGE-AFTER")
    assert rx.next_event() == ev
    with pytest.raises(ProtocolError, match="unknown store message type 0x47"):
        rx.next_event()
    # the codec is dead after a protocol error
    with pytest.raises(ProtocolError):
        rx.next_event()


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_truncated_at_eof(sender, receiver, ev):
    data = StoreCodec(sender).send(ev)
    for cut in {1, 3, 4, len(data) - 1}:
        rx = StoreCodec(receiver)
        rx.receive_data(data[:cut])
        assert rx.next_event() is NEED_DATA
        with pytest.raises(ProtocolError, match="truncated"):
            rx.eof()
        with pytest.raises(ProtocolError, match="truncated"):
            rx.next_event()


@pytest.mark.parametrize("sender,receiver,ev", CASES, ids=IDS)
def test_every_cut_inside_frame_is_protocol_error(sender, receiver, ev):
    """Shrinking the length header (fields truncated inside a complete frame) or growing it
    (trailing bytes inside the frame) is always a ProtocolError, never a wrong event."""
    data = StoreCodec(sender).send(ev)
    body = data[4:]
    if len(body) > 1:
        rx = StoreCodec(receiver)
        rx.receive_data(struct.pack(">I", len(body) - 1) + body[:-1])
        with pytest.raises(ProtocolError, match="truncated|trailing"):
            rx.next_event()
    rx = StoreCodec(receiver)
    rx.receive_data(struct.pack(">I", len(body) + 1) + body + b"\x00")
    with pytest.raises(ProtocolError, match="trailing"):
        rx.next_event()


def test_eof_between_frames_is_clean():
    rx = StoreCodec("server")
    rx.receive_data(StoreCodec("client").send(Ping()))
    rx.eof()  # a complete frame buffered is not an error
    assert rx.next_event() == Ping()
    assert rx.next_event() is CLOSED
    rx2 = StoreCodec("server")
    rx2.receive_data(b"")
    assert rx2.next_event() is CLOSED


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("header", [MAX_FRAME + 1, 2**32 - 1, 2**31])
def test_oversize_header_rejected_from_header_alone(header):
    rx = StoreCodec("server")
    rx.receive_data(struct.pack(">I", header))
    with pytest.raises(FrameTooLargeError, match=str(MAX_FRAME)):
        rx.next_event()


def test_max_frame_header_is_accepted_while_incomplete():
    rx = StoreCodec("server")
    rx.receive_data(struct.pack(">I", MAX_FRAME) + b"\x01")
    assert rx.next_event() is NEED_DATA


BAD_FRAMES = {
    "empty frame": (b"\x00\x00\x00\x00", "empty"),
    "unknown type": (frame(0x42, b""), "unknown store message type 0x42"),
    "response sent to server": (frame(0x81, b""), "unexpected OK"),
    "truncated key": (frame(0x02, struct.pack(">H", 10) + b"abc"), "truncated GET"),
    "truncated key length": (frame(0x02, b"\x00"), "truncated GET"),
    "truncated value": (frame(0x01, key(b"k") + struct.pack(">I", 100) + b"x"), "truncated SET"),
    "missing amount": (frame(0x03, key(b"k") + b"\x00\x00"), "truncated ADD"),
    "trailing bytes": (frame(0x0B, b"\x00"), "trailing"),
    "trailing after key": (frame(0x09, key(b"k") + b"zz"), "trailing"),
    "bad utf8 key": (frame(0x02, key(b"\xff\xfe")), "UTF-8"),
    "key too long": (frame(0x02, key(b"a" * (MAX_KEY_LEN + 1))), "limit is 4096"),
    "too many keys": (frame(0x06, struct.pack(">I", MAX_KEYS + 1)), "limit is 65536"),
    "impossible key count": (frame(0x06, struct.pack(">I", 1000) + key(b"a")), "truncated CHECK"),
    "multi_set count mismatch": (
        frame(0x08, struct.pack(">I", 1) + key(b"a") + struct.pack(">I", 0)),
        "1 keys but 0 values",
    ),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_malformed_request(name):
    data, match = BAD_FRAMES[name]
    rx = StoreCodec("server")
    rx.receive_data(data)
    with pytest.raises(ProtocolError, match=match):
        rx.next_event()


def test_malformed_responses():
    for data, match in [
        (frame(0x84, b"\x02"), "bool byte 2"),
        (frame(0x01, b""), "unexpected SET"),
        (frame(0x85, struct.pack(">I", 3)), "truncated VALUES"),
        (frame(0x83, b"\x00" * 7), "truncated INT"),
    ]:
        rx = StoreCodec("client")
        rx.receive_data(data)
        with pytest.raises(ProtocolError, match=match):
            rx.next_event()


def test_error_message_bad_utf8_is_replaced_not_fatal():
    rx = StoreCodec("client")
    rx.receive_data(frame(0x87, struct.pack(">I", 2) + b"\xff!"))
    assert rx.next_event() == Error("\ufffd!")


# ---------------------------------------------------------------- encoding limits


def test_send_validates():
    c = StoreCodec("client")
    with pytest.raises(ConfigError, match="limit is 4096"):
        c.send(Get("x" * (MAX_KEY_LEN + 1)))
    c.send(Get("x" * MAX_KEY_LEN))
    with pytest.raises(ConfigError, match="signed 64-bit"):
        c.send(Add("k", 2**63))
    with pytest.raises(ConfigError, match="3 keys but 2 values"):
        c.send(MultiSet(("a", "b", "c"), (b"", b"")))
    with pytest.raises(ConfigError, match="split"):
        c.send(Check(tuple("k" for _ in range(MAX_KEYS + 1))))
    with pytest.raises(TypeError, match="sends requests"):
        c.send(Ok())
    with pytest.raises(TypeError, match="sends responses"):
        StoreCodec("server").send(Ping())
    with pytest.raises(TypeError, match="keys are str"):
        c.send(Get(b"bytes-key"))  # type: ignore[arg-type]


def test_send_rejects_frame_over_limit():
    with pytest.raises(ConfigError, match="exceeds"):
        StoreCodec("client").send(MultiSet(("a", "b"), (b"x" * (MAX_FRAME // 2), b"y" * (MAX_FRAME // 2))))


def test_large_value_roundtrip_in_chunks():
    ev = Set("big", bytes(range(256)) * 40_000)  # ~10 MB
    data = StoreCodec("client").send(ev)
    rx = StoreCodec("server")
    for i in range(0, len(data), 65536):
        assert rx.next_event() is NEED_DATA
        rx.receive_data(data[i : i + 65536])
    assert rx.next_event() == ev


def test_many_small_frames_in_one_buffer():
    tx = StoreCodec("client")
    evs = [Add(f"k{i}", i) for i in range(5000)]
    rx = StoreCodec("server")
    rx.receive_data(b"".join(tx.send(e) for e in evs))
    assert drain(rx) == evs
    assert rx.buffered == 0


# ---------------------------------------------------------------- fuzzing

CODES = sorted(set(sc.REQUEST_TYPES.values()) | set(sc.RESPONSE_TYPES.values()))


def _feed_all(role: str, data: bytes, chunks: list[int]) -> None:
    rx = StoreCodec(role)
    pos = 0
    try:
        for n in chunks + [len(data)]:
            rx.receive_data(data[pos : pos + n])
            pos += n
            for ev in drain(rx):
                assert type(ev) in (sc.REQUEST_TYPES if role == "server" else sc.RESPONSE_TYPES)
            assert rx.buffered <= len(data)
            if pos >= len(data):
                break
        rx.eof()
        drain(rx)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    role=st.sampled_from(["client", "server"]),
    data=st.binary(max_size=512),
    chunks=st.lists(st.integers(1, 64), max_size=20),
)
def test_fuzz_random_bytes(role, data, chunks):
    _feed_all(role, data, chunks)


@st.composite
def framed_garbage(draw):
    """Well-formed frame headers with random type bytes and bodies: reaches the field parsers."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        code = draw(st.sampled_from(CODES + [0, 0x42, 0xFF]))
        body = draw(st.binary(max_size=64))
        if draw(st.booleans()):
            # plausible field prefixes with huge lengths / counts
            body = draw(st.sampled_from([b"\xff\xff", b"\xff\xff\xff\xff", b"\x00\x01", b"\x00\x00\x00\x02"])) + body
        out += frame(code, body)
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    role=st.sampled_from(["client", "server"]), data=framed_garbage(), chunks=st.lists(st.integers(1, 16), max_size=10)
)
def test_fuzz_framed_garbage(role, data, chunks):
    _feed_all(role, data, chunks)


@settings(max_examples=200, deadline=None)
@given(
    idx=st.integers(0, len(CASES) - 1),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4),
)
def test_fuzz_mutated_valid_frames(idx, flips):
    sender, receiver, ev = CASES[idx]
    data = bytearray(StoreCodec(sender).send(ev))
    for pos, val in flips:
        data[pos % len(data)] = val
    _feed_all(receiver, bytes(data), [])


def test_hostile_headers_never_allocate_beyond_bound():
    """Huge announced lengths and counts inside small frames are refused without allocating."""
    hostile = [
        struct.pack(">I", 2**32 - 1),
        frame(0x06, struct.pack(">I", MAX_KEYS)),  # 65536 keys announced, none present
        frame(0x08, struct.pack(">I", MAX_KEYS) + key(b"a")),
        frame(0x01, key(b"k") + struct.pack(">I", 2**32 - 1)),  # value length 4 GiB
        frame(0x85, struct.pack(">I", MAX_KEYS)),
        frame(0x02, struct.pack(">H", 0xFFFF)),
    ]
    tracemalloc.start()
    try:
        for data in hostile:
            for role in ("server", "client"):
                rx = StoreCodec(role)
                rx.receive_data(data)
                tracemalloc.reset_peak()
                with pytest.raises(ProtocolError):
                    rx.next_event()
                _, peak = tracemalloc.get_traced_memory()
                assert peak < 64 * 1024, (data[:16], role, peak)
    finally:
        tracemalloc.stop()
