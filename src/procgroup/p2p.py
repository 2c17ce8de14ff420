"""Point-to-point with torch.distributed's signatures: send/recv, isend/irecv, P2POp and batch_isend_irecv.

Ranks passed as ``src``/``dst``/``peer`` are *global* ranks (as torch); the ``group_src``/``group_dst``/
``group_peer`` keywords take ranks within the group.  A receive checks the sender's dtype (carried in the
tag) and the byte count.  :mod:`procgroup.collectives` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from .arguments import device_ops
from .arguments import member_group as _group
from .arguments import peer_rank as _peer
from .data import as_flat, is_torch_tensor
from .errors import ConfigError, DeviceTensorError
from .process_group import ProcessGroup, Work
from .state import _state
from .tags import P2P_CODE_MASK, P2P_CODE_SHIFT, dtype_code, dtype_of_code, p2p_tag
from .transport.base import ANY_SOURCE, as_bytes_view, as_writable_view
from .transport.shm.p2pfast import compiled_front

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


# -- point-to-point --------------------------------------------------------------------------
def _none(st: Any) -> None:
    return None


#: the most cached routes of blocking ops per group (ProcessGroup.p2p_routes; emptied when full)
_ROUTES_MAX = 256

#: what _post_send returns for a blocking send the transport's fast path has already handed over
_SENT = object()


def _post_send(
    tensor: Any,
    dst: Optional[int],
    group: Any,
    tag: int,
    group_dst: Optional[int],
    blocking: bool = False,
    handed: Any = None,
) -> Any:
    """Post a send: (group, request, context maker), None for non-members, _SENT when ``blocking`` and done.

    A blocking send first offers the message to the transport's ``send_fast`` (the shm transport: a
    message written into the peer's ring at once when nothing of ours to that peer is queued ahead of it).
    ``handed``: the request that ``send_fast`` returned for ``tensor`` (its receiver stopped making room
    mid-stream: the transport finishes it), used instead of posting a send.
    """
    g = _group(group, "isend")
    if g is None:
        return None
    peer = _peer(g, "send", dst, group_dst, "dst")
    try:
        f = as_flat(tensor, "send tensor", writable=False)
    except DeviceTensorError as e:
        return device_ops(g, e).isend(g, peer, tag, tensor)
    code = dtype_code(f.dtype)
    eng = g.world.engine
    req = eng.isend(g, peer, tag, f.array, code) if eng is not None and handed is None else None
    if req is None:
        t = g.world.transport
        ptag = p2p_tag(g.gid, tag, code, g.gen)
        if blocking and handed is None:
            fast = getattr(t, "send_fast", None)
            if fast is not None:
                res = fast(peer, ptag, as_bytes_view(f.array))
                if res is True:
                    return _SENT
                if res:
                    handed = res
        req = t.isend(peer, ptag, f.array) if handed is None else handed
    return g, req, lambda: f"to rank {peer}, tag {tag}, {f.describe()}"


def isend(
    tensor: Any, dst: Optional[int] = None, group: Any = None, tag: int = 0, group_dst: Optional[int] = None
) -> Optional[Work]:
    """Start sending ``tensor`` to ``dst`` (global rank) with ``tag``; returns a Work (None for non-members)."""
    posted = _post_send(tensor, dst, group, tag, group_dst)
    if posted is None:
        return None
    g, req, ctx = posted
    return g.p2p("send", req, None, _none, ctx)


def _post_recv(
    tensor: Any,
    src: Optional[int],
    group: Any,
    tag: int,
    group_src: Optional[int],
    blocking: bool = False,
    handed: Any = None,
) -> Any:
    """Post a receive: (group, request, finish, context maker, probe), None for non-members, or (blocking and
    taken by the transport's ``recv_fast``) the sender's rank as an int.

    ``handed``: the request that the transport's ``recv_fast`` returned for ``tensor`` (a message whose sender
    stalled mid-stream: the transport finishes it), used instead of posting a receive."""
    g = _group(group, "irecv")
    if g is None:
        return None
    peer = _peer(g, "recv", src, group_src, "src", allow_any=True)
    try:
        f = as_flat(tensor, "recv tensor")
    except DeviceTensorError as e:
        return device_ops(g, e).irecv(g, peer, tag, tensor)
    code = dtype_code(f.dtype)
    ptag = p2p_tag(g.gid, tag, code, g.gen)
    eng = g.world.engine
    if blocking and handed is None and eng is None and peer != ANY_SOURCE:
        fast = getattr(g.world.transport, "recv_fast", None)
        if fast is not None:
            n = fast(peer, ptag, as_writable_view(f.array))
            if type(n) is not int:
                handed = n
            elif n >= 0:
                _check_count(n, peer, f.array.nbytes)
                if f.back is not None:
                    f.back()
                return peer
    if eng is None:
        req = None
    else:  # (handed: the request the engine's fast recv returned; the engine's probe below applies to it too)
        req = eng.irecv(g, peer, tag, f.array, code) if handed is None else handed
    if req is not None:
        ask = getattr(eng, "unmatched", None)

        def probe() -> Optional[BaseException]:
            hit = ask(g, peer, tag, code) if ask is not None else None
            return None if hit is None else _dtype_mismatch(g, hit[0], hit[1], tag, f)

    else:
        t = g.world.transport
        req = t.irecv(peer, ptag, f.array) if handed is None else handed

        def probe() -> Optional[BaseException]:
            hit = t.unmatched(peer, ptag, P2P_CODE_MASK)
            return (
                None if hit is None else _dtype_mismatch(g, hit[0], (hit[1] & P2P_CODE_MASK) >> P2P_CODE_SHIFT, tag, f)
            )

    nbytes = f.array.nbytes

    def done(st: Any) -> int:
        _check_count(st.nbytes, st.source, nbytes)
        if f.back is not None:
            f.back()
        return st.source

    def ctx() -> str:
        src_desc = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        return f"from {src_desc}, tag {tag}, {f.describe()}"

    return g, req, done, ctx, probe


def irecv(
    tensor: Any, src: Optional[int] = None, group: Any = None, tag: int = 0, group_src: Optional[int] = None
) -> Optional[Work]:
    """Start receiving into ``tensor`` from ``src`` (any rank when None); Work.wait() gives the sender."""
    posted = _post_recv(tensor, src, group, tag, group_src)
    if posted is None:
        return None
    g, req, done, ctx, probe = posted
    return g.p2p("recv", req, None, done, ctx, probe)


def _check_count(got: int, src: int, nbytes: int) -> None:
    """ConfigError when a receive got another byte count than its tensor holds."""
    if got != nbytes:
        raise ConfigError(f"recv: got {got} bytes from rank {src} but the tensor holds {nbytes}")


def _dtype_mismatch(g: Any, src: int, their_code: int, tag: int, f: Any) -> ConfigError:
    """The error of a receive whose sender sent the same tag with another dtype (the sender may still wait)."""
    return ConfigError(
        f"dtype mismatch: rank {src} sent tag {tag} as {dtype_of_code(their_code)}, but rank {g.world.rank} "
        f"receives it into {f.describe()} ({dtype_of_code(dtype_code(f.dtype))}); the bytes would be reinterpreted. "
        "Send and receive tensors of the same dtype (convert with .astype()/.to() on one side). The sender's send "
        "may wait until its deadline for a matching receive"
    )


def _route(g: Any, recv: bool, peer_arg: Optional[int], tag: int, dtype: Any) -> Tuple[int, int, Any, bool]:
    """(global peer, transport tag, fast send/recv or None, whether it takes any ndarray) of a blocking op,
    cached per group.

    The fast op is the transport's send_fast/recv_fast (or the engine's p2p_fast hook), None for a dtype that
    is not plain numeric (as_flat's test) or any source.  The last flag: the op checks the array's buffer
    itself (the compiled shm Core: a non-contiguous or, for a receive, read-only array makes it return False/-1
    and the general path handles it), so the caller skips its flags test.  Raises what the general path raises
    for a bad peer or tag (nothing is cached then)."""
    routes = g.p2p_routes
    key = (recv, peer_arg, tag, dtype)
    hit = routes.get(key)
    if hit is None:
        if recv:
            peer = _peer(g, "recv", peer_arg, None, "src", allow_any=True)
        else:
            peer = _peer(g, "send", peer_arg, None, "dst")
        ptag = p2p_tag(g.gid, tag, dtype_code(dtype), g.gen)
        fast = None
        checks = False
        eng = g.world.engine
        if peer != ANY_SOURCE and not dtype.hasobject and dtype.fields is None:
            if eng is None:
                t = g.world.transport
                fast = getattr(t, "recv_fast" if recv else "send_fast", None)
                checks = fast is not None and getattr(t, "fast_checks_buffers", False)
            elif (mk := getattr(eng, "p2p_fast", None)) is not None:  # backend="mpi": (peer, ptag, arr) too
                fast = mk(g, recv, tag, dtype_code(dtype))
        hit = (peer, ptag, fast, checks)
        if len(routes) >= _ROUTES_MAX:
            routes.clear()
        routes[key] = hit
    return hit


#: the common case of send/recv (a numpy array, a live group, the compiled Core's fast op) in one C call
_FRONT = compiled_front(_state, ProcessGroup, np.ndarray, _route, _check_count)
_front_send = None if _FRONT is None else _FRONT.send
_front_recv = None if _FRONT is None else _FRONT.recv


def send(
    tensor: Any, dst: Optional[int] = None, group: Any = None, tag: int = 0, group_dst: Optional[int] = None
) -> None:
    """Send ``tensor`` to ``dst`` and wait until it has been handed over."""
    handed = None
    res = _front_send(tensor, dst, group, tag, group_dst) if _front_send is not None else None
    if res is True:
        return
    if res is not None:  # the compiled front tried the fast op: False (the general path) or a request
        if res is not False:
            handed = res
    elif type(tensor) is np.ndarray and group_dst is None:  # the fast path: a numpy array
        g = _state.default if group is None else group
        if type(g) is not ProcessGroup or g._halt is not None or g._rank < 0:  # member_group's cases, inlined
            g = _group(group, "isend")
            if g is None:
                return
        dt = tensor.dtype
        hit = g.p2p_routes.get((False, dst, tag, dt))  # _route's cache, looked up inline
        peer, ptag, fast, checks = hit if hit is not None else _route(g, False, dst, tag, dt)
        if fast is not None and (checks or tensor.flags.c_contiguous):
            res = fast(peer, ptag, tensor)  # the array itself (C-contiguous, or checked by fast): no view to make
            if res is True:
                return
            if res:  # its receiver stopped making room mid-stream: the transport's request finishes it
                handed = res
    posted = _post_send(tensor, dst, group, tag, group_dst, blocking=True, handed=handed)
    if posted is not None and posted is not _SENT:
        g, req, ctx = posted
        g.p2p_now("send", req, None, _none, ctx)


def recv(
    tensor: Any, src: Optional[int] = None, group: Any = None, tag: int = 0, group_src: Optional[int] = None
) -> int:
    """Receive into ``tensor``; returns the sender's global rank (-1 when not a member of ``group``)."""
    handed = None
    got = _front_recv(tensor, src, group, tag, group_src) if _front_recv is not None else None
    if got is not None:  # the compiled front tried the fast op: the sender, -1 (the general path) or a request
        if type(got) is not int:
            handed = got
        elif got >= 0:
            return got
    elif type(tensor) is np.ndarray and group_src is None and src is not None:  # the fast path (see send)
        g = _state.default if group is None else group
        if type(g) is not ProcessGroup or g._halt is not None or g._rank < 0:
            g = _group(group, "irecv")
            if g is None:
                return -1
        dt = tensor.dtype
        hit = g.p2p_routes.get((True, src, tag, dt))
        peer, ptag, fast, checks = hit if hit is not None else _route(g, True, src, tag, dt)
        if fast is not None and (checks or (tensor.flags.c_contiguous and tensor.flags.writeable)):
            n = fast(peer, ptag, tensor)  # the array itself (C-contiguous and writable, or checked by fast)
            if type(n) is int:
                if n >= 0:
                    if n != tensor.nbytes:
                        _check_count(n, peer, tensor.nbytes)
                    return peer
            else:  # its sender stalled mid-stream: the transport's request finishes it
                handed = n
    posted = _post_recv(tensor, src, group, tag, group_src, blocking=True, handed=handed)
    if posted is None:
        return -1
    if type(posted) is int:
        return posted
    g, req, done, ctx, probe = posted
    return g.p2p_now("recv", req, None, done, ctx, probe)


@dataclass
class P2POp:
    """One operation for :func:`batch_isend_irecv`: ``P2POp(dist.isend, tensor, peer)``."""

    op: Any
    tensor: Any
    peer: Optional[int] = None
    group: Any = None
    tag: int = 0
    group_peer: Optional[int] = None

    def __post_init__(self) -> None:
        name = getattr(self.op, "__name__", str(self.op))
        if name not in ("isend", "irecv"):
            raise ConfigError(f"P2POp.op must be procgroup.isend or procgroup.irecv, got {name}")


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Post every op, receives first (so matching sends can never deadlock); returns their Works."""
    if not p2p_op_list:
        raise ConfigError("batch_isend_irecv needs a non-empty list of P2POp")
    first = p2p_op_list[0]
    if is_torch_tensor(first.tensor):
        try:
            as_flat(first.tensor, "P2POp tensor", writable=False)
        except DeviceTensorError as e:
            return _device_batch(p2p_op_list, e)
    works: List[Any] = [None] * len(p2p_op_list)
    order = sorted(range(len(p2p_op_list)), key=lambda i: p2p_op_list[i].op.__name__ != "irecv")
    for i in order:
        p = p2p_op_list[i]
        if p.op.__name__ == "irecv":
            works[i] = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            works[i] = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    return [w for w in works if w is not None]


def _device_batch(p2p_op_list: List[P2POp], err: DeviceTensorError) -> List[Any]:
    """batch_isend_irecv of device tensors: every op of the batch in one group, handed to the world's engine."""
    group = p2p_op_list[0].group
    if any(p.group is not group for p in p2p_op_list):
        raise ConfigError("batch_isend_irecv of device tensors: every P2POp must name the same group")
    g = _group(group, "batch_isend_irecv")
    if g is None:
        return []
    items = []
    for p in p2p_op_list:
        is_recv = p.op.__name__ == "irecv"
        if is_recv:
            peer = _peer(g, "recv", p.peer, p.group_peer, "src", allow_any=True)
        else:
            peer = _peer(g, "send", p.peer, p.group_peer, "dst")
        items.append((is_recv, p.tensor, peer, p.tag))
    return list(device_ops(g, err).batch_isend_irecv(g, items))
