#!/usr/bin/env python3
"""Atheris harness for the sans-IO store codec (``procgroup.protocol.store_codec.StoreCodec``).

Input layout: byte 0 picks the role (bit 0: server parses requests, client parses responses) and the
chunking (bits 1-7 seed the sizes the stream is fed in); the rest is the byte stream from the peer.

Checked on every input:

* only :class:`~procgroup.errors.ProtocolError` escapes (any other exception is a finding);
* after a ProtocolError the codec is dead: the next call raises the same error;
* memory stays bounded: after a chunk is fed, the buffered bytes are at most one pending frame
  (``HEADER_LEN + MAX_FRAME``) plus that chunk; once drained (``NEED_DATA``) they are less than one
  frame, whose announced length is <= MAX_FRAME; consumed bytes kept in the buffer are at most
  max(64 KiB, what is buffered);
* every decoded event is of the role's direction and survives ``encode`` -> decode unchanged;
* EOF: ``eof()`` raises ProtocolError exactly when a partial frame is left;
* the server side goes on as StoreServer does: every decoded request is applied to a
  :class:`~procgroup.protocol.store_state.StoreState`, which never raises, answers a response the
  server codec can encode (or ``Park`` for a WAIT with a non-zero timeout), and wakes only keys
  the request named.

Run (see fuzz/README.md)::

    python fuzz/fuzz_store_codec.py -max_total_time=60 -print_final_stats=1 fuzz/corpus/store_codec
    python fuzz/fuzz_store_codec.py --make-corpus fuzz/corpus/store_codec   # seed inputs
"""

from __future__ import annotations

import os
import random
import struct
import sys

import atheris

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

with atheris.instrument_imports(
    include=["procgroup.protocol.store_codec", "procgroup.protocol.store_state", "procgroup.errors"]
):
    from procgroup.errors import ConfigError, ProtocolError
    from procgroup.protocol import store_codec as sc
    from procgroup.protocol.store_state import Park, StoreState

REQ = frozenset(sc.REQUEST_TYPES)
RESP = frozenset(sc.RESPONSE_TYPES)
KEEP = 65536  # StoreCodec._consume compacts once more than this many consumed bytes sit in front of the rest


def chunks(stream: bytes, seed: int):
    """Non-empty pieces of ``stream`` (``receive_data(b"")`` would mean EOF)."""
    if seed == 0:
        if stream:
            yield stream
        return
    rng = random.Random(seed)
    pos = 0
    while pos < len(stream):
        n = rng.choice([1, 1, 2, 3, 4, 5, 7, 16, 64, 1000])
        yield stream[pos : pos + n]
        pos += n


def check_bounded(codec: sc.StoreCodec, fed: int) -> None:
    buffered = codec.buffered
    assert buffered >= 0
    assert buffered <= sc.HEADER_LEN + sc.MAX_FRAME + fed, (buffered, fed)
    kept = len(codec._buf) - buffered  # consumed bytes not yet compacted away
    assert kept <= max(KEEP, buffered), (kept, buffered)


def check_drained(codec: sc.StoreCodec) -> None:
    """At NEED_DATA: less than one complete frame is buffered, and its header (if any) announces a legal size."""
    b = codec.buffered
    if b >= sc.HEADER_LEN:
        length = struct.unpack_from(">I", codec._buf, codec._pos)[0]
        assert 1 <= length <= sc.MAX_FRAME, length
        assert b < sc.HEADER_LEN + length, (b, length)


def roundtrip(ev: object, role: str) -> None:
    assert type(ev) in (REQ if role == "server" else RESP), ev
    again = sc.StoreCodec(role)
    again.receive_data(sc.encode(ev))
    ev2 = again.next_event()
    assert ev2 == ev, (ev, ev2)
    assert again.next_event() is sc.NEED_DATA


def serve(state: StoreState, ev: object) -> None:
    """Apply a decoded request as the server does and check the outcome."""
    assert isinstance(ev, tuple(REQ)), ev
    out = state.apply(ev, now=1.0)
    named = set(getattr(ev, "keys", ())) | ({ev.key} if hasattr(ev, "key") else set())
    assert set(out.wake) <= named, (ev, out)
    if isinstance(out.reply, Park):
        assert isinstance(ev, sc.Wait) and ev.timeout_ms != 0, (ev, out)
        assert out.reply.missing and all(state.get(k) is None for k in out.reply.missing), (ev, out)
        return
    try:
        sc.StoreCodec("server").send(out.reply)
    except ConfigError:
        pass  # a reply over the frame limit: the server answers an ERROR instead


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    if not data:
        return
    role = "server" if data[0] & 1 else "client"
    stream = data[1:]
    codec = sc.StoreCodec(role)
    state = StoreState() if role == "server" else None
    err = None
    try:
        for chunk in chunks(stream, data[0] >> 1):
            codec.receive_data(chunk)
            check_bounded(codec, len(chunk))
            while True:
                ev = codec.next_event()
                if ev is sc.NEED_DATA:
                    check_drained(codec)
                    break
                assert ev is not sc.CLOSED  # no EOF yet
                roundtrip(ev, role)
                if state is not None:
                    serve(state, ev)
        partial = codec.buffered > 0
        try:
            codec.eof()
        except ProtocolError:
            assert partial, "eof() raised with nothing buffered"
        else:
            ev = codec.next_event()
            while ev is not sc.CLOSED:  # eof() does not consume: complete frames still come out
                roundtrip(ev, role)
                ev = codec.next_event()
            assert not partial or codec.buffered == 0
    except ProtocolError as e:
        err = e
    if err is not None:
        try:
            codec.next_event()
        except ProtocolError as e2:
            assert e2 is err, (e2, err)
        else:
            raise AssertionError("the codec kept going after a ProtocolError")


def make_corpus(d: str) -> None:
    os.makedirs(d, exist_ok=True)
    reqs = [
        sc.Set("k", b"v" * 10),
        sc.Get("key/1"),
        sc.Add("n", -3),
        sc.CompareSet("c", b"", b"x"),
        sc.Wait(("a", "b"), 100),
        sc.Check(("a",)),
        sc.MultiGet(("a", "b")),
        sc.MultiSet(("a", "b"), (b"1", b"22")),
        sc.DeleteKey("d"),
        sc.NumKeys(),
        sc.Ping(),
    ]
    resps = [
        sc.Ok(),
        sc.Value(b"abc"),
        sc.Int(7),
        sc.Bool(True),
        sc.Values((b"x", b"")),
        sc.Timeout(("m",)),
        sc.Error("nope"),
    ]
    i = 0
    for role_bit, evs in ((1, reqs), (0, resps)):
        for seed in (0, 2, 9):
            for ev in evs:
                with open(os.path.join(d, f"seed{i:03d}"), "wb") as f:
                    f.write(bytes([role_bit | (seed << 1)]) + sc.encode(ev))
                i += 1
            with open(os.path.join(d, f"seed{i:03d}"), "wb") as f:
                f.write(bytes([role_bit | (seed << 1)]) + b"".join(sc.encode(ev) for ev in evs))
            i += 1
    print(f"wrote {i} seed inputs to {d}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        make_corpus(sys.argv[2])
        sys.exit(0)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
