"""Object collectives: any picklable object, pickle protocol 5 with out-of-band buffers.

Arrays inside objects are not copied into the pickle body (see
``protocol/payload.py``); point-to-point sends go segment by segment, so a
large array is sent straight from its own memory.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from . import algorithms as alg
from .arguments import API_SLOT_C
from .arguments import member_group as _group
from .arguments import peer_rank as _peer
from .arguments import root_rank as _root
from .errors import ConfigError
from .process_group import p2p_tag
from .protocol import payload

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

_I64 = np.int64
#: added to a Comm's tag for the second collective of one call (algorithm steps stay far below 2**15)
PHASE2 = 1 << 15


def _encode(obj: Any) -> np.ndarray:
    total, segs = payload.dumps(obj)
    return np.frombuffer(payload.join(segs, total), dtype=np.uint8)


def _decode(buf: np.ndarray) -> Any:
    return payload.loads(buf)


def broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
) -> None:
    """Root's ``object_list`` entries replace every other rank's, in place (same length everywhere)."""
    g = _group(group, "broadcast_object_list")
    if g is None:
        return
    root = _root(g, "broadcast_object_list", src, group_src, "src", default=0)

    def run(c: Any) -> None:
        n = np.zeros(1, _I64)
        data = None
        if c.rank == root:
            data = _encode(list(object_list))
            n[0] = data.nbytes
        alg.broadcast(c, n, root)
        if c.rank != root:
            data = np.empty(int(n[0]), np.uint8)
        c.tag += PHASE2  # second collective of this call: steps of its own
        alg.broadcast(c, data, root)
        if c.rank != root:
            got = _decode(data)
            if len(got) != len(object_list):
                raise ConfigError(
                    f"broadcast_object_list: the source sent {len(got)} objects but this rank's list has "
                    f"{len(object_list)}; use lists of the same length"
                )
            object_list[:] = got

    g.run("broadcast_object_list", run, signature=("broadcast_object_list", f"root={root}"))


def _gatherv(c: Any, mine: np.ndarray, root: Optional[int]) -> Optional[List[np.ndarray]]:
    """All-gather (root None) or gather of variable-size byte arrays."""
    sizes = np.zeros(c.size, _I64)
    alg.all_gather(c, np.array([mine.nbytes], _I64), sizes)
    c.tag += PHASE2
    counts = [int(s) for s in sizes]
    if root is None:
        out = np.empty(sum(counts), np.uint8)
        alg.all_gatherv(c, mine, out, counts)
    else:
        m = max(counts) if counts else 0
        padded = c.scratch(m, slot=API_SLOT_C)
        padded[: mine.nbytes] = mine
        out = np.empty(m * c.size, np.uint8) if c.rank == root else None
        alg.gather(c, padded, out, root)
        if out is None:
            return None
        return [out[i * m : i * m + counts[i]] for i in range(c.size)]
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [out[offs[i] : offs[i + 1]] for i in range(c.size)]


def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    """Every member's ``obj`` into ``object_list`` (length = group size), on every member."""
    g = _group(group, "all_gather_object")
    if g is None:
        return
    if len(object_list) != g.size():
        raise ConfigError(
            f"all_gather_object: object_list has {len(object_list)} entries but the group has {g.size()} ranks; "
            "pass [None] * world_size"
        )

    def run(c: Any) -> None:
        parts = _gatherv(c, _encode(obj), None)
        assert parts is not None
        for i, p in enumerate(parts):
            object_list[i] = _decode(p)

    g.run("all_gather_object", run, signature=("all_gather_object",))


def gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
) -> None:
    """Every member's ``obj`` into ``object_gather_list`` on ``dst``."""
    g = _group(group, "gather_object")
    if g is None:
        return
    root = _root(g, "gather_object", dst, group_dst, "dst", default=0)
    if g.rank() == root and (object_gather_list is None or len(object_gather_list) != g.size()):
        raise ConfigError(f"gather_object: the destination rank needs object_gather_list of length {g.size()}")

    def run(c: Any) -> None:
        parts = _gatherv(c, _encode(obj), root)
        if parts is not None and object_gather_list is not None:
            for i, p in enumerate(parts):
                object_gather_list[i] = _decode(p)

    g.run("gather_object", run, signature=("gather_object", f"root={root}"))


