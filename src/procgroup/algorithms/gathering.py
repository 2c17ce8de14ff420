"""Gather, scatter, all-gather and all-gatherv.  Data moves as bytes (any dtype).

* gather / scatter: binomial tree (small: ceil(log2 p) rounds, staged in
  scratch in root-relative order) or linear (large: every block moves once,
  straight between the user's buffers).
* all_gather: Bruck (small: ceil(log2 p) rounds for any p) or ring (large).
* all_gatherv: binomial gather to rank 0 + binomial broadcast (small) or ring
  (large), with per-rank element counts.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ._util import (
    P_AG,
    P_BRUCK,
    P_GATHER,
    P_SCATTER,
    SLOT_STAGE,
    exchange,
    lowbit,
    prefix,
    step,
    u8,
)
from .bcast import bcast_binomial

__all__ = [
    "gather_binomial",
    "gather_linear",
    "scatter_binomial",
    "scatter_linear",
    "allgather_ring",
    "allgather_bruck",
    "allgatherv_ring",
    "allgatherv_gather_bcast",
    "ring_allgather_inplace",
]


def ring_allgather_inplace(comm: Any, buf: np.ndarray, offs: Sequence[int]) -> None:
    """Ring all-gather in place: rank r holds block r = ``buf[offs[r]:offs[r+1]]``; afterwards all blocks.

    p - 1 steps; at step s rank r forwards block r-s and receives block r-s-1.
    """
    p, r = comm.size, comm.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    stp = step(P_AG)
    for s in range(p - 1):
        si = (r - s) % p
        ri = (r - s - 1) % p
        exchange(comm, right, buf[offs[si] : offs[si + 1]], left, buf[offs[ri] : offs[ri + 1]], stp)


def _span(vr: int, p: int) -> int:
    """Size of the binomial subtree of relative rank vr: relative ranks [vr, vr + span)."""
    return p if vr == 0 else min(lowbit(vr), p - vr)


def _top_below(x: int) -> int:
    """Largest power of two < x (x >= 2)."""
    m = 1
    while m * 2 < x:
        m *= 2
    return m


def _root_buf(buf: Optional[np.ndarray], need: int, what: str, root: int) -> np.ndarray:
    if buf is None:
        raise ConfigError(f"{what} on the root (rank {root}) needs a buffer, got None")
    b = u8(buf)
    if b.size < need:
        raise ConfigError(f"{what} on the root (rank {root}) holds {b.size} bytes, needs {need} (group size x block)")
    return b


def gather_linear(comm: Any, sendbuf: np.ndarray, recvbuf: Optional[np.ndarray], root: int) -> None:
    """Every rank sends its block straight to the root (root receives them concurrently)."""
    p, r = comm.size, comm.rank
    sb = u8(sendbuf)
    blk = sb.size
    stp = step(P_GATHER)
    if r != root:
        if blk:
            comm.send(root, sb, stp)
        return
    rb = _root_buf(recvbuf, p * blk, "gather recvbuf", root)
    reqs = [comm.irecv(i, rb[i * blk : (i + 1) * blk], stp) for i in range(p) if i != root and blk]
    np.copyto(rb[r * blk : (r + 1) * blk], sb)
    comm.wait_all(reqs)


def gather_binomial(comm: Any, sendbuf: np.ndarray, recvbuf: Optional[np.ndarray], root: int) -> None:
    """Binomial-tree gather: inner ranks collect their subtree in scratch and forward it."""
    p, r = comm.size, comm.rank
    sb = u8(sendbuf)
    blk = sb.size
    if r == root:
        rb = _root_buf(recvbuf, p * blk, "gather recvbuf", root)
    if p == 1:
        np.copyto(rb[:blk], sb)
        return
    if blk == 0:
        return
    vr = (r - root) % p
    span = _span(vr, p)
    stp = step(P_GATHER)
    parent = (vr - lowbit(vr) + root) % p if vr else -1
    if span == 1:  # leaf
        comm.send(parent, sb, stp)
        return
    stage = rb[: p * blk] if (vr == 0 and root == 0) else comm.scratch(span * blk, SLOT_STAGE)
    reqs = []
    m = 1
    while m < span:
        cnt = min(m, span - m)
        reqs.append(comm.irecv((vr + m + root) % p, stage[m * blk : (m + cnt) * blk], stp))
        m <<= 1
    np.copyto(stage[:blk], sb)
    comm.wait_all(reqs)
    if vr:
        comm.send(parent, stage, stp)
    elif root != 0:
        # stage block i is rank (root + i) % p
        k = (p - root) * blk
        np.copyto(rb[root * blk : p * blk], stage[:k])
        np.copyto(rb[: root * blk], stage[k:])


def scatter_linear(comm: Any, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray, root: int) -> None:
    """The root sends every block straight to its rank."""
    p, r = comm.size, comm.rank
    rb = u8(recvbuf)
    blk = rb.size
    stp = step(P_SCATTER)
    if r != root:
        if blk:
            comm.recv(root, rb, stp)
        return
    sb = _root_buf(sendbuf, p * blk, "scatter sendbuf", root)
    reqs = [comm.isend(i, sb[i * blk : (i + 1) * blk], stp) for i in range(p) if i != root and blk]
    np.copyto(rb, sb[r * blk : (r + 1) * blk])
    comm.wait_all(reqs)


def scatter_binomial(comm: Any, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray, root: int) -> None:
    """Binomial-tree scatter: each inner rank receives its subtree's blocks and splits them on."""
    p, r = comm.size, comm.rank
    rb = u8(recvbuf)
    blk = rb.size
    if r == root:
        sb = _root_buf(sendbuf, p * blk, "scatter sendbuf", root)
    if p == 1:
        np.copyto(rb, sb[:blk])
        return
    if blk == 0:
        return
    vr = (r - root) % p
    span = _span(vr, p)
    stp = step(P_SCATTER)
    if vr == 0:
        if root == 0:
            stage = sb[: p * blk]
        else:
            stage = comm.scratch(p * blk, SLOT_STAGE)
            k = (p - root) * blk
            np.copyto(stage[:k], sb[root * blk : p * blk])
            np.copyto(stage[k:], sb[: root * blk])
    else:
        parent = (vr - lowbit(vr) + root) % p
        if span == 1:  # leaf
            comm.recv(parent, rb, stp)
            return
        stage = comm.scratch(span * blk, SLOT_STAGE)
        comm.recv(parent, stage, stp)
    reqs = []
    m = _top_below(span)
    while m >= 1:
        cnt = min(m, span - m)
        reqs.append(comm.isend((vr + m + root) % p, stage[m * blk : (m + cnt) * blk], stp))
        m >>= 1
    np.copyto(rb, stage[:blk])
    comm.wait_all(reqs)


