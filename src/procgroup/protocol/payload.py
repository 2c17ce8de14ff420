"""Object payloads: pickle protocol 5 with out-of-band buffers (after mpi4py's pkl5).

Layout of one encoded object (all integers little-endian u64)::

    n_buffers | len(pickle body) | len(buffer 0) ... len(buffer n-1)   (header)
    pickle body | buffer 0 | ... | buffer n-1                          (data)

Large contiguous arrays inside the object travel as raw buffers next to the
pickle body instead of being copied into it.  :func:`dumps` returns the
header and the list of segments (no concatenation), :func:`loads` takes one
contiguous bytes-like object and returns the object whose arrays are views
into it (zero copy on receive).  Every length is checked against the total
size, so a corrupt header is a :class:`~procgroup.errors.ProtocolError`.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Iterable, List, Optional, Tuple

from ..errors import ProtocolError
from .safe_pickle import safe_loads

__all__ = ["dumps", "loads", "join", "MAX_BUFFERS"]

MAX_BUFFERS = 1 << 16
_U64 = struct.Struct("<Q")


def dumps(obj: Any) -> Tuple[int, List[memoryview]]:
    """Encode ``obj``: returns (total nbytes, segments to send in order)."""
    bufs: List[pickle.PickleBuffer] = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = []
    for b in bufs:
        try:
            raws.append(b.raw())
        except BufferError:  # non-contiguous: copy it
            raws.append(memoryview(bytes(b)))
    if len(raws) > MAX_BUFFERS:
        raws = []
        body = pickle.dumps(obj, protocol=5)
    header = struct.pack(f"<{2 + len(raws)}Q", len(raws), len(body), *(r.nbytes for r in raws))
    segs = [memoryview(header), memoryview(body), *raws]
    return sum(s.nbytes for s in segs), segs


def join(segs: List[memoryview], total: int) -> bytearray:
    """The segments of :func:`dumps` in one contiguous buffer of ``total`` bytes."""
    out = bytearray(total)
    pos = 0
    for s in segs:
        out[pos : pos + s.nbytes] = s
        pos += s.nbytes
    return out


def loads(data: Any, *, allowed: Optional[Iterable[str]] = None) -> Any:
    """Decode one payload; ``allowed`` not None: safe mode (see ``safe_pickle``) with that extra allow-list."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    if n < 16:
        raise ProtocolError(f"object payload of {n} bytes is shorter than its 16-byte header")
    nbuf = _U64.unpack_from(mv, 0)[0]
    if nbuf > MAX_BUFFERS:
        raise ProtocolError(f"object payload claims {nbuf} out-of-band buffers (limit {MAX_BUFFERS})")
    hlen = 16 + 8 * nbuf
    if hlen > n:
        raise ProtocolError("object payload header is truncated")
    lens = struct.unpack_from(f"<{1 + nbuf}Q", mv, 8)
    if hlen + sum(lens) != n:
        raise ProtocolError(f"object payload lengths add up to {hlen + sum(lens)} bytes but {n} were received")
    pos = hlen
    body = mv[pos : pos + lens[0]]
    pos += lens[0]
    buffers = []
    for ln in lens[1:]:
        buffers.append(mv[pos : pos + ln])
        pos += ln
    if allowed is not None:
        return safe_loads(body, allowed=allowed, buffers=buffers)
    return pickle.loads(body, buffers=buffers)
