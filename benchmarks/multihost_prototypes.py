"""Prototype all_reduce algorithms for the multi-host benchmark (experiments, not library code).

``benchmarks/multihost.py --pg-force all_reduce=multileader`` registers these in every rank's
``procgroup.algorithms.select.ALGORITHMS`` (at run time; nothing under src/ is changed) and pins
the one named, so that a proposed change can be measured on the namespace hosts before it is
written into the library.  They use procgroup's algorithm building blocks as they are.

* ``multileader``: a hierarchical all_reduce in which every rank of a host is a leader for one
  slice of the buffer: intra-host ring reduce-scatter (L slices for L local ranks), then L
  concurrent inter-host all_reduces (local rank i of every host all-reduces slice i), then an
  intra-host ring all-gather.  Compared with ``allreduce_hierarchical`` (reduce the whole buffer to
  one leader per host, all-reduce among the leaders, broadcast the whole buffer) the intra-host
  stages move half as much (no gather to the leader, all-gather instead of a full broadcast) and
  every rank, not one per host, drives TCP traffic.  Needs the same number of ranks on every host
  (otherwise it falls back to ``allreduce_hierarchical``).
* ``ring_pipelined``: the flat ring all_reduce, its reduce-scatter steps cut into segments
  (``MHB_SEG_BYTES``, default 4 MiB) so that a segment is reduced while the next ones arrive.
* ``multileader_pipelined``: ``multileader`` with ``ring_pipelined`` between hosts.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

Kernel = Callable[[np.ndarray, np.ndarray], None]


def allreduce_multileader(comm: Any, buf: np.ndarray, reduce: Kernel, inter: Any = None) -> None:
    from procgroup.algorithms import select
    from procgroup.algorithms._util import SPAN, SubComm, partition
    from procgroup.algorithms.allreduce import allreduce_hierarchical, host_layout
    from procgroup.algorithms.gathering import ring_allgather_inplace
    from procgroup.algorithms.reduction import ring_reduce_scatter_inplace

    p, n = comm.size, buf.shape[0]
    if p == 1 or n == 0:
        return
    hosts = host_layout(list(comm.hosts), p)
    per = len(hosts[0])
    if any(len(h) != per for h in hosts) or n < per:
        allreduce_hierarchical(comm, buf, reduce)
        return
    mine = next(h for h in hosts if comm.rank in h)
    li = mine.index(comm.rank)
    offs = partition(n, per)
    if per > 1:
        ring_reduce_scatter_inplace(SubComm(comm, mine, 1 * SPAN), buf, offs, reduce)
    part = buf[offs[li]:offs[li + 1]]
    if len(hosts) > 1 and part.shape[0]:
        f = inter or select.choose_all_reduce_flat(len(hosts), part.nbytes, part.shape[0])
        f(SubComm(comm, [h[li] for h in hosts], 2 * SPAN), part, reduce)
    if per > 1:
        ring_allgather_inplace(SubComm(comm, mine, 3 * SPAN), buf, offs)


#: segment size of the pipelined ring (bytes); MHB_SEG_BYTES overrides it
SEG_BYTES = 4 << 20


def _ring_reduce_scatter_pipelined(comm: Any, buf: np.ndarray, offs: Any, reduce: Kernel) -> None:
    """ring_reduce_scatter_inplace with each step's block cut into segments: every segment's receive and
    send are posted at once, and segment j is reduced while j+1.. are still arriving (the transports'
    reader threads land data in posted buffers without the caller; numpy's add releases the GIL)."""
    import os

    from procgroup.algorithms._util import P_RS, partition, scratch_as, step, u8

    seg = int(os.environ.get("MHB_SEG_BYTES", SEG_BYTES))
    p, r = comm.size, comm.rank
    maxb = max(offs[i + 1] - offs[i] for i in range(p))
    tmp = scratch_as(comm, maxb, buf.dtype, 0)
    right, left = (r + 1) % p, (r - 1) % p
    stp = step(P_RS)
    isz = buf.dtype.itemsize

    def pieces(length: int) -> list:  # the same for the block's sender and receiver
        k = max(1, -(-length * isz // seg))
        o = partition(length, k)
        return [(o[j], o[j + 1]) for j in range(k) if o[j + 1] > o[j]]

    for s in range(p - 1):
        si, ri = (r - s - 1) % p, (r - s - 2) % p
        sb = buf[offs[si]:offs[si + 1]]
        rb = buf[offs[ri]:offs[ri + 1]]
        t = tmp[:rb.shape[0]]
        rq = [(a, b, comm.irecv(left, u8(t[a:b]), stp)) for a, b in pieces(rb.shape[0])]
        sq = [comm.isend(right, u8(sb[a:b]), stp) for a, b in pieces(sb.shape[0])]
        for a, b, q in rq:
            q.wait(comm.deadline)
            reduce(rb[a:b], t[a:b])
        for q in sq:
            q.wait(comm.deadline)


def allreduce_ring_pipelined(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """Ring all_reduce whose reduce-scatter overlaps the reduction with the transfer (segments)."""
    from procgroup.algorithms._util import partition
    from procgroup.algorithms.gathering import ring_allgather_inplace

    p, n = comm.size, buf.shape[0]
    if p == 1 or n == 0:
        return
    offs = partition(n, p)
    _ring_reduce_scatter_pipelined(comm, buf, offs, reduce)
    ring_allgather_inplace(comm, buf, offs)


def allreduce_multileader_pipelined(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """``multileader`` with the pipelined ring for the inter-host stage."""
    allreduce_multileader(comm, buf, reduce, inter=allreduce_ring_pipelined)


PROTOTYPES = {"all_reduce": {"multileader": allreduce_multileader, "ring_pipelined": allreduce_ring_pipelined,
                             "multileader_pipelined": allreduce_multileader_pipelined}}


def register() -> None:
    """Add the prototypes to procgroup's algorithm table (so that select.FORCE can name them)."""
    from procgroup.algorithms import select

    for coll, algos in PROTOTYPES.items():
        select.ALGORITHMS.setdefault(coll, {}).update(algos)
