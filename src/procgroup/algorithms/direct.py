"""Direct all-reduces for few ranks: every message posted at once, so each phase costs one hop.

Across hosts (the inter-host stage of the hierarchical and multi-leader all_reduces) there are few
ranks and every pair has its own connection, so the ``p - 1`` messages of a phase travel
concurrently.  Against recursive doubling (three serial hops for three ranks: fold in, exchange,
fold out) and the ring (``2(p - 1)`` serial hops) these need one hop (:func:`allreduce_direct`)
or two (:func:`allreduce_direct_rsag`), for the same bytes per rank as the ring in the second case.

Results are bitwise identical on all ranks: :func:`allreduce_direct` has every rank fold the
operands in rank order (``((x0 op x1) op x2) ...``, the first pair taken in either order by the
commutative kernel); in :func:`allreduce_direct_rsag` each block is reduced by one rank, in a fixed
order, and copied to the others.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ..transport.base import Request
from ._util import P_AG, P_RD, P_RS, SLOT_TMP, partition, scratch_as, step, u8

__all__ = ["allreduce_direct", "allreduce_direct_rsag"]

Kernel = Callable[[np.ndarray, np.ndarray], None]

_ALL = step(P_RD, 0)
_RS = step(P_RS)
_AG = step(P_AG)


def _wait(comm: Any, reqs: Sequence[Optional[Request]]) -> None:
    for q in reqs:
        if q is not None:
            q.wait(comm.deadline)


def allreduce_direct(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """Every rank sends its whole buffer to every other rank and folds all ``p`` in rank order: one hop.

    Each rank sends and receives ``(p - 1) n`` elements (the ring moves ``2 n (p - 1) / p``): for
    latency-bound sizes on few ranks.  Scratch: ``(p - 1) n`` elements.
    """
    p, r = comm.size, comm.rank
    n = buf.shape[0]
    if p == 1 or n == 0:
        return
    tmp = scratch_as(comm, (p - 1) * n, buf.dtype, SLOT_TMP)

    def slot(j: int) -> np.ndarray:  # where rank j's buffer arrives
        k = j if j < r else j - 1
        return tmp[k * n : (k + 1) * n]

    peers = [j for j in range(p) if j != r]
    bind: Any = getattr(comm, "phases", None)
    ex = bind(peers, peers) if bind is not None else None
    sent: Optional[List[Request]] = None
    if ex is not None:  # the phase in one call, bound once (tcp between hosts: no per-message layers)
        try:
            sent = ex.run(_ALL, [u8(buf)] * len(peers), [u8(slot(j)) for j in peers])
        finally:
            ex.end()
    if sent is None:
        recvs = [comm.irecv(j, u8(slot(j)), _ALL) for j in peers]
        sent = [comm.isend(j, u8(buf), _ALL) for j in peers]
        comm.wait_all(recvs)  # all at once (tcp: one compiled read of every socket)
    acc: Optional[np.ndarray] = None  # x0 op ... op x(r-1), folded while our sends are in flight
    for j in range(r):
        if acc is None:
            acc = slot(j)
        else:
            reduce(acc, slot(j))
    _wait(comm, sent)  # buf is read by the sends until here
    if acc is not None:
        reduce(buf, acc)  # x_r op (x0 ... x(r-1)): the same bits as the other order (commutative kernel)
    for j in range(r + 1, p):
        reduce(buf, slot(j))


def allreduce_direct_rsag(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """Direct reduce-scatter, then direct all-gather: two hops, the ring's bytes.

    Rank ``r`` receives block ``r`` from every rank at once and reduces it (its own first, then
    ranks ``r + 1, r + 2, ...`` modulo ``p``), then sends it to every rank.  Block sizes differ by at
    most one element; empty blocks are not sent.  Scratch: ``(p - 1)`` blocks.
    """
    p, r = comm.size, comm.rank
    n = buf.shape[0]
    if p == 1 or n == 0:
        return
    offs = partition(n, p)
    mine = buf[offs[r] : offs[r + 1]]
    m = mine.shape[0]
    tmp = scratch_as(comm, (p - 1) * m, buf.dtype, SLOT_TMP)

    def slot(j: int) -> np.ndarray:
        k = j if j < r else j - 1
        return tmp[k * m : (k + 1) * m]

    peers = [(r + k) % p for k in range(1, p)]
    bind: Any = getattr(comm, "phases", None)
    ex = bind(peers, peers) if bind is not None and m and all(offs[j + 1] > offs[j] for j in peers) else None
    if ex is not None:
        # both phases in one call each, bound once (tcp between hosts: no per-message layers); the connections
        # stay claimed from the first phase to end()
        blocks = [u8(buf[offs[j] : offs[j + 1]]) for j in peers]
        try:
            sent = ex.run(_RS, blocks, [u8(slot(j)) for j in peers])
            if sent is not None:
                for j in peers:
                    reduce(mine, slot(j))
                own = u8(mine)
                got = ex.run(_AG, [own] * len(peers), blocks)
        finally:
            ex.end()
        if sent is not None:
            if got is None:  # the phase goes as messages
                back = [comm.irecv(j, b, _AG) for j, b in zip(peers, blocks)]
                got = [comm.isend(j, own, _AG) for j in peers]
                comm.wait_all(back)
            _wait(comm, sent)
            _wait(comm, got)
            return
    recvs = {j: comm.irecv(j, u8(slot(j)), _RS) for j in peers} if m else {}
    # the all-gather's receives are posted now too, into the blocks that the reduce-scatter sends from: rank j's
    # block comes back only after j has received our part of it (it reduces every part first), so it never
    # overwrites bytes still to be sent; posted early, a fast peer's block lands in place instead of in an
    # unexpected-message copy (3 netns hosts, 1 MiB hierarchical all_reduce: 0.5 such copies a call per leader)
    gets: List[Optional[Request]] = [
        comm.irecv(j, u8(buf[offs[j] : offs[j + 1]]), _AG) if offs[j + 1] > offs[j] else None for j in peers
    ]
    sends: List[Optional[Request]] = [
        comm.isend(j, u8(buf[offs[j] : offs[j + 1]]), _RS) if offs[j + 1] > offs[j] else None for j in peers
    ]
    comm.wait_all(list(recvs.values()))
    for j in recvs:
        reduce(mine, slot(j))
    puts: List[Optional[Request]] = [comm.isend(j, u8(mine), _AG) for j in peers] if m else []
    comm.wait_all(gets)
    _wait(comm, sends)
    _wait(comm, puts)