def scatter_object_list(
    scatter_object_output_list: List[Any],
    scatter_object_input_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
) -> None:
    """Rank i gets ``scatter_object_input_list[i]`` (from the source) in ``scatter_object_output_list[0]``."""
    g = _group(group, "scatter_object_list")
    if g is None:
        return
    root = _root(g, "scatter_object_list", src, group_src, "src", default=0)
    if not scatter_object_output_list:
        raise ConfigError(
            "scatter_object_list: scatter_object_output_list must have at least one element to receive into"
        )
    if g.rank() == root and (scatter_object_input_list is None or len(scatter_object_input_list) != g.size()):
        raise ConfigError(f"scatter_object_list: the source rank needs scatter_object_input_list of length {g.size()}")

    def run(c: Any) -> None:
        if c.rank == root:
            assert scatter_object_input_list is not None
            reqs = []
            keep = []  # payloads stay alive until their sends complete
            for i, o in enumerate(scatter_object_input_list):
                if i == root:
                    scatter_object_output_list[0] = o
                    continue
                data = _encode(o)
                size = np.array([data.nbytes], _I64)
                keep += [size, data]
                reqs.append(c.isend(i, size, step=0))
                reqs.append(c.isend(i, data, step=1))
            c.wait_all(reqs)
        else:
            n = np.zeros(1, _I64)
            c.recv(root, n, step=0)
            data = np.empty(int(n[0]), np.uint8)
            c.recv(root, data, step=1)
            scatter_object_output_list[0] = _decode(data)

    g.run("scatter_object_list", run, signature=("scatter_object_list", f"root={root}"))


def send_object_list(
    object_list: List[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_dst: Optional[int] = None,
) -> None:
    """Send the picklable objects of ``object_list`` to ``dst`` (see recv_object_list)."""
    g = _group(group, "send_object_list")
    if g is None:
        return
    peer = _peer(g, "send_object_list", dst, group_dst, "dst")
    total, segs = payload.dumps(list(object_list))
    t = g.world.transport
    tag = p2p_tag(g.gid, (1 << 39) | 0)  # tags above 2**39 are reserved for object p2p
    dl = g._deadline(None)
    t.send(peer, tag, np.array([total, len(segs)], _I64), dl)
    t.send(peer, tag, np.array([s.nbytes for s in segs], _I64), dl)
    for s in segs:
        t.send(peer, tag, s, dl)


def recv_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
) -> int:
    """Fill ``object_list`` in place from ``src`` (any rank when None); returns the sender's global rank."""
    g = _group(group, "recv_object_list")
    if g is None:
        return -1
    peer = _peer(g, "recv_object_list", src, group_src, "src", allow_any=True)
    t = g.world.transport
    tag = p2p_tag(g.gid, (1 << 39) | 0)
    dl = g._deadline(None)
    head = np.zeros(2, _I64)
    sender = t.recv(peer, tag, head, dl).source
    total, nseg = int(head[0]), int(head[1])
    if not 0 < nseg <= payload.MAX_BUFFERS + 2:
        raise ConfigError(f"recv_object_list: rank {sender} announced {nseg} segments")
    lens_a = np.zeros(nseg, _I64)
    t.recv(sender, tag, lens_a, dl)
    lens = [int(x) for x in lens_a]
    if sum(lens) != total:
        raise ConfigError(f"recv_object_list: inconsistent header from rank {sender}")
    buf = np.empty(total, np.uint8)
    pos = 0
    for ln in lens:
        t.recv(sender, tag, buf[pos : pos + ln], dl)
        pos += ln
    got = _decode(buf)
    if len(got) != len(object_list):
        raise ConfigError(
            f"recv_object_list: rank {sender} sent {len(got)} objects but object_list has {len(object_list)} "
            "slots; use lists of the same length"
        )
    object_list[:] = got
    return sender
