#!/usr/bin/env python3
"""Atheris harness for the TCP transport's frame decoder (``procgroup.protocol.frames.FrameDecoder``).

Input layout: byte 0 picks ``max_frame_size`` (index into MAX_SIZES) and, in bits 4-7, the read
buffer size of the message view (index into BUFFER_SIZES); byte 1 seeds the chunk sizes (bits 0-5),
picks the view (bit 6: the *message view*, the code the TCP transport's reader runs, else the frame
view ``feed``) and a variant (bit 7: frame view: part of each payload goes through ``skip_payload``;
message view: some payloads are discarded with ``set_target(None)`` or ``drop_target``); the rest is
the byte stream.

Message view, driven like ``TcpTransport._reader`` drives it (``get_buffer`` -> a simulated
``recv_into`` of a random size -> ``buffer_updated``; ``set_target`` with a fresh buffer per frame):

* only :class:`~procgroup.errors.ProtocolError` escapes, and after one the decoder is dead;
* memory stays bounded: the read buffer keeps its size, ``get_buffer`` never offers more than the
  read buffer's size or the current frame's remaining payload, ``payload_left <= max_frame_size``;
* events are well formed: a one-frame ``Message`` fits ``max_frame_size``; the frames of a message
  (``FrameStart``) share its tag and report running offsets; ``MessageEnd`` counts them all;
* without discarding, re-encoding the events reproduces exactly the bytes read once the stream
  ended cleanly; EOF raises exactly when the stream stopped inside a frame or a multi-frame message.

Frame view, checked on every input:

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
BUFFER_SIZES = [fr.HEADER_SIZE, fr.HEADER_SIZE + 1, 64, 4096]


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    if len(data) < 2:
        return
    max_frame = MAX_SIZES[(data[0] & 0x0F) % len(MAX_SIZES)]
    seed, variant = data[1] & 0x3F, bool(data[1] & 0x80)
    stream = data[2:]
    rng = random.Random(seed)
    if data[1] & 0x40:
        check_message_view(stream, max_frame, BUFFER_SIZES[(data[0] >> 4) % len(BUFFER_SIZES)], rng, variant)
    else:
        check_frame_view(stream, max_frame, rng, seed, variant)


def check_message_view(stream: bytes, max_frame: int, buffer_size: int, rng: random.Random, discard: bool) -> None:
    """Drive the message view as the TCP reader does, over ``stream`` read in random pieces."""
    dec = fr.FrameDecoder(max_frame, buffer_size=buffer_size)
    src = memoryview(stream)
    pos = 0
    rebuilt = bytearray()
    frame: list = []  # the current frame: [FrameStart, target buffer or None]
    msg_tag, msg_off = None, 0
    discarded = False
    err = None
    try:
        while True:
            ev = dec.next_event()
            if ev is None:
                if discard and dec.target is not None and rng.random() < 0.1:
                    dec.drop_target()  # as the reader does when the receive failed meanwhile
                    discarded = True
                view = dec.get_buffer()
                assert 0 < view.nbytes <= max(buffer_size, dec.payload_left), (view.nbytes, dec.payload_left)
                assert dec.payload_left <= max_frame and len(dec._buf) == buffer_size
                k = min(view.nbytes, len(src) - pos, rng.choice([1, 2, 3, 5, 8, 23, 24, 25, 100, 4096, 1 << 20]))
                view[:k] = src[pos : pos + k]
                pos += k
                try:
                    dec.buffer_updated(k)
                except fr.ProtocolError:
                    assert k == 0 and not dec.at_boundary
                    raise
                assert k or dec.at_boundary  # EOF is an error unless at a message boundary
                continue
            if ev is fr.CLOSED:
                assert pos == len(src) and dec.at_boundary and msg_tag is None
                dec.close()
                if not discarded:
                    assert bytes(rebuilt) == stream, "decoded messages differ from the stream"
                return
            if isinstance(ev, fr.Message):
                assert msg_tag is None and 0 <= ev.tag < 1 << 63 and ev.payload.nbytes <= max_frame
                rebuilt += fr.encode_header(ev.tag, ev.payload.nbytes, max_frame_size=max_frame) + ev.payload
            elif isinstance(ev, fr.FrameStart):
                assert 0 <= ev.tag < 1 << 63 and 0 <= ev.length <= max_frame
                if msg_tag is None:
                    assert ev.offset == 0
                    msg_tag, msg_off = ev.tag, 0
                assert ev.tag == msg_tag and ev.offset == msg_off, (ev, msg_tag, msg_off)
                _close_frame(frame, rebuilt, max_frame)
                target = None if discard and rng.random() < 0.3 else bytearray(ev.length)
                discarded |= target is None
                dec.set_target(None if target is None else memoryview(target))
                frame[:] = [ev, target]
                msg_off += ev.length
            else:
                assert isinstance(ev, fr.MessageEnd) and ev.tag == msg_tag and ev.nbytes == msg_off, (ev, msg_off)
                _close_frame(frame, rebuilt, max_frame)
                msg_tag = None
    except fr.ProtocolError as e:
        err = e
    assert err is not None
    try:
        dec.next_event()
    except fr.ProtocolError as e2:
        assert e2 is err
    else:
        raise AssertionError("the decoder kept going after a ProtocolError")


def _close_frame(frame: list, rebuilt: bytearray, max_frame: int) -> None:
    """Re-encode the finished frame ``frame`` ([FrameStart, payload]) onto ``rebuilt``."""
    if frame:
        ev, target = frame
        flags = fr.FLAG_MORE if ev.more else 0
        rebuilt += fr.encode_header(ev.tag, ev.length, flags, max_frame_size=max_frame)
        rebuilt += target if target is not None else bytes(ev.length)
        frame.clear()


def check_frame_view(stream: bytes, max_frame: int, rng: random.Random, seed: int, skip: bool) -> None:
    """Feed ``stream`` to the frame view in random pieces (``skip``: some payload through skip_payload)."""
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
            chunk = stream[pos : pos + n]
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
        for b0 in (4, 5):  # frame view
            for b1 in (0, 3, 0x80 | 5):
                with open(os.path.join(d, f"seed{i:03d}"), "wb") as f:
                    f.write(bytes([b0, b1]) + stream)
                i += 1
        msgs = [(1, b"hello"), (2**63 - 1, b""), (0, bytes(range(256))), (7, b"x")]
        for b0 in (0x03, 0x14, 0x25, 0x33):  # message view: max_frame 100/4096/1 GiB, several read buffers
            max_frame = MAX_SIZES[b0 & 0x0F]
            wire = b"".join(h + p[o : o + k] for t, p in msgs for h, o, k in fr.message_frames(t, len(p), max_frame))
            for b1 in (0x40, 0x40 | 7, 0xC0 | 9):
                with open(os.path.join(d, f"seed{i:03d}"), "wb") as f:
                    f.write(bytes([b0, b1]) + wire)
                i += 1
        print(f"wrote {i} seed inputs to {d}")
        sys.exit(0)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
