"""Broadcast: binomial tree (small) and scatter + ring all-gather (large, van de Geijn).

Data is moved as bytes; any dtype works.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ._util import P_BCAST, P_BCAST_RING, P_BCAST_SCATTER, exchange, lowbit, partition, step, u8

__all__ = ["bcast_binomial", "bcast_scatter_allgather"]


def _top(p: int) -> int:
    """Largest power of two < p (p >= 2); the root's first child distance."""
    m = 1
    while m * 2 < p:
        m *= 2
    return m


def bcast_binomial(comm: Any, buf: np.ndarray, root: int) -> None:
    """ceil(log2 p) rounds; every rank receives the whole buffer once."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    b = u8(buf)
    vr = (r - root) % p
    stp = step(P_BCAST)
    if vr == 0:
        m = _top(p)
    else:
        low = lowbit(vr)
        comm.recv((vr - low + root) % p, b, stp)
        m = low >> 1
    reqs = []
    while m >= 1:
        if vr + m < p:
            reqs.append(comm.isend((vr + m + root) % p, b, stp))
        m >>= 1
    comm.wait_all(reqs)


def bcast_scatter_allgather(comm: Any, buf: np.ndarray, root: int) -> None:
    """van de Geijn: binomial scatter of p byte blocks, then a ring all-gather.

    The root sends about n bytes in total instead of n * log2(p); every rank
    receives about 2n.  Blocks are in root-relative order.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    b = u8(buf)
    offs: List[int] = partition(b.size, p)
    vr = (r - root) % p

    def rng(lo: int, hi: int) -> np.ndarray:  # relative blocks [lo, hi)
        return b[offs[lo] : offs[min(hi, p)]]

    # -- scatter: vr's subtree is the relative ranks [vr, vr + lowbit(vr))
    stp = step(P_BCAST_SCATTER)
    if vr == 0:
        m = _top(p)
    else:
        low = lowbit(vr)
        part = rng(vr, vr + low)
        if part.size:
            comm.recv((vr - low + root) % p, part, stp)
        m = low >> 1
    reqs = []
    while m >= 1:
        c = vr + m
        if c < p:
            part = rng(c, c + m)
            if part.size:
                reqs.append(comm.isend((c + root) % p, part, stp))
        m >>= 1
    comm.wait_all(reqs)

    # -- ring all-gather of the blocks: relative rank vr owns block vr
    stp = step(P_BCAST_RING)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        si = (vr - s) % p
        ri = (vr - s - 1) % p
        exchange(comm, right, rng(si, si + 1), left, rng(ri, ri + 1), stp)
