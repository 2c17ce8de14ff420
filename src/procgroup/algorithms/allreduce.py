"""All-reduce: recursive doubling, ring, reduce + broadcast, and hierarchical.

Every algorithm leaves bitwise-identical results on all ranks: each partial
result is either computed by exactly one rank and copied, or computed by two
ranks from the same two operands with a commutative kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError
from ._util import P_FOLD_IN, P_FOLD_OUT, P_RD, SLOT_TMP, SPAN, HostComm, SubComm, partition, scratch_as, step, u8
from .bcast import bcast_binomial
from .gathering import ring_allgather_inplace
from .reduction import reduce_binomial, ring_reduce_scatter_inplace

__all__ = [
    "allreduce_recursive_doubling",
    "allreduce_ring",
    "allreduce_reduce_bcast",
    "allreduce_hierarchical",
    "host_layout",
    "multileader_pieces",
    "stage_pieces",
    "StageChoices",
    "install_stage_choices",
]

Kernel = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class StageChoices:
    """How the hierarchical all_reduces pick the algorithm of each stage when the caller names none.

    ``all_reduce_flat(p, nbytes, nelems)`` (the stage between hosts), ``reduce(p, nbytes, nelems)`` and
    ``broadcast(p, nbytes)`` (within a host) return an algorithm.  The selection policy
    (:mod:`procgroup.algorithms.select`) installs its own on import, so this module never imports it.
    """

    all_reduce_flat: Callable[[int, int, int], Callable[..., None]]
    reduce: Callable[[int, int, int], Callable[..., None]]
    broadcast: Callable[[int, int], Callable[..., None]]
    #: ``host_reduce(host_comm, nbytes)`` / ``host_broadcast(host_comm, nbytes)``: the shared-slot algorithms for a
    #: host's members (a :class:`~procgroup.algorithms._util.HostComm`), or None where they do not apply
    host_reduce: Callable[[Any, int], Optional[Callable[..., None]]] = lambda comm, nbytes: None
    host_broadcast: Callable[[Any, int], Optional[Callable[..., None]]] = lambda comm, nbytes: None
    #: ``host_split(host_comm, nbytes)``: the multi-leader all_reduce's host stages in the host's shared slots,
    #: ``fn(host_comm, buf, reduce, between) -> bool`` (reduce-scatter, ``between(block)``, all-gather; False:
    #: nothing done, the messages then), or None
    host_split: Callable[[Any, int], Optional[Callable[..., bool]]] = lambda comm, nbytes: None
    #: ``multileader_chunk()``: the multi-leader all_reduce runs a buffer above this many bytes (and above
    #: ``multileader_whole()``) as consecutive pieces of at most this size (:func:`multileader_pieces`; 0: whole)
    multileader_chunk: Callable[[], int] = lambda: 0
    multileader_whole: Callable[[], int] = lambda: 0


_stages = StageChoices(
    all_reduce_flat=lambda p, nbytes, nelems: allreduce_recursive_doubling,
    reduce=lambda p, nbytes, nelems: reduce_binomial,
    broadcast=lambda p, nbytes: bcast_binomial,
)


def install_stage_choices(choices: StageChoices) -> None:
    """Make ``choices`` pick the stage algorithms of :func:`allreduce_hierarchical` and the multi-leader one."""
    global _stages
    _stages = choices


_RD0 = step(P_RD, 0)


def allreduce_recursive_doubling(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """log2 rounds of full-buffer exchanges; latency-optimal for small buffers.

    Non-power-of-two sizes fold first: of the first ``2*rem`` ranks (``rem = p -
    2**floor(log2 p)``) each even rank hands its data to the odd rank above it,
    sits out the doubling, and gets the result back at the end.
    """
    p, r = comm.size, comm.rank
    n = buf.shape[0]
    if p == 1 or n == 0:
        return
    if p == 2:  # one exchange: the common small case, without the general bookkeeping
        tmp = comm.scratch(buf.nbytes, SLOT_TMP)
        comm.sendrecv(1 - r, u8(buf), 1 - r, tmp, _RD0)
        reduce(buf, tmp.view(buf.dtype))
        return
    pof2 = 1
    while pof2 * 2 <= p:
        pof2 *= 2
    rem = p - pof2
    b = u8(buf)
    tmp = scratch_as(comm, n, buf.dtype, SLOT_TMP)
    tb = u8(tmp)
    if r < 2 * rem:
        if r % 2 == 0:
            comm.send(r + 1, b, step(P_FOLD_IN))
            newrank = -1
        else:
            comm.recv(r - 1, tb, step(P_FOLD_IN))
            reduce(buf, tmp)
            newrank = r // 2
    else:
        newrank = r - rem
    if newrank >= 0:
        mask = 1
        rnd = 0
        while mask < pof2:
            nd = newrank ^ mask
            peer = nd * 2 + 1 if nd < rem else nd + rem
            comm.sendrecv(peer, b, peer, tb, step(P_RD, rnd))
            reduce(buf, tmp)
            mask <<= 1
            rnd += 1
    if r < 2 * rem:
        if r % 2:
            comm.send(r - 1, b, step(P_FOLD_OUT))
        else:
            comm.recv(r + 1, b, step(P_FOLD_OUT))


def allreduce_ring(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """Ring reduce-scatter + ring all-gather over p blocks: bandwidth-optimal.

    Each rank sends and receives 2n(p-1)/p elements in 2(p-1) steps.  Block
    sizes differ by at most one element; n < p leaves some blocks empty (they
    are not sent).
    """
    p = comm.size
    n = buf.shape[0]
    if p == 1 or n == 0:
        return
    offs = partition(n, p)
    ring_reduce_scatter_inplace(comm, buf, offs, reduce)
    ring_allgather_inplace(comm, buf, offs)


def allreduce_reduce_bcast(comm: Any, buf: np.ndarray, reduce: Kernel) -> None:
    """Binomial reduce to rank 0, then binomial broadcast: 2 ceil(log2 p) rounds."""
    if comm.size == 1 or buf.shape[0] == 0:
        return
    reduce_binomial(comm, buf, reduce, 0, preserve=False)
    bcast_binomial(comm, buf, 0)


def host_layout(hosts: List[str], size: int) -> List[List[int]]:
    """Group ranks by host key: lists of ranks (ascending), ordered by their lowest rank."""
    if len(hosts) != size:
        raise ConfigError(f"comm.hosts has {len(hosts)} entries for a group of {size} ranks")
    by: Dict[str, List[int]] = {}
    for i, h in enumerate(hosts):
        by.setdefault(h, []).append(i)
    return list(by.values())


def uniform_layout(hosts: List[List[int]]) -> bool:
    """Every host has the same number (> 1) of ranks, and there is more than one host."""
    return len(hosts) > 1 and len(hosts[0]) > 1 and all(len(h) == len(hosts[0]) for h in hosts)


def multileader_pieces(n: int, per: int, itemsize: int, chunk: int, whole: int = 0) -> List[Tuple[int, int]]:
    """The element ranges ``[a, b)`` that :func:`allreduce_multileader` runs one after the other for ``n`` elements
    of ``itemsize`` bytes on hosts of ``per`` ranks: the whole buffer up to ``chunk`` bytes (0: always) or up to
    ``whole`` bytes, else the fewest pieces of at most ``chunk`` bytes whose size, a multiple of ``per`` elements
    (equal blocks), is the same for all but a shorter last one.  Every rank computes the same ranges from values
    all of them agree on."""
    if chunk <= 0 or n * itemsize <= max(chunk, whole) or n < 2 * per:
        return [(0, n)]
    k = -(-(n * itemsize) // chunk)
    while True:  # k pieces of ceil(n / k) elements rounded up to whole blocks; one more while that passes the chunk
        each = -(-n // k)
        size = -(-each // per) * per
        if size * itemsize <= chunk or size <= per:
            break
        k += 1
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def stage_pieces(n: int, per: int, itemsize: int) -> List[Tuple[int, int]]:
    """:func:`multileader_pieces` with the installed stage choices' chunk and whole size: the pieces
    :func:`allreduce_multileader` runs and its bound form (``hierbind.bind_multileader``) binds, from one function
    so that bound and unbound ranks cut alike."""
    return multileader_pieces(n, per, itemsize, _stages.multileader_chunk(), _stages.multileader_whole())


def allreduce_multileader(
    comm: Any, buf: np.ndarray, reduce: Kernel, inter_allreduce: Optional[Callable[..., None]] = None
) -> None:
    """Hierarchical all_reduce where every rank leads one slice: for L ranks on each of H hosts.

    1. within each host, ring reduce-scatter: local rank i holds slice i reduced over its host;
    2. local rank i of every host all-reduces slice i with its counterparts (L concurrent
       all_reduces across hosts, each 1/L of the bytes);
    3. within each host, ring all-gather of the slices.

    Against :func:`allreduce_hierarchical` (whole buffer reduced to one leader, all-reduced among
    the leaders, broadcast back) the host-local stages move half the bytes and every rank, not one
    per host, drives the traffic between hosts.  Needs the same number of ranks on every host
    (:func:`uniform_layout`); otherwise it runs :func:`allreduce_hierarchical`.

    A buffer above the stage choices' ``multileader_whole()`` bytes runs as consecutive pieces
    (:func:`multileader_pieces`), each all three stages: a piece's host stages then take one step of the
    big slots, and the ranks meet again after every piece, where a whole buffer's steps wait at each sync
    for a partner whose stage between hosts ended at another time.
    """
    p, n = comm.size, buf.shape[0]
    if p == 1 or n == 0:
        return
    hosts = host_layout(list(comm.hosts), p)
    per = len(hosts[0])
    if not uniform_layout(hosts) or n < per:
        allreduce_hierarchical(comm, buf, reduce)
        return
    pieces = stage_pieces(n, per, buf.dtype.itemsize)
    if len(pieces) > 1:
        for a, b in pieces:
            allreduce_multileader(comm, buf[a:b], reduce, inter_allreduce)
        return
    mine = next(h for h in hosts if comm.rank in h)
    li = mine.index(comm.rank)
    inter = SubComm(comm, [h[li] for h in hosts], 2 * SPAN)
    ha = getattr(comm, "host_arena", None)
    host = HostComm(comm, mine, 1 * SPAN, ha) if ha is not None else None
    split = _stages.host_split(host, buf.nbytes) if host is not None else None
    if split is not None:  # the host's stages in its shared slots: block li, all-reduced across hosts in between

        def across(part: np.ndarray) -> None:
            f = inter_allreduce or _stages.all_reduce_flat(len(hosts), part.nbytes, part.shape[0])
            f(inter, part, reduce)

        if split(host, buf, reduce, across):
            return
    offs = partition(n, per)
    ring_reduce_scatter_inplace(SubComm(comm, mine, 1 * SPAN), buf, offs, reduce)
    part = buf[offs[li] : offs[li + 1]]
    if part.shape[0]:
        f = inter_allreduce or _stages.all_reduce_flat(len(hosts), part.nbytes, part.shape[0])
        f(inter, part, reduce)
    ring_allgather_inplace(SubComm(comm, mine, 3 * SPAN), buf, offs)


def allreduce_hierarchical(
    comm: Any,
    buf: np.ndarray,
    reduce: Kernel,
    intra_reduce: Optional[Callable[..., None]] = None,
    inter_allreduce: Optional[Callable[..., None]] = None,
    intra_bcast: Optional[Callable[..., None]] = None,
) -> None:
    """Reduce within each host to its lowest rank, all-reduce among those leaders, broadcast within hosts.

    Only one rank per host talks across hosts.  The three stages run on
    sub-groups with disjoint step ranges.  The stage algorithms default to the
    size-based choices of :mod:`procgroup.algorithms.select`.
    """
    p = comm.size
    if p == 1 or buf.shape[0] == 0:
        return
    hosts = host_layout(list(comm.hosts), p)
    mine = next(h for h in hosts if comm.rank in h)
    leaders = [h[0] for h in hosts]
    nbytes = buf.nbytes
    # the host's shared slots, where it has them (a group spanning hosts: Comm.host_arena): the host's buffers are
    # reduced into its leader's and the leader's result broadcast through them, without messages
    ha = getattr(comm, "host_arena", None) if len(mine) > 1 else None
    host = HostComm(comm, mine, 1 * SPAN, ha) if ha is not None else None
    fold = _stages.host_reduce(host, nbytes) if host is not None and intra_reduce is None else None
    spread = _stages.host_broadcast(host, nbytes) if host is not None and intra_bcast is None else None
    if fold is not None:
        fold(host, buf, reduce, 0)
    elif len(mine) > 1:
        local = SubComm(comm, mine, 1 * SPAN)
        f = intra_reduce or _stages.reduce(len(mine), nbytes, buf.shape[0])
        if f is reduce_binomial:
            reduce_binomial(local, buf, reduce, 0, preserve=False)
        else:
            f(local, buf, reduce, 0)
    if comm.rank == mine[0] and len(leaders) > 1:
        inter = SubComm(comm, leaders, 2 * SPAN)
        g = inter_allreduce or _stages.all_reduce_flat(len(leaders), nbytes, buf.shape[0])
        g(inter, buf, reduce)
    if spread is not None:
        spread(host, buf, 0)
    elif len(mine) > 1:
        local = SubComm(comm, mine, 3 * SPAN)
        h = intra_bcast or _stages.broadcast(len(mine), nbytes)
        h(local, buf, 0)
