#!/usr/bin/env python3
"""Atheris harness for the TCP transport's frame decoder (``procgroup.protocol.frames.FrameDecoder``).

Input layout: byte 0 picks ``max_frame_size`` (index into MAX_SIZES); byte 1 seeds the chunk sizes
(bits 0-6) and turns on ``skip_payload`` (bit 7: part of each payload is "read by the I/O shell"
instead of fed, as the TCP reader does with ``recv_into``); the rest is the byte stream.

Checked on every input:

* only :class:`~procgroup.errors.ProtocolError` escapes, and after one the decoder is dead (the next
  ``feed`` raises the same error object);
* memory stays bounded: at most a partial header (< 24 bytes) is ever buffered; a frame's payload
  (``payload_left``) never exceeds ``max_frame_size``;
* every header is valid (known flags, tag < 2**63, length <= max_frame_size) and its payload chunks add
  up to its length;
* without skipping, re-encoding the decoded headers and payload chunks (plus the buffered partial
  header) reproduces exactly the bytes fed: nothing is lost, duplicated or reordered;
* ``close()`` raises ProtocolError exactly when the stream stopped inside a frame.
"""

from __future__ import annotations

import os
import random
import sys

import atheris

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

with atheris.instrument_imports(include=["procgroup.protocol.frames", "procgroup.errors"]):
    from procgroup.errors import ProtocolError
    from procgroup.protocol import frames as fr

MAX_SIZES = [0, 1, 24, 100, 4096, fr.DEFAULT_MAX_FRAME_SIZE]


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    if len(data) < 2:
        return
    max_frame = MAX_SIZES[data[0] % len(MAX_SIZES)]
    seed, skip = data[1] & 0x7F, bool(data[1] & 0x80)
    stream = data[2:]
    rng = random.Random(seed)
    dec = fr.FrameDecoder(max_frame)
    rebuilt = bytearray()
    cur = None  # [header, payload bytes seen]
    pos = 0
    err = None
    try:
        while pos < len(stream):
            if skip and dec.payload_left and rng.random() < 0.5:
                k = rng.randint(1, dec.payload_left)
                k = min(k, len(stream) - pos)
                dec.skip_payload(k)  # the shell read k payload bytes itself
                assert cur is not None
                cur[1] += k
                pos += k
                continue
            n = len(stream) - pos if seed == 0 else rng.choice([1, 2, 3, 5, 8, 23, 24, 25, 100, 4096])
            chunk = stream[pos:pos + n]
            pos += len(chunk)
            for ev in dec.feed(chunk):
                if isinstance(ev, fr.FrameHeader):
                    assert cur is None or cur[1] == cur[0].length, "header before the previous payload ended"
                    assert 0 <= ev.tag < 1 << 63 and 0 <= ev.length <= max_frame and not ev.flags & ~fr.FLAG_MORE, ev
                    cur = [ev, 0]
                    rebuilt += fr.encode_header(ev.tag, ev.length, ev.flags, max_frame_size=max_frame)
                else:
                    assert isinstance(ev, memoryview) and ev.nbytes > 0
                    assert cur is not None
                    cur[1] += ev.nbytes
                    assert cur[1] <= cur[0].length, (cur[1], cur[0])
                    rebuilt += ev
            # bounded buffering: only a partial header is ever kept
            assert len(dec._hdr) < fr.HEADER_SIZE, len(dec._hdr)
            assert 0 <= dec.payload_left <= max_frame
            if not skip:
                assert bytes(rebuilt) + bytes(dec._hdr) == stream[:pos], "decoded stream differs from the input"
        try:
            dec.close()
        except ProtocolError:
            assert not dec.at_boundary
        else:
            assert dec.at_boundary
    except ProtocolError as e:
        err = e
    if err is not None:
        try:
            dec.feed(b"x")
        except ProtocolError as e2:
            assert e2 is err
        else:
            raise AssertionError("the decoder kept going after a ProtocolError")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--make-corpus":
        d = sys.argv[2]
        os.makedirs(d, exist_ok=True)
        frames = [(1, b"hello", 0), (2**63 - 1, b"", 0), (0, bytes(range(256)), fr.FLAG_MORE), (7, b"x", 0)]
        stream = b"".join(fr.encode_header(t, len(p), f) + p for t, p, f in frames)
        i = 0
        for b0 in (4, 5):
            for b1 in (0, 3, 0x80 | 5):
                with open(os.path.join(d, f"seed{i:03d}"), "wb") as f:
                    f.write(bytes([b0, b1]) + stream)
                i += 1
        print(f"wrote {i} seed inputs to {d}")
        sys.exit(0)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