def _check_allgather(comm: Any, sb: np.ndarray, rb: np.ndarray) -> int:
    blk = sb.size
    if rb.size < comm.size * blk:
        raise ConfigError(f"all_gather recvbuf holds {rb.size} bytes, needs {comm.size * blk} (group size x sendbuf)")
    return blk


def allgather_ring(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Ring all-gather: p - 1 steps, each forwarding one block to the right."""
    p, r = comm.size, comm.rank
    sb, rb = u8(sendbuf), u8(recvbuf)
    blk = _check_allgather(comm, sb, rb)
    np.copyto(rb[r * blk : (r + 1) * blk], sb)
    if p == 1 or blk == 0:
        return
    ring_allgather_inplace(comm, rb, [i * blk for i in range(p + 1)])


def allgather_bruck(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """Bruck: ceil(log2 p) rounds for any p.  Round k sends the first min(2^k, p-2^k)
    collected blocks to rank r - 2^k; a final rotation puts blocks in rank order."""
    p, r = comm.size, comm.rank
    sb, rb = u8(sendbuf), u8(recvbuf)
    blk = _check_allgather(comm, sb, rb)
    if p == 1 or blk == 0:
        np.copyto(rb[r * blk : (r + 1) * blk], sb)
        return
    stage = comm.scratch(p * blk, SLOT_STAGE)  # stage block i = rank (r + i) % p
    np.copyto(stage[:blk], sb)
    dist = 1
    rnd = 0
    while dist < p:
        cnt = min(dist, p - dist)
        exchange(
            comm,
            (r - dist) % p,
            stage[: cnt * blk],
            (r + dist) % p,
            stage[dist * blk : (dist + cnt) * blk],
            step(P_BRUCK, rnd),
        )
        dist <<= 1
        rnd += 1
    k = (p - r) * blk
    np.copyto(rb[r * blk : p * blk], stage[:k])
    np.copyto(rb[: r * blk], stage[k:])


def _check_allgatherv(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: Sequence[int]) -> List[int]:
    p, r = comm.size, comm.rank
    if len(counts) != p:
        raise ConfigError(f"all_gatherv needs one count per rank ({p}), got {len(counts)}")
    if any(int(c) < 0 for c in counts):
        raise ConfigError(f"all_gatherv counts must be >= 0, got {list(counts)}")
    offs = prefix(counts)
    if sendbuf.shape[0] != offs[r + 1] - offs[r]:
        raise ConfigError(f"all_gatherv: rank {r} sends {sendbuf.shape[0]} elements but counts[{r}] = {counts[r]}")
    if recvbuf.shape[0] < offs[p]:
        raise ConfigError(f"all_gatherv recvbuf holds {recvbuf.shape[0]} elements, needs sum(counts) = {offs[p]}")
    if sendbuf.dtype.itemsize != recvbuf.dtype.itemsize:
        raise ConfigError(f"all_gatherv: sendbuf ({sendbuf.dtype}) and recvbuf ({recvbuf.dtype}) element sizes differ")
    return offs


def allgatherv_ring(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: Sequence[int]) -> None:
    """Ring all-gather of variable-size blocks (empty blocks are not sent)."""
    r = comm.rank
    offs = _check_allgatherv(comm, sendbuf, recvbuf, counts)
    np.copyto(u8(recvbuf[offs[r] : offs[r + 1]]), u8(sendbuf))
    ring_allgather_inplace(comm, recvbuf, offs)


def allgatherv_gather_bcast(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: Sequence[int]) -> None:
    """Binomial gather to rank 0 then binomial broadcast: 2 ceil(log2 p) rounds.

    With root 0 every subtree is a contiguous rank range, so each rank gathers
    its subtree straight into its own ``recvbuf``: no staging.
    """
    p, r = comm.size, comm.rank
    offs = _check_allgatherv(comm, sendbuf, recvbuf, counts)
    np.copyto(u8(recvbuf[offs[r] : offs[r + 1]]), u8(sendbuf))
    if p == 1 or offs[p] == 0:
        return
    span = _span(r, p)
    stp = step(P_GATHER)
    reqs = []
    m = 1
    while m < span:
        cnt = min(m, span - m)
        part = recvbuf[offs[r + m] : offs[r + m + cnt]]
        if part.size:
            reqs.append(comm.irecv(r + m, u8(part), stp))
        m <<= 1
    comm.wait_all(reqs)
    if r:
        part = recvbuf[offs[r] : offs[r + span]]
        if part.size:
            comm.send(r - lowbit(r), u8(part), stp)
    bcast_binomial(comm, recvbuf[: offs[p]], 0)
