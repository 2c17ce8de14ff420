"""Collectives above the arena size through big shared buffers (issue 14 item 1).

When a group's ranks share a host, its arena may carry big slots
(``comm.arena.big``, a :class:`~procgroup.transport.base.BigArena`): two
buffers of ``slot_bytes`` per member, in shared memory, and a counter per
member.  The collectives here move the payload in *steps* of at most one
buffer; step ``t`` uses buffers ``t & 1`` (``big.turn`` counts steps across
calls), so a member writes the next step while slower members still read
the last one:

* all_reduce: each member copies its chunk into its buffer; sync; member
  ``i`` reduces slice ``i`` of the chunk from every member's buffer, in
  member order (so every rank gets bit-identical results), into its own
  result and back into its buffer; sync; everyone copies the other slices
  out of their owners' buffers.  A reduce-scatter plus an all-gather in
  shared memory, with no messages (DeepSpeed's CPU shm all_reduce does the
  same; this one keeps the deadlines, peer-death checks and check words).
  Up to ``DIRECT_MAX`` (128 KiB) one sync instead: each member copies its
  whole buffer in and reduces every member's, in member order (fewer syncs
  beat fewer additions there: a sync costs a wake-up when a member is
  descheduled).
* reduce: the same, the root alone copying the slices out, or, while the
  root's reads (members x bytes) stay within ``REDUCE_DIRECT_READS``
  (512 KiB), reducing all after one sync.
  A non-root's last sync is one-way (``WAIT_NONE``): it publishes its part and
  returns, and only the root waits for it; the non-root's next write into a
  buffer first *settles* that step (``BigArena.settle``).  At N=4 on 2 CPUs
  that cut a 64 KiB reduce from 87 to 66 us (mean per call, median of
  alternating runs of benchmarks/results/pass9/loop.py).
* reduce_scatter: each member copies piece ``[a, a+k)`` of every block into
  its buffer; sync; member ``i`` reduces piece ``i`` of every buffer into its
  result.  One sync per step.
* broadcast: the root copies a chunk in; sync; the others copy it out.
* all_gather: each member copies a chunk of its input in; sync; everyone
  copies every member's chunk out.

Where the big slots run the compiled path (``ShmBigArena.native``), the one-sync all_reduce/reduce is one C
call (copy in, sync, reduce), broadcast and all_gather one per step (copy in, sync, copy out), and the split
path reduces its slices in C; the results are numpy's, in member order, on either path.

Broadcast and all_gather use steps of 1/PIPE_PARTS of the message (at least
64 KiB, at most a buffer and at most STEP_MAX) so that the root's copy-in of
the next step overlaps the others' copy-out of this one; in a group of two
members, whole steps of at most STEP_MAX (``PIPE_PARTS_PAIR``).

Safety of the double buffering: a member reads step ``t``'s buffers only
before it publishes its first sync of step ``t + 1``, and writes step
``t + 2``'s buffers (the same ones) only after that sync completed on every
member (after a one-way sync, on its settle).  Every call announces a check
word (the call's sequence number and fingerprint, the op, the size, the
root), so members of different calls never pass a sync together (see
:mod:`procgroup.transport.shm.bigarena`).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Callable, List, Optional

import numpy as np

from ..errors import ConfigError
from ..transport.base import WAIT_ALL, WAIT_NONE
from ._util import reduce_chain as _reduce_chain
from ._util import scratch_as
from .arena import _FUSED

__all__ = [
    "big_of",
    "allreduce_big",
    "allreduce_big_split",
    "bind_bcast",
    "bind_reduce",
    "bind_reduce_scatter",
    "reduce_big",
    "reduce_scatter_big",
    "bcast_big",
    "allgather_big",
    "PIPE_MIN",
]

Reducer = Callable[[np.ndarray, np.ndarray], None]

#: broadcast / all_gather: the smallest step (bytes) of the pipelined copy, and how many steps a message
#: within one buffer is cut into (more steps overlap the copy in with the copy out, but each is a sync)
PIPE_MIN = 64 << 10
PIPE_PARTS = 2
#: ... in a group of two members: the step's sync costs more than the overlap buys.  ``procgroup bench`` whole
#: runs alternating (6 rounds, median), N=2, 1 part / 2 parts: broadcast 256 KiB / 1 / 4 MiB 0.67 / 0.80 / 0.73x
#: (5-6 of 6 rounds), all_gather 1 / 4 MiB 0.92 / 0.92x, 16 and 64 MiB even; 3 netns hosts x 2 ranks, whose
#: hierarchical all_reduce ends in a broadcast within each host, 256 KiB 0.85x (7 of 8 rounds).  At N=4 two
#: parts stay (all_gather 4 MiB: one part 1.07x in 6 of 6 rounds)
PIPE_PARTS_PAIR = 1
#: ... and the largest step, below a buffer's 1 MiB: steps of a whole buffer have a slow mode on the 2-CPU
#: development VM (L2: 1 MiB a core), where 512 KiB steps do not.  Same-size runs alternating, back to back,
#: slowest rank per call: broadcast N=2 4 / 16 / 64 MiB 95-521 / 522-1768 / 6162-6299 us in 1 MiB steps (fast
#: or slow by the minute), 130-140 / 526-550 / 3176-3245 in 512 KiB steps; N=4 1140-1155 / 4468-4920 /
#: 18295-18427 against 334-451 / 1616-1639 / 7912-8304; all_gather N=2, 1 / 2 / 4 MiB a member, 198-223 / 392-427
#: / 792-827 in one step or 1 MiB steps against 102-105 / 197-202 / 387-399, N=4 756-787 / 1549-1637 / 3233-3303
#: against 407-525 / 828-844 / 1878-1943.  256 KiB steps: no better.
STEP_MAX = 512 << 10
#: scratch slot of reduce's non-root partial results (not used by the primitives in ``_util``)
SLOT_BIG = 24

_OP_ALLREDUCE, _OP_REDUCE, _OP_REDSCAT, _OP_BCAST, _OP_ALLGATHER, _OP_DIRECT = 1, 2, 3, 4, 5, 6
#: all_reduce up to this many bytes: one sync, then every rank reduces the whole message from every member's
#: buffer (as the small arena does), instead of a slice each and a second sync to gather the slices.  Above it
#: the slices win: 256 KiB at N=2 35-37 against 40 us, 192 KiB 30-32 against 31-36, 128 KiB 25-26 against 24
#: (mean per call); at N=4 256 KiB 182 against 224 us (slowest rank per call, median)
DIRECT_MAX = 128 << 10
#: reduce: one sync while the root's reads (members x bytes) stay within this: its non-roots then only write
#: (a one-way step) and the root alone reduces.  256 KiB at N=2 29 against 36 us; at N=4 (1 MiB of reads) the
#: slices 144-174 against 187-209 us (slowest rank per call, median)
REDUCE_DIRECT_READS = 512 << 10
_CHECK = struct.Struct("<IIqqqq")


def big_of(comm: Any) -> Optional[Any]:
    """The group's big slots (``comm.arena.big``), or None."""
    a = comm.arena
    return None if a is None else a.big


