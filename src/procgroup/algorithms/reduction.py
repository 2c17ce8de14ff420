"""Reduce to a root and the ring reduce-scatter building blocks.

* :func:`reduce_binomial` -- binomial tree, ceil(log2 p) rounds (small messages).
* :func:`reduce_scatter_gather` -- ring reduce-scatter then every rank sends its
  reduced block to the root (Rabenseifner-style, large messages: about 2n
  bytes per rank in total instead of n log2 p through the tree).
* :func:`ring_reduce_scatter_inplace` / :func:`ring_reduce_scatter_into` -- the
  ring reduce-scatter used here, by all_reduce and by reduce_scatter.

``reduce(dst, src)`` is the in-place kernel of :func:`procgroup.ops.reducer`.
Non-root buffers are never modified (partial sums live in scratch).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np

from ._util import (
    P_GATHER,
    P_REDUCE,
    P_RS,
    SLOT_TMP,
    SLOT_TMP2,
    SLOT_WORK,
    exchange,
    lowbit,
    partition,
    scratch_as,
    step,
    u8,
)

__all__ = [
    "reduce_binomial",
    "reduce_scatter_gather",
    "ring_reduce_scatter_inplace",
    "ring_reduce_scatter_into",
]

Kernel = Callable[[np.ndarray, np.ndarray], None]


def reduce_binomial(comm: Any, buf: np.ndarray, reduce: Kernel, root: int, preserve: bool = True) -> None:
    """Binomial-tree reduce; the result lands in ``buf`` on ``root``.

    ``preserve=False`` lets non-root ranks use ``buf`` as their accumulator
    (for compositions that overwrite it afterwards, e.g. reduce + broadcast).
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    n = buf.shape[0]
    vr = (r - root) % p
    stp = step(P_REDUCE)
    # children: vr + m for m = 1, 2, 4, ... below lowbit(vr) (root: below p)
    limit = lowbit(vr) if vr else p
    children = []
    m = 1
    while m < limit and vr + m < p:
        children.append(vr + m)
        m <<= 1
    if children:
        if vr == 0 or not preserve:
            acc = buf
        else:
            acc = scratch_as(comm, n, buf.dtype, SLOT_TMP2)
            np.copyto(acc, buf)
        if n:
            tmp = scratch_as(comm, n, buf.dtype, SLOT_TMP)
            tb = u8(tmp)
            for c in children:
                comm.recv((c + root) % p, tb, stp)
                reduce(acc, tmp)
    else:
        acc = buf
    if vr:
        if n:
            comm.send((vr - lowbit(vr) + root) % p, u8(acc), stp)


def ring_reduce_scatter_inplace(comm: Any, buf: np.ndarray, offs: Sequence[int], reduce: Kernel) -> None:
    """Ring reduce-scatter in place: afterwards block ``rank`` of ``buf`` is reduced.

    Blocks are ``buf[offs[i]:offs[i+1]]``.  Other blocks hold partial sums.
    p - 1 steps; at step s rank r sends block r-s-1 and reduces block r-s-2.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    maxb = max(offs[i + 1] - offs[i] for i in range(p))
    tmp = scratch_as(comm, maxb, buf.dtype, SLOT_TMP)
    right, left = (r + 1) % p, (r - 1) % p
    stp = step(P_RS)
    for s in range(p - 1):
        si = (r - s - 1) % p
        ri = (r - s - 2) % p
        rlen = offs[ri + 1] - offs[ri]
        t = tmp[:rlen]
        exchange(comm, right, buf[offs[si] : offs[si + 1]], left, t, stp)
        if rlen:
            reduce(buf[offs[ri] : offs[ri + 1]], t)


def ring_reduce_scatter_into(comm: Any, src: np.ndarray, offs: Sequence[int], out: np.ndarray, reduce: Kernel) -> None:
    """Ring reduce-scatter reading ``src`` (never modified); block ``rank`` reduced into ``out``.

    Partial sums travel through two block-sized scratch buffers (no copy of
    ``src``).  ``out`` may alias ``src``'s own block.
    """
    p, r = comm.size, comm.rank
    own = src[offs[r] : offs[r + 1]]
    if p == 1:
        np.copyto(out, own)
        return
    maxb = max(offs[i + 1] - offs[i] for i in range(p))
    bufs = (scratch_as(comm, maxb, src.dtype, SLOT_TMP), scratch_as(comm, maxb, src.dtype, SLOT_TMP2))
    right, left = (r + 1) % p, (r - 1) % p
    stp = step(P_RS)
    si = (r - 1) % p
    send = src[offs[si] : offs[si + 1]]
    direct = not np.may_share_memory(out, src)
    for s in range(p - 1):
        ri = (r - s - 2) % p
        rlen = offs[ri + 1] - offs[ri]
        last = s == p - 2
        rb = out if (last and direct) else bufs[s % 2][:rlen]
        exchange(comm, right, send, left, rb, stp)
        if rlen:
            reduce(rb, src[offs[ri] : offs[ri + 1]])
        send = rb
    if not direct:
        np.copyto(out, send)


def reduce_scatter_gather(comm: Any, buf: np.ndarray, reduce: Kernel, root: int) -> None:
    """Ring reduce-scatter, then each rank sends its reduced block straight to the root.

    Bandwidth-optimal for large buffers: every rank sends and receives about
    2n(p-1)/p bytes.  Works for n < p and n not divisible by p (empty blocks
    send nothing).  Non-root ``buf`` is unchanged.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    n = buf.shape[0]
    offs: List[int] = partition(n, p)
    mine = offs[r + 1] - offs[r]
    if r == root:
        out = buf[offs[r] : offs[r + 1]]
    else:
        out = scratch_as(comm, mine, buf.dtype, SLOT_WORK)
    ring_reduce_scatter_into(comm, buf, offs, out, reduce)
    stp = step(P_GATHER)
    if r == root:
        reqs = []
        for i in range(p):
            if i != root and offs[i + 1] > offs[i]:
                reqs.append(comm.irecv(i, u8(buf[offs[i] : offs[i + 1]]), stp))
        comm.wait_all(reqs)
    elif mine:
        comm.send(root, u8(out), stp)
