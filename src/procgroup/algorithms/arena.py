"""Small collectives through an arena: one publish, one wait, no message matching.

When every rank of a group shares a host, the transport gives the group an
:class:`~procgroup.transport.base.Arena` (``comm.arena``): a slot per member
in shared memory.  A small collective is then a single exchange: every member
publishes its bytes, waits until all have, and reads what it needs straight
from the others' slots.  Against log2(p) rounds of tagged messages this
saves the message headers, the tag matching and most of the wake-ups, which
is what a small collective costs (the data is a few bytes).

Reductions read the members' values in member order, so every rank computes
bit-identical results (as the message-based algorithms guarantee).

The check word published with each exchange is the call's sequence number
and fingerprint (the low 32 bits of the group tag), so members that disagree
about the call never complete it together; the watchdog then names the
mismatch.

Broadcast and reduce of 1 to ``queue.max_bytes`` bytes are one-directional where the arena has a queue
(``Arena.queue``, see ``procgroup.transport.shm.queue``; issue 14): a broadcast's root writes and returns, its
non-roots wait for the root alone; a reduce's non-roots write and return, its root waits for them.  The
choice depends only on the byte count and the transport, which every member shares.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import numpy as np

from ..errors import ConfigError

__all__ = [
    "allreduce_arena",
    "bcast_arena",
    "reduce_arena",
    "allgather_arena",
    "reduce_scatter_arena",
    "barrier_arena",
    "fits",
    "queue_for",
    "bcast_queue",
    "reduce_queue",
]

Reducer = Callable[[np.ndarray, np.ndarray], None]
_EMPTY = np.zeros(0, np.uint8)  # the root's `out` of a broadcast: nothing to copy


def fits(comm: Any, nbytes: int) -> bool:
    """True when ``comm`` has an arena and one member's ``nbytes`` fit its slot."""
    a = comm.arena
    return a is not None and nbytes <= a.max_bytes


def _arena(comm: Any) -> Any:
    a = comm.arena
    if a is None:
        raise ConfigError("the arena algorithms need a group whose ranks share a host (and a transport with an arena)")
    return a


def _bytes(buf: np.ndarray) -> memoryview:
    return memoryview(buf).cast("B")  # type: ignore[arg-type]  # numpy's stubs do not declare the buffer protocol


def _reduce_into(out: np.ndarray, views: Any, reduce: Reducer) -> None:
    dt, n = out.dtype, out.shape[0]
    uf = getattr(reduce, "ufunc", None)  # a plain ufunc kernel: combine the first two slots straight into out
    if uf is not None:
        uf(np.frombuffer(views[0], dt, n), np.frombuffer(views[1], dt, n), out=out)
        rest = views[2:]
    else:
        out[...] = np.frombuffer(views[0], dt, n)
        rest = views[1:]
    for v in rest:
        reduce(out, np.frombuffer(v, dt, n))


#: (ufunc, dtype) -> (op, type) codes of the compiled arena's own reductions (``Arena.exchange_reduce``)
_FUSED: Dict[Tuple[Any, np.dtype], Tuple[int, int]] = {
    (uf, np.dtype(dt)): (op, code)
    for uf, op in ((np.add, 0), (np.multiply, 1), (np.minimum, 2), (np.maximum, 3))
    for dt, code in (("float32", 0), ("float64", 1), ("int32", 2), ("int64", 3))
}


def _fused(a: Any, comm: Any, buf: np.ndarray, reduce: Reducer, here: bool) -> bool:
    """Publish and (``here``) reduce in one compiled call where the arena has one for this op and dtype."""
    xr = getattr(a, "exchange_reduce", None)
    if xr is None:
        return False
    codes = _FUSED.get((getattr(reduce, "ufunc", None), buf.dtype))
    return codes is not None and xr(buf, codes[0], codes[1], comm.check_word(), comm.deadline, here)


def allreduce_arena(comm: Any, buf: np.ndarray, reduce: Reducer) -> None:
    """Everyone publishes ``buf``; everyone reduces all slots in member order into ``buf``."""
    a = _arena(comm)
    if _fused(a, comm, buf, reduce, True):
        return
    views = a.exchange(_bytes(buf), comm.check_word(), comm.deadline)
    _reduce_into(buf, views, reduce)


def queue_for(a: Any, nbytes: int) -> Any:
    """The arena ``a``'s one-way queue where a call of ``nbytes`` bytes takes it (1 to its ``max_bytes``), else
    None."""
    q = getattr(a, "queue", None)
    return q if q is not None and 0 < nbytes <= q.max_bytes else None