def _slots(comm: Any) -> Any:
    big = big_of(comm)
    if big is None:
        raise ConfigError(
            "the big-slot algorithms need a group whose ranks share a host, with big slots "
            "(PROCGROUP_SHM_BIG_SLOT not 0, group id below transport.shm.layout.BIG_GROUPS)"
        )
    return big


def _check(comm: Any, op: int, nbytes: int, dtype: np.dtype, root: int = -1, step: int = 0) -> int:
    """The call's check word: the group's (sequence number, fingerprint) folded with op, size, dtype, root and the
    bytes of a pipelined step (broadcast, all_gather: members that would cut the message differently never pass a
    sync together)."""
    return zlib.crc32(_CHECK.pack(comm.check_word(), op, nbytes, root, dtype.num, step))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are the same elements of the same memory (address, shape, strides and dtype)."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.shape == b.shape
        and a.strides == b.strides
        and a.dtype == b.dtype
    )


def _typed(arrs: List[np.ndarray], nbytes: int, dt: np.dtype) -> List[np.ndarray]:
    return [x[:nbytes].view(dt) for x in arrs]


def _put(big: Any, k: int, dst: np.ndarray, at: int, src: np.ndarray, pieces: bool) -> None:
    """``dst[at : at + len(src)] = src``, ``dst`` being this member's buffer ``k`` (typed): through ``big.put``
    (:class:`~procgroup.transport.base.BigArena`; the shm one streams the copy past the caches where the readers
    gain by it) where ``src`` is C-contiguous."""
    n = src.shape[0]
    if n and src.flags.c_contiguous:
        big.put(k, at * dst.itemsize, src, pieces)
    else:
        dst[at : at + n] = src


