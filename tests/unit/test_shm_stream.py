"""Streaming copies into shared slots (``copy_to_shared`` in ``_native.h``; ``PROCGROUP_SHM_STREAM``).

The compiled copies into a buffer that other processes read use non-temporal stores from ``arena.STREAM_MIN``
bytes on where every reader takes it whole, and (``always``) from ``arena.STREAM_PIECES_MIN`` on where each takes a
piece of it.  Whichever store a copy uses, the bytes must be the same: every length around the 64-byte blocks and
the thresholds, every alignment of destination and source, under each setting; and the setting's parsing.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator, List

import numpy as np
import pytest

from procgroup.config import ENV, ShmOptions, shm_options
from procgroup.errors import ConfigError
from procgroup.transport import Transport
from procgroup.transport.shm import arena as ARENA

from .test_transport_conformance import _form, _segments

_native = pytest.importorskip("procgroup.transport.shm._native")
if not ARENA.native_available():
    pytest.skip("the compiled arena path is not built here", allow_module_level=True)

SLOT = 64 << 10
#: around the 64-byte blocks, the destination's alignment head, and STREAM_MIN (8 KiB)
LENGTHS = [0, 1, 15, 63, 64, 65, 127, 4095, 8191, 8192, 8193, 8192 + 63, 32768 + 17, SLOT - 64]


@pytest.fixture
def big() -> Iterator[Any]:
    """Member 0's big slots of a three-rank shm group (threads: with two, a buffer read whole has one reader and
    counts as pieces), and a peer's view of them."""
    job = f"stream-{uuid.uuid4().hex[:10]}"
    ts: List[Transport] = _form("shm", 3, job, shm_options=ShmOptions(big_slot=SLOT))
    try:
        a0 = ts[0].arena(0, [0, 1, 2])
        a1 = ts[1].arena(0, [0, 1, 2])
        assert a0 is not None and a0.big is not None and a1 is not None and a1.big is not None
        assert a0.big.native
        yield a0.big, a1.big
    finally:
        for t in ts:
            t.close()
        ARENA.set_streaming("auto")
        assert _segments(job) == [], "shared memory segments leaked"


def _settings() -> List[Any]:
    m, pm = ARENA.STREAM_MIN, ARENA.STREAM_PIECES_MIN
    return [
        ("never", (-1, -1)),
        ("auto", (m, -1)),
        ("always", (m, pm)),
        ("both from 0 bytes", (0, 0)),
    ]


@pytest.mark.parametrize("name,setting", _settings(), ids=[s[0] for s in _settings()])
def test_every_length_and_alignment_arrives_intact(big: Any, name: str, setting: Any) -> None:
    mine, peer = big
    _native.set_stream_min(*setting)
    rng = np.random.default_rng(7)
    src_all = rng.integers(0, 256, SLOT + 128, dtype=np.uint8)
    for pieces in (False, True):
        for n in LENGTHS:
            for dst_off in (0, 1, 8, 63):
                if dst_off + n > SLOT:
                    continue
                src_off = (dst_off * 7 + 3) % 64  # skewed against the destination
                src = src_all[src_off : src_off + n]
                for k in (0, 1):
                    buf = mine.arrays[k][mine.index]
                    buf[:] = 0xA5
                    mine.put(k, dst_off, src, pieces)
                    view = peer.arrays[k][mine.index]  # the other member's mapping of the same buffer
                    where = f"{name}: {n} bytes at +{dst_off} (source +{src_off}), buffer {k}, pieces={pieces}"
                    assert view[dst_off : dst_off + n].tobytes() == src.tobytes(), where
                    assert (view[:dst_off] == 0xA5).all() and (view[dst_off + n :] == 0xA5).all(), where


def test_a_put_past_the_buffer_or_into_a_bad_turn_is_refused(big: Any) -> None:
    mine, _ = big
    data = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="bad put"):
        mine.put(0, SLOT - 8, data, False)
    with pytest.raises(ValueError, match="bad put"):
        mine.put(2, 0, data, False)
    with pytest.raises(ValueError, match="bad put"):
        mine.put(0, -1, data, True)
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        mine.put(0, 0, np.zeros((4, 4), np.uint8)[:, 1], False)


def test_the_setting_is_parsed_once_and_applied_by_the_transport() -> None:
    assert shm_options({}).stream == "auto"
    for v in ("auto", "always", "never", " Never "):
        assert shm_options({ENV.SHM_STREAM: v}).stream == v.strip().lower()
    with pytest.raises(ConfigError, match="PROCGROUP_SHM_STREAM='sometimes' must be one of auto, always, never"):
        shm_options({ENV.SHM_STREAM: "sometimes"})
    m, pm = ARENA.STREAM_MIN, ARENA.STREAM_PIECES_MIN
    try:
        for mode, want in (("never", (-1, -1)), ("always", (m, pm)), ("auto", (m, -1))):
            job = f"stream-{uuid.uuid4().hex[:10]}"
            ts = _form("shm", 2, job, shm_options=ShmOptions(stream=mode))
            try:
                assert _native.stream_min() == want, mode
            finally:
                for t in ts:
                    t.close()
            assert _segments(job) == []
    finally:
        ARENA.set_streaming("auto")