def reduce_queue(q: Any, buf: np.ndarray, reduce: Reducer, me: int, root: int, check: int, deadline: Any) -> None:
    """One-way reduce through queue ``q``: a non-root writes ``buf`` and returns; the root reduces every member's
    data (its own: ``buf``) in member order into ``buf`` (compiled where it can, else numpy)."""
    src = buf if buf.flags.c_contiguous else np.ascontiguousarray(buf)
    if me != root:
        q.post(_bytes(src), check, root, deadline)
        return
    codes = _FUSED.get((getattr(reduce, "ufunc", None), buf.dtype))
    if codes is not None and src is buf and q.gather_reduce(buf, codes[0], codes[1], check, deadline):
        return
    views = q.gather(check, deadline)
    try:
        views[root] = _bytes(src.copy())
        _reduce_into(buf, views, reduce)
    finally:
        q.ack()


def bcast_queue(q: Any, buf: np.ndarray, me: int, root: int, check: int, deadline: Any) -> None:
    """One-way broadcast through queue ``q``: the root writes ``buf`` and returns; the others copy it."""
    if me == root:
        q.post(_bytes(buf if buf.flags.c_contiguous else np.ascontiguousarray(buf)), check, root, deadline)
    elif buf.flags.c_contiguous:
        q.read(_bytes(buf), check, root, deadline)
    else:
        tmp = np.empty_like(buf, order="C")
        q.read(_bytes(tmp), check, root, deadline)
        buf[...] = tmp


def reduce_arena(comm: Any, buf: np.ndarray, reduce: Reducer, root: int) -> None:
    """Everyone publishes ``buf``; the root reduces all slots in member order (one-way through the queue where
    it fits)."""
    a = _arena(comm)
    q = queue_for(a, buf.nbytes)
    if q is not None:
        reduce_queue(q, buf, reduce, comm.rank, root, comm.check_word(), comm.deadline)
        return
    if _fused(a, comm, buf, reduce, comm.rank == root):
        return
    views = a.exchange(_bytes(buf), comm.check_word(), comm.deadline)
    if comm.rank == root:
        _reduce_into(buf, views, reduce)


def bcast_arena(comm: Any, buf: np.ndarray, root: int) -> None:
    """The root publishes ``buf``, the others publish nothing and copy the root's slot (one-way through the
    queue where it fits)."""
    me = comm.rank
    a = _arena(comm)
    q = queue_for(a, buf.nbytes)
    if q is not None:
        bcast_queue(q, buf, me, root, comm.check_word(), comm.deadline)
        return
    xc = getattr(a, "exchange_copy", None)  # the compiled path: publish, wait and copy in one call
    if xc is not None and buf.flags.c_contiguous:
        if (
            xc(buf, _EMPTY, root, comm.check_word(), comm.deadline)
            if me == root
            else xc(None, buf, root, comm.check_word(), comm.deadline)
        ):
            return
    views = a.exchange(_bytes(buf) if me == root else None, comm.check_word(), comm.deadline)
    if me != root:
        buf[...] = np.frombuffer(views[root], buf.dtype, buf.shape[0])


def allgather_arena(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Everyone publishes ``sendbuf``; ``recvbuf`` gets every slot in member order."""
    a = _arena(comm)
    xc = getattr(a, "exchange_copy", None)  # the compiled path: publish, wait and gather in one call
    if (
        xc is not None
        and recvbuf.nbytes == sendbuf.nbytes * len(a.members)
        and recvbuf.flags.c_contiguous
        and xc(sendbuf, recvbuf, -1, comm.check_word(), comm.deadline)
    ):
        return
    views = a.exchange(_bytes(sendbuf), comm.check_word(), comm.deadline)
    n = sendbuf.shape[0]
    dt = recvbuf.dtype
    for i, v in enumerate(views):
        recvbuf[i * n : (i + 1) * n] = np.frombuffer(v, dt, n)


def reduce_scatter_arena(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Reducer) -> None:
    """Everyone publishes ``sendbuf`` (p blocks); rank r reduces block r of every slot, in member order."""
    a = _arena(comm)
    xb = getattr(a, "exchange_reduce_block", None)  # the compiled path: publish, wait and reduce in one call
    if xb is not None and sendbuf.flags.c_contiguous and recvbuf.flags.c_contiguous:
        codes = _FUSED.get((getattr(reduce, "ufunc", None), recvbuf.dtype))
        if codes is not None and xb(
            sendbuf, recvbuf, codes[0], codes[1], comm.rank * recvbuf.nbytes, comm.check_word(), comm.deadline
        ):
            return
    views = a.exchange(_bytes(sendbuf), comm.check_word(), comm.deadline)
    k = recvbuf.nbytes
    lo = comm.rank * k
    _reduce_into(recvbuf, [v[lo : lo + k] for v in views], reduce)


def barrier_arena(comm: Any) -> None:
    """Everyone publishes nothing and waits for everyone."""
    _arena(comm).exchange(None, comm.check_word(), comm.deadline)
