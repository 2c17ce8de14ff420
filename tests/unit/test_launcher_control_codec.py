"""The launcher's control-link codec (procgroup.protocol.control): every case whole, byte by byte,
and with trailing data; malformed input; hypothesis round-trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procgroup.errors import ProtocolError
from procgroup.protocol.control import (
    MAX_LINE,
    ControlDecoder,
    ControlMessageError,
    Hello,
    PortAnnounce,
    Report,
    Usr1,
    decode_line,
    decode_pids,
    decode_record,
    encode,
    encode_pids,
    encode_record,
)

CASES = [
    Hello(secret="ab" * 32, nonce="0123456789abcdef"),
    Usr1(),
    PortAnnounce(port=29500),
    Report(node=1, host="h1", exit_code=3, result={"workers": [{"rank": 0, "returncode": 3}], "run_id": "x"}),
    Report(node=None, host="ünïcode-host", exit_code=0, result={}),
]


def _feed_whole(data: bytes) -> list:
    d = ControlDecoder()
    d.receive_data(data)
    out = []
    while (m := d.next_message()) is not None:
        out.append(m)
    d.eof()
    return out


def _feed_bytewise(data: bytes) -> list:
    d = ControlDecoder()
    out = []
    for i in range(len(data)):
        d.receive_data(data[i : i + 1])
        while (m := d.next_message()) is not None:
            out.append(m)
    d.eof()
    return out


@pytest.mark.parametrize("msg", CASES, ids=lambda m: type(m).__name__)
def test_each_message_whole_and_byte_by_byte(msg):
    wire = encode(msg)
    assert wire.endswith(b"\n") and wire.count(b"\n") == 1
    assert decode_line(wire) == msg
    assert _feed_whole(wire) == [msg]
    assert _feed_bytewise(wire) == [msg]


@pytest.mark.parametrize("msg", CASES, ids=lambda m: type(m).__name__)
def test_trailing_data_stays_pending(msg):
    wire = encode(msg)
    tail = encode(Usr1())[:-1]  # the start of the next line
    d = ControlDecoder()
    d.receive_data(wire + tail)
    assert d.next_message() == msg
    assert d.next_message() is None
    assert d.pending == len(tail)
    with pytest.raises(ControlMessageError, match="ended inside a line"):
        d.eof()
    d.receive_data(b"")
    assert d.next_message() is None


def test_all_cases_in_one_stream():
    wire = b"".join(encode(m) for m in CASES)
    assert _feed_whole(wire) == CASES
    assert _feed_bytewise(wire) == CASES


@pytest.mark.parametrize(
    "line, what",
    [
        (b"not json\n", "not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"event": "nope"}\n', "unknown control event"),
        (b'{"secret": "s", "nonce": "n"}\n', "unknown control event"),
        (b'{"event": "hello", "secret": "s"}\n', "no field 'nonce'"),
        (b'{"event": "hello", "secret": 1, "nonce": "n"}\n', "field 'secret'"),
        (b'{"event": "port", "port": "80"}\n', "field 'port'"),
        (b'{"event": "port", "port": true}\n', "field 'port'"),
        (b'{"event": "port", "port": 70000}\n', "not a TCP port"),
        (b'{"event": "report", "node": 0, "host": "h", "exit_code": 0, "result": []}\n', "field 'result'"),
        (b"\xff\xfe\n", "not JSON"),
    ],
)
def test_malformed_lines_raise_and_the_next_line_still_decodes(line, what):
    with pytest.raises(ControlMessageError, match=what):
        decode_line(line)
    for feed in ("whole", "bytes"):
        d = ControlDecoder()
        data = line + encode(Usr1())
        got, errors = [], []
        chunks = [data] if feed == "whole" else [data[i : i + 1] for i in range(len(data))]
        for c in chunks:
            d.receive_data(c)
            while True:
                try:
                    m = d.next_message()
                except ControlMessageError as e:
                    errors.append(str(e))
                    continue
                if m is None:
                    break
                got.append(m)
        assert got == [Usr1()] and len(errors) == 1 and what in errors[0]
        d.eof()


def test_errors_are_protocol_errors():
    assert issubclass(ControlMessageError, ProtocolError)


@pytest.mark.parametrize("feed", ["whole", "bytes"])
def test_over_long_line_is_refused_and_skipped(feed):
    d = ControlDecoder(max_line=64)
    long = b'{"event":"hello","secret":"' + b"x" * 100 + b'","nonce":"n"}\n'
    data = long + encode(Usr1())
    chunks = [data] if feed == "whole" else [data[i : i + 1] for i in range(len(data))]
    got, errors = [], 0
    for c in chunks:
        d.receive_data(c)
        while True:
            try:
                m = d.next_message()
            except ControlMessageError as e:
                assert "longer than 64" in str(e)
                errors += 1
                continue
            if m is None:
                break
            got.append(m)
    assert errors == 1 and got == [Usr1()]
    assert d.pending == 0
    d.eof()


def test_a_line_of_exactly_max_line_is_accepted():
    wire = encode(PortAnnounce(port=1))
    d = ControlDecoder(max_line=len(wire))
    d.receive_data(wire)
    assert d.next_message() == PortAnnounce(port=1)
    d = ControlDecoder(max_line=len(wire) - 1)
    d.receive_data(wire)
    with pytest.raises(ControlMessageError):
        d.next_message()


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(ControlMessageError, match="not a control message"):
        encode({"event": "usr1"})  # type: ignore[arg-type]
    with pytest.raises(ControlMessageError, match="cannot encode report"):
        encode(Report(node=0, host="h", exit_code=0, result={"x": object()}))


def test_decoder_rejects_a_tiny_max_line():
    with pytest.raises(ValueError, match="max_line"):
        ControlDecoder(max_line=1)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=10,
)
_messages = st.one_of(
    st.builds(Hello, secret=st.text(max_size=70), nonce=st.text(max_size=20)),
    st.just(Usr1()),
    st.builds(PortAnnounce, port=st.integers(1, 65535)),
    st.builds(
        Report,
        node=st.none() | st.integers(0, 10**6),
        host=st.text(max_size=30),
        exit_code=st.integers(-255, 255),
        result=st.dictionaries(st.text(max_size=6), _json, max_size=4),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_messages, max_size=6), st.integers(1, 40))
def test_round_trip_any_split(msgs, step):
    wire = b"".join(encode(m) for m in msgs)
    d = ControlDecoder()
    got = []
    for i in range(0, len(wire), step):
        d.receive_data(wire[i : i + step])
        while (m := d.next_message()) is not None:
            got.append(m)
    d.eof()
    assert got == msgs


# --------------------------------------------------------------------------- agent <-> agent store values


def test_records_and_pid_tables_round_trip():
    rec = {"reason": "rank 1 on h failed (exit code 3)", "node": 1, "worker": {"rank": 1}, "tb": ["a", "b"]}
    assert decode_record(encode_record(rec)) == rec
    assert decode_record(encode_record(rec).decode()) == rec  # a store may hand back str
    rows = [[0, 0, 101], [1, 1, 102]]
    assert decode_pids(encode_pids(rows)) == rows
    assert decode_pids(encode_pids([])) == []


@pytest.mark.parametrize(
    "data, what",
    [
        (b"nope", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b"\xff", "not JSON"),
        (b"{" + b" " * MAX_LINE + b"}", "longer than"),
    ],
)
def test_malformed_records_raise_value_errors(data, what):
    with pytest.raises(ControlMessageError, match=what):
        decode_record(data)
    with pytest.raises(ValueError):  # the gang's readers catch ValueError
        decode_record(data)


@pytest.mark.parametrize("data", [b"{}", b"[[1, 2]]", b'[[1, 2, "3"]]', b"[[1, 2, true]]", b"x"])
def test_malformed_pid_tables_raise(data):
    with pytest.raises(ControlMessageError):
        decode_pids(data)


def test_unencodable_record_raises():
    with pytest.raises(ControlMessageError, match="cannot encode the record"):
        encode_record({"x": object()})
    with pytest.raises(ControlMessageError, match="longer than"):
        encode_record({"x": "y" * MAX_LINE})


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), _json, max_size=5),
    st.lists(st.lists(st.integers(0, 2**31), min_size=3, max_size=3), max_size=5),
)
def test_store_values_round_trip(rec, rows):
    assert decode_record(encode_record(rec)) == rec
    assert decode_pids(encode_pids(rows)) == rows