def _pipe_elems(nbytes: int, itemsize: int, slot: int, members: int) -> int:
    """Elements per step of a pipelined copy among ``members``: 1/PIPE_PARTS of the message (PIPE_PARTS_PAIR for two
    members), within [PIPE_MIN, min(slot, STEP_MAX)]."""
    parts = PIPE_PARTS_PAIR if members == 2 else PIPE_PARTS
    target = min(slot, STEP_MAX, max(PIPE_MIN, (nbytes // parts + 4095) & ~4095))
    return max(1, target // itemsize)


def _one_step(big: Any) -> int:
    """The most bytes a member's part of an all_gather may have to go in one step: a buffer, at most STEP_MAX."""
    return min(big.slot_bytes, STEP_MAX)


def _reduce_direct(comm: Any, buf: np.ndarray, reduce: Reducer, root: int) -> None:
    """all_reduce (``root`` < 0) or reduce to ``root`` of one buffer's worth: copy in, sync, reduce it all."""
    big = _slots(comm)
    dt = buf.dtype
    big.begin(_check(comm, _OP_DIRECT, buf.nbytes, dt, root), comm.deadline)
    k = big.turn & 1
    keep = root < 0 or comm.rank == root
    # a reduce's non-root is one-way: it writes its part and goes on; the root alone waits for every part
    wait = WAIT_ALL if keep else WAIT_NONE
    sr = getattr(big, "sync_reduce", None)  # the compiled path: copy in, sync and reduce in one call
    if sr is not None and buf.flags.c_contiguous:
        codes = _FUSED.get((getattr(reduce, "ufunc", None), dt))
        # a reduce's root: nobody reads its buffer, so (member 0 or 1) it reduces its own part from buf
        if codes is not None and sr(buf, k, codes[0], codes[1], keep, comm.deadline, wait, root < 0):
            big.turn += 1
            return
    arrs = _typed(big.arrays[k], buf.nbytes, dt)
    big.turn += 1
    arrs[comm.rank][...] = buf
    big.sync(comm.deadline, wait)
    if keep:
        _reduce_chain(buf, arrs, reduce)  # every part from shared memory: buf (private) is only written


def _reduce_slices(comm: Any, buf: np.ndarray, reduce: Reducer, root: int) -> None:
    """all_reduce (``root`` < 0) or reduce to ``root``: reduce-scatter + gather through the big slots."""
    big = _slots(comm)
    if buf.nbytes <= big.slot_bytes and (
        buf.nbytes <= DIRECT_MAX if root < 0 else buf.nbytes * comm.size <= REDUCE_DIRECT_READS
    ):
        return _reduce_direct(comm, buf, reduce, root)
    p, me, dl = comm.size, comm.rank, comm.deadline
    dt = buf.dtype
    isz = dt.itemsize
    n = buf.shape[0]
    step = big.slot_bytes // isz
    big.begin(_check(comm, _OP_ALLREDUCE if root < 0 else _OP_REDUCE, buf.nbytes, dt, root), dl)
    keep = root < 0 or me == root  # may overwrite buf with results
    # our own slice stays in buf for the reduction (saves its copy in), except where the result overwrites it
    # before it is read (members 2.. when the result goes to buf: left-to-right order reads it third or later;
    # member 1 too when the kernel is not a ufunc: _reduce_chain then copies parts[0] into out first)
    own_in_shm = keep and (me >= 2 or (me == 1 and getattr(reduce, "ufunc", None) is None))
    # the compiled reduction (member order, numpy's results), reading our own part from buf where it stays there
    codes = _FUSED.get((getattr(reduce, "ufunc", None), dt)) if buf.flags.c_contiguous else None
    red = getattr(big, "reduce_into", None) if codes is not None and buf.flags.aligned else None
    rop, rty = codes if codes is not None else (0, 0)
    # a reduce's non-root does not wait at the gather step (one-way: the root alone reads it); it settles that
    # step before it writes the next one's buffer
    gather = WAIT_ALL if keep else WAIT_NONE
    for a in range(0, n, step):
        k = min(step, n - a)
        kk = big.turn & 1
        arrs = _typed(big.arrays[kk], k * isz, dt)
        big.turn += 1
        mine = arrs[me]
        lo, hi = k * me // p, k * (me + 1) // p
        big.settle(dl)
        if own_in_shm:
            _put(big, kk, mine, 0, buf[a : a + k], True)
        else:
            _put(big, kk, mine, 0, buf[a : a + lo], True)
            _put(big, kk, mine, hi, buf[a + hi : a + k], True)
        big.sync(dl)
        if hi > lo:
            out = buf[a + lo : a + hi] if keep else scratch_as(comm, hi - lo, dt, SLOT_BIG)
            own = None if own_in_shm else buf[a + lo : a + hi]
            if red is None or not red(out, (big.turn - 1) & 1, lo * isz, rop, rty, own):
                parts = [x[lo:hi] for x in arrs]
                if not own_in_shm:
                    parts[me] = buf[a + lo : a + hi]
                _reduce_chain(out, parts, reduce)
            _put(big, kk, mine, lo, out, root >= 0)  # an all_reduce's members read it whole, a reduce's root alone
        big.sync(dl, gather)
        if keep:
            for j in range(p):
                if j != me:
                    jlo, jhi = k * j // p, k * (j + 1) // p
                    buf[a + jlo : a + jhi] = arrs[j][jlo:jhi]


def allreduce_big(comm: Any, buf: np.ndarray, reduce: Reducer) -> None:
    """``buf`` = the reduction over members, in place (reduce-scatter + all-gather in the big slots)."""
    _reduce_slices(comm, buf, reduce, -1)


def allreduce_big_split(comm: Any, buf: np.ndarray, reduce: Reducer, between: Callable[[np.ndarray], None]) -> bool:
    """One host's part of a multi-leader all_reduce across hosts, without messages within the host: the members
    reduce-scatter ``buf`` in the big slots (:func:`reduce_scatter_big`: member ``i`` holds block ``i`` reduced
    over the host), ``between(block)`` all-reduces block ``i`` with the counterparts on the other hosts (same
    local index, same member count: the same elements), and the members all-gather the blocks
    (:func:`allgather_big`).  Returns False, having done nothing, where the blocks would differ in size
    (elements not a multiple of the members): a choice of size and member count alone, so every member of a host
    makes the same one.  ``buf`` is 1-D and C-contiguous (``select.all_reduce`` flattened it)."""
    p = comm.size
    n = buf.shape[0]
    if n % p:
        return False
    m = n // p
    block = buf[comm.rank * m : (comm.rank + 1) * m]
    reduce_scatter_big(comm, buf, block, reduce)
    between(block)
    allgather_big(comm, block, buf)
    return True


def reduce_big(comm: Any, buf: np.ndarray, reduce: Reducer, root: int) -> None:
    """The reduction into ``root``'s ``buf`` (the others' ``buf`` unchanged), through the big slots."""
    _reduce_slices(comm, buf, reduce, root)


def reduce_scatter_big(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Reducer) -> None:
    """``recvbuf`` = block ``rank`` of ``sendbuf`` reduced over members in member order (one sync per step)."""
    big = _slots(comm)
    p, me, dl = comm.size, comm.rank, comm.deadline
    dt = recvbuf.dtype
    isz = dt.itemsize
    m = recvbuf.shape[0]
    step = max(1, big.slot_bytes // (isz * p))
    big.begin(_check(comm, _OP_REDSCAT, recvbuf.nbytes, dt), dl)
    blocks = sendbuf[: p * m].reshape(p, m)
    # our own block stays in sendbuf for the reduction (saves its copy in), unless the result overwrites it
    # before it is read: recvbuf inside sendbuf, except where it is our block itself and _reduce_chain reads
    # each of its elements before it writes it (member 0; member 1 when the kernel is a ufunc), as a multi-leader
    # all_reduce's host stage does
    own_in_shm = np.may_share_memory(sendbuf, recvbuf) and not (
        (me == 0 or (me == 1 and getattr(reduce, "ufunc", None) is not None)) and _same(recvbuf, blocks[me])
    )
    for a in range(0, m, step):
        k = min(step, m - a)
        kk = big.turn & 1
        arrs = _typed(big.arrays[kk], p * k * isz, dt)
        big.turn += 1
        mine = arrs[me].reshape(p, k)
        if k == m:  # one step: the blocks are whole rows of sendbuf (contiguous where it is)
            flat = sendbuf[: p * m]
            if own_in_shm:
                _put(big, kk, arrs[me], 0, flat, True)
            else:
                _put(big, kk, arrs[me], 0, flat[: me * m], True)
                _put(big, kk, arrs[me], (me + 1) * m, flat[(me + 1) * m :], True)
        elif own_in_shm:
            mine[...] = blocks[:, a : a + k]
        else:
            mine[:me] = blocks[:me, a : a + k]
            mine[me + 1 :] = blocks[me + 1 :, a : a + k]
        big.sync(dl)
        parts = [x[me * k : (me + 1) * k] for x in arrs]
        if not own_in_shm:
            parts[me] = blocks[me, a : a + k]
        _reduce_chain(recvbuf[a : a + k], parts, reduce)


def bind_reduce_scatter(
    big: Any, m: int, dt: np.dtype, p: int, me: int, reduce: Reducer
) -> Optional[Callable[[Any, np.ndarray, np.ndarray], None]]:
    """:func:`reduce_scatter_big` into ``m`` elements a member, for a plan's repeated calls on member ``me`` of
    ``p``: where the whole input fits one buffer (one step), the reduction has a compiled kernel and the big slots
    run compiled, ``fn(comm, sendbuf, recvbuf)`` copies the other members' blocks in, syncs and reduces its own
    block of every buffer in one compiled call (numpy's results, member order); else (None) the plan calls the
    selection.  Same step and check word as reduce_scatter_big."""
    codes = _FUSED.get((getattr(reduce, "ufunc", None), dt))
    nbytes = m * dt.itemsize
    if not getattr(big, "native", False) or codes is None or not 0 < p * nbytes <= big.slot_bytes:
        return None
    begin, sync, reduce_into, put = big.begin, big.sync, big.reduce_into, big.put
    rop, rty = codes

    def fn(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        ok = sendbuf.flags.c_contiguous and sendbuf.flags.aligned and recvbuf.flags.c_contiguous
        if not ok or not recvbuf.flags.aligned or np.may_share_memory(sendbuf, recvbuf):
            reduce_scatter_big(comm, sendbuf.reshape(-1), recvbuf.reshape(-1), reduce)
            return
        dl = comm.deadline
        begin(_check(comm, _OP_REDSCAT, nbytes, dt), dl)
        k = big.turn & 1
        big.turn += 1
        flat = sendbuf.reshape(-1)[: p * m]
        blocks = flat.reshape(p, m)
        put(k, 0, flat[: me * m], True)  # each member reads its own block: see ShmBigArena.put
        put(k, (me + 1) * nbytes, flat[(me + 1) * m :], True)
        sync(dl)
        reduce_into(recvbuf.reshape(-1)[:m], k, me * nbytes, rop, rty, blocks[me])

    return fn


def bind_split(
    big: Any, n: int, dt: np.dtype, p: int, me: int, reduce: Reducer
) -> Optional[Callable[[Any, np.ndarray, Callable[[np.ndarray], None]], None]]:
    """:func:`allreduce_big_split` of ``n`` elements for a plan's repeated calls on member ``me`` of ``p``: where
    the blocks are equal, the reduce-scatter and the all-gather each go in one step, the reduction has a compiled
    kernel and the big slots run compiled, ``fn(comm, buf, between)`` copies the other blocks in, syncs, reduces
    block ``me`` where it lies (members 0 and 1; the others copy theirs in too) in one compiled call, runs
    ``between(block)``, and all-gathers the blocks in one compiled call (:func:`bind_allgather`); else None.  Same
    steps and check words as :func:`reduce_scatter_big` and :func:`allgather_big`."""
    codes = _FUSED.get((getattr(reduce, "ufunc", None), dt))
    if n % p or codes is None or not getattr(big, "native", False):
        return None
    m = n // p
    bb = m * dt.itemsize
    if not 0 < p * bb <= big.slot_bytes:
        return None
    gather = bind_allgather(big, bb, dt)
    if gather is None:
        return None
    begin, sync, reduce_into, arrays = big.begin, big.sync, big.reduce_into, big.arrays
    rop, rty = codes

    def fn(comm: Any, buf: np.ndarray, between: Callable[[np.ndarray], None]) -> None:
        dl = comm.deadline
        blocks = buf.reshape(p, m)
        block = blocks[me]
        begin(_check(comm, _OP_REDSCAT, bb, dt), dl)
        k = big.turn & 1
        mine = arrays[k][me][: p * bb].view(dt).reshape(p, m)
        big.turn += 1
        mine[:me] = blocks[:me]
        mine[me + 1 :] = blocks[me + 1 :]
        if me > 1:  # the compiled reduction reads a member 0 or 1's own part from the output itself, no other
            mine[me] = block
        sync(dl)
        reduce_into(block, k, me * bb, rop, rty, block if me <= 1 else None)
        between(block)
        gather(comm, block, buf)

    return fn


def bind_allgather(big: Any, nbytes: int, dt: np.dtype) -> Optional[Callable[[Any, np.ndarray, np.ndarray], None]]:
    """:func:`allgather_big` of ``nbytes`` a member, for a plan's repeated calls: where the part goes in one step
    (:func:`_one_step`) and the big slots run compiled, ``fn(comm, sendbuf, recvbuf)`` does the check and the copy
    in, sync and copy out in one call, else (None) the plan calls allgather_big.  Same step and check word as
    allgather_big, so members on either path take part in the same call."""
    if not getattr(big, "native", False) or nbytes > _one_step(big):
        return None
    begin, sync_copy = big.begin, big.sync_copy

    def fn(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        begin(_check(comm, _OP_ALLGATHER, nbytes, dt, -1, nbytes), comm.deadline)
        if sync_copy(sendbuf, big.turn & 1, recvbuf, -1, 0, nbytes, nbytes, comm.deadline):
            big.turn += 1
        else:  # nothing was done (a size the compiled call refuses): the general path
            allgather_big(comm, sendbuf, recvbuf)

    return fn


def bind_bcast(big: Any, nbytes: int, dt: np.dtype, root: int, me: int) -> Optional[Callable[[Any, np.ndarray], None]]:
    """:func:`bcast_big` of ``nbytes`` from ``root``, for a plan's repeated calls on member ``me``: where the message
    is one step and the big slots run compiled, ``fn(comm, buf)`` does the check and the copy in, sync and copy out
    in one call, else (None) the plan calls the selection.  Same step and check word as bcast_big."""
    one = _pipe_elems(nbytes, dt.itemsize, big.slot_bytes, len(big.members)) * dt.itemsize >= nbytes
    if not getattr(big, "native", False) or not one:
        return None
    begin, sync_copy = big.begin, big.sync_copy

    def fn(comm: Any, buf: np.ndarray) -> None:
        dl = comm.deadline
        begin(_check(comm, _OP_BCAST, nbytes, dt, root, nbytes), dl)
        k = big.turn & 1
        if buf.flags.c_contiguous and (
            sync_copy(buf, k, None, 0, 0, 0, 0, dl) if me == root else sync_copy(None, k, buf, root, 0, 0, nbytes, dl)
        ):
            big.turn += 1
        else:  # nothing was done (a size or layout the compiled call refuses): the general path
            bcast_big(comm, buf, root)

    return fn


def bind_reduce(
    big: Any, nbytes: int, dt: np.dtype, p: int, me: int, root: int, reduce: Reducer
) -> Optional[Callable[[Any, np.ndarray], None]]:
    """The one-sync all_reduce (``root`` < 0) or reduce of :func:`_reduce_slices` for a plan's repeated calls on
    member ``me`` of ``p``: where that size takes the one-sync path, the reduction has a compiled kernel and the
    big slots run compiled, ``fn(comm, buf)`` does the check, the copy in, the sync and the reduction in one call
    (a reduce's non-root one-way, as there); else (None) the plan calls the selection."""
    codes = _FUSED.get((getattr(reduce, "ufunc", None), dt))
    direct = nbytes <= DIRECT_MAX if root < 0 else nbytes * p <= REDUCE_DIRECT_READS
    if not getattr(big, "native", False) or codes is None or nbytes > big.slot_bytes or not direct:
        return None
    keep = root < 0 or me == root
    wait = WAIT_ALL if keep else WAIT_NONE
    begin, sync_reduce = big.begin, big.sync_reduce
    rop, rty = codes

    def fn(comm: Any, buf: np.ndarray) -> None:
        dl = comm.deadline
        begin(_check(comm, _OP_DIRECT, nbytes, dt, root), dl)
        if buf.flags.c_contiguous and sync_reduce(buf, big.turn & 1, rop, rty, keep, dl, wait, root < 0):
            big.turn += 1
        else:  # not aligned: nothing was done, the general path
            _reduce_direct(comm, buf, reduce, root)

    return fn


def bcast_big(comm: Any, buf: np.ndarray, root: int) -> None:
    """``root``'s ``buf`` to every member: pipelined copy in, sync, copy out."""
    big = _slots(comm)
    me, dl = comm.rank, comm.deadline
    dt = buf.dtype
    isz = dt.itemsize
    n = buf.shape[0]
    step = _pipe_elems(buf.nbytes, isz, big.slot_bytes, comm.size)
    big.begin(_check(comm, _OP_BCAST, buf.nbytes, dt, root, min(step * isz, buf.nbytes)), dl)
    sc = getattr(big, "sync_copy", None) if buf.flags.c_contiguous else None  # the compiled path: one call a step
    for a in range(0, n, step):
        k = min(step, n - a)
        t = big.turn & 1
        if sc is not None and (
            sc(buf[a : a + k], t, None, 0, 0, 0, 0, dl)
            if me == root
            else sc(None, t, buf, root, a * isz, 0, k * isz, dl)
        ):
            big.turn += 1
            continue
        src = big.arrays[t][root][: k * isz].view(dt)
        big.turn += 1
        if me == root:
            src[...] = buf[a : a + k]
            big.sync(dl)
        else:
            big.sync(dl)
            buf[a : a + k] = src


def allgather_big(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """``recvbuf`` = every member's ``sendbuf`` in member order: pipelined copy in, sync, copy out."""
    big = _slots(comm)
    p, me, dl = comm.size, comm.rank, comm.deadline
    dt = recvbuf.dtype
    isz = dt.itemsize
    n = sendbuf.shape[0]
    # one step while a member's part fits one (a buffer, at most STEP_MAX): every member copies in at once, so a
    # second step overlaps nothing and costs a sync (N=2, 128 KiB and 512 KiB a member: 2 steps 35.1 and 80.1 us,
    # 1 step 32.7, 75.9); a larger part in steps of at most STEP_MAX
    one = sendbuf.nbytes <= _one_step(big)
    step = max(1, n) if one else _pipe_elems(sendbuf.nbytes, isz, big.slot_bytes, comm.size)
    big.begin(_check(comm, _OP_ALLGATHER, sendbuf.nbytes, dt, -1, min(step * isz, sendbuf.nbytes)), dl)
    out = recvbuf[: p * n].reshape(p, n)
    in_place: Optional[bool] = None  # our part of recvbuf is sendbuf itself (it stays as it is); the compiled call
    sc = None  # sees that itself: the compiled path: copy in, sync and copy out in one call per step
    if sendbuf.flags.c_contiguous and recvbuf.flags.c_contiguous and recvbuf.dtype == sendbuf.dtype:
        sc = getattr(big, "sync_copy", None)
    for a in range(0, n, step):
        k = min(step, n - a)
        t = big.turn & 1
        if sc is not None and sc(sendbuf[a : a + k], t, recvbuf, -1, a * isz, n * isz, k * isz, dl):
            big.turn += 1
            continue
        arrs = _typed(big.arrays[t], k * isz, dt)
        big.turn += 1
        arrs[me][...] = sendbuf[a : a + k]
        big.sync(dl)
        if in_place is None:
            in_place = _same(sendbuf, out[me])
        for j in range(p):
            if j != me:
                out[j, a : a + k] = arrs[j]
            elif not in_place:
                out[j, a : a + k] = sendbuf[a : a + k]
