"""One-copy reads between the ranks of one host: large pieces read straight out of their owners' buffers (issue 14).

Where a group's arena can read every other member's memory (``Arena.reader``: process_vm_readv on the shm
transport), a rank that needs a large piece of another's buffer can copy it in one step, with no help from the
owner, instead of the two copies of a message or a shared slot.  :func:`read_directly` is the protocol every
user shares:

1. one arena exchange: every rank publishes whether it can read the others and the addresses it offers (the
   same number of words on every rank);
2. every rank reads the same flags, so either all go on -- each runs its reads against the others' offers -- or
   all return False and the caller takes its message algorithm (nothing was moved);
3. one more arena exchange ends the call: an owner keeps its buffer unchanged until every reader is done.

The two exchanges carry the call's check word salted per use, so calls that disagree never meet.

Users (times: slowest rank per call, median of same-minute runs on 2 CPUs, messages -> one-copy reads):

* all_to_all's streams above ``select.BIG_LIMIT['all_to_all']`` (``alltoall_shm``; where its headers already
  carry every address, it skips the first exchange and ends with the same closing one, ``END_SALT``);
* broadcasts above ``select.ONECOPY_MIN['broadcast']`` among three or more ranks where the big slots do not take
  them (a group without big slots; ``select.BIG_LIMIT``) (:func:`bcast_direct`): every reader copies the root's
  buffer at once, where the scatter + all-gather of messages moves each byte through the rings twice.  64 MiB:
  N=4 23.7-24.0 -> 16.2-16.7 ms, N=3 16.1-18.0 -> 9.6-9.7; 32 MiB: N=4 11.1-11.4 -> 8.5-8.6, N=3 8.0-8.4 ->
  5.1-5.3.  At N=2 the messages win (the rendezvous reads the root's buffer with two threads: 5.0 against 7.0 ms
  at 64 MiB), so N=2 keeps them.  Where a group has big slots they win at every size (``select``'s docstring);
* all_gathers above ``select.ONECOPY_MIN['all_gather']`` among three or more ranks, likewise (:func:`allgather_direct`):
  each rank reads every other's part, where the ring passes each part on p - 1 times.  N=4, 4 / 16 / 32 MiB a
  rank: 6.3 / 23.5 / 44.4 -> 5.5 / 20.6 / 41.1 ms; at N=2 the two tie (0.70-0.75, 4.8-4.9 and 9.8-10.0 ms), so
  N=2 keeps the ring;
* all_reduce and reduce_scatter of a group without big slots (:func:`allreduce_onecopy`,
  :func:`reduce_scatter_onecopy`; ``limits.ONECOPY_MIN`` has the numbers): each rank reduces its slice, reading
  it out of every other rank's buffer, where the messages' ring passes it on p - 1 times.  The all_reduce then needs a
  middle exchange (every slice reduced) before each rank reads the others' slices back: three exchanges in all.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import BrokenError
from ..procfs import pid_alive
from ..transport.base import READ_BCAST, READ_GATHER, RR_ALLREDUCE, RR_REDSCAT, address_of
from ._util import reduce_chain
from .arena import _FUSED

logger = logging.getLogger("procgroup.algorithms")

__all__ = [
    "read_directly",
    "bcast_direct",
    "bcast_pair",
    "allgather_direct",
    "allreduce_onecopy",
    "reduce_scatter_onecopy",
    "slice_bounds",
    "END_SALT",
    "SALT_ALLGATHER",
    "SALT_BCAST",
    "SALT_ALLREDUCE",
    "SALT_REDSCAT",
    "MID_SALT",
]

#: ``read(i, out, addr)``: see ``Arena.reader``
Reader = Callable[[int, memoryview, int], None]

#: folded into the check word of the exchange that ends a call (its first exchange has the call's own)
END_SALT = 0x5A5A_0000
#: folded into the check word of a broadcast's reads (the plans' compiled call uses it too)
SALT_BCAST = 0xB0C5_0000
#: folded into the check word of an all_gather's reads (the plans' compiled call uses it too)
SALT_ALLGATHER = 0xA11_0000
#: folded into the check word of an all_reduce's / a reduce_scatter's reads (the compiled call's and the Python
#: protocol's alike)
SALT_ALLREDUCE = 0xA11E_0000
SALT_REDSCAT = 0x5CA7_0000
#: folded into the check word of an all_reduce's middle exchange (every slice reduced; _native_rr.c's RR_MID_SALT)
MID_SALT = 0x3D3D_0000
_SALT_PAIR = 0xB0C2_0000
#: a pair broadcast's first exchange: can move (reader, and writer on the root), buffer address, flag word
_PAIR = struct.Struct("<QQQ")
_IDLE, _WRITING, _DONE = 0, 1, 2  # the root's flag
_HERE, _GONE = 1, 0  # the reader's flag
#: seconds a reader that leaves a pair broadcast early (an error) waits for the root's write in progress to end
PAIR_WRITE_WAIT = 10.0


def read_directly(
    comm: Any, check: int, offer: Sequence[int], reads: Callable[[Reader, List[Tuple[int, ...]]], None]
) -> bool:
    """The protocol of the module docstring: publish ``offer`` (addresses; as many on every rank) with ``check``,
    then, where every rank can read every other, ``reads(read, offers)`` (``offers[i]``: rank i's words) and a
    closing exchange; True.  False, having moved nothing, where a rank cannot (every rank returns the same)."""
    a = comm.arena
    dl = comm.deadline
    read = a.reader()
    fmt = struct.Struct(f"<{len(offer) + 1}Q")
    views = a.exchange(memoryview(fmt.pack(read is not None, *offer)), check, dl)
    heads = [fmt.unpack_from(v) for v in views]
    if read is None or not all(h[0] for h in heads):
        return False
    reads(read, [h[1:] for h in heads])
    a.exchange(None, check ^ END_SALT, dl)
    return True


def _compiled(comm: Any, mode: int, send: Any, recv: Any, check: int, root: int) -> Optional[bool]:
    """The protocol of :func:`read_directly` for ``mode`` (``transport.base.READ_*``) in one compiled call
    (``Arena.bind_read``: same slots and check words); None where there is none or it refused the sizes (nothing
    published), and the caller runs the protocol in Python."""
    fn = comm.arena.bind_read(mode)
    return None if fn is None else fn(send, recv, check, check ^ END_SALT, root, comm.deadline)


def bcast_direct(comm: Any, buf: np.ndarray, root: int) -> bool:
    """``root``'s ``buf`` (C-contiguous) to every rank, each reader copying it straight out of the root's memory;
    False (nothing done) where a rank cannot read the others: the caller's message algorithm then runs."""
    view = buf.data.cast("B")
    me = comm.rank
    check = comm.check_word() ^ SALT_BCAST
    done = _compiled(comm, READ_BCAST, view, view, check, root)
    if done is not None:
        return done

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        if me != root:
            read(root, view, offers[root][0])

    return read_directly(comm, check, [address_of(view) if me == root else 0], reads)


def bcast_pair(comm: Any, buf: np.ndarray, root: int) -> bool:
    """``root``'s ``buf`` (C-contiguous) to the other rank of a group of two, the one copy split between both CPUs:
    the root writes the second half (from a page boundary) straight into the other rank's buffer
    (``Arena.writer``: process_vm_writev) while that rank reads the first half out of the root's (``Arena.reader``).
    False (nothing moved, on both ranks alike) where either cannot: the caller's algorithm then runs.

    The root writes into memory it does not own, so it must never write once the other rank has left the call (an
    error there: its deadline, an abort, an interrupt), when that buffer may already serve something else.  The
    first exchange publishes a flag word beside each rank's address, and the two run Dekker's handshake on it
    (``Arena.fence`` between each one's store and load): the root stores "writing" and then writes only if the
    reader still says "here"; a reader leaving early stores "gone" and then, where the root already said
    "writing", waits (:data:`PAIR_WRITE_WAIT`, while the root lives) for its "done".  At least one of them sees
    the other's store, so either the root skips the write (and raises) or the reader waits it out."""
    a = comm.arena
    view = buf.data.cast("B")
    me, n, peer = comm.rank, view.nbytes, 1 - comm.rank
    dl = comm.deadline
    check = comm.check_word() ^ _SALT_PAIR
    read = a.reader()
    write = a.writer() if me == root else None
    able = read is not None and (me != root or write is not None)
    # flag word: the reader's HERE, the root's IDLE; the views are this call's slots (the next call's first
    # exchange is the next to write them: this call's closing one takes the other parity)
    views = a.exchange(memoryview(_PAIR.pack(able, address_of(view), _HERE if me != root else _IDLE)), check, dl)
    heads = [_PAIR.unpack_from(v) for v in views]
    if not all(h[0] for h in heads):
        return False
    mine, theirs = views[me][: _PAIR.size].cast("Q"), views[peer][: _PAIR.size].cast("Q")
    half = (n // 2) & ~4095  # a page boundary: the two copies touch no page in common
    if me == root:
        assert write is not None  # our flag said we can write, or no rank would be here
        mine[2] = _WRITING
        a.fence()
        try:
            if theirs[2] != _HERE:
                raise BrokenError(
                    f"rank {comm.global_rank(me)}: broadcast of {n} bytes to rank {comm.global_rank(peer)}: that "
                    "rank left the call (an error there) before this one wrote its half; nothing was written"
                )
            write(peer, view[half:], heads[peer][1] + half)
        finally:
            mine[2] = _DONE
    else:
        try:
            read(root, view[:half], heads[root][1])
            a.exchange(None, check ^ END_SALT, dl)
        except BaseException:
            mine[2] = _GONE
            a.fence()
            if theirs[2] == _WRITING:
                _wait_write(a, theirs, root, comm.global_rank(root))
            raise
        return True
    a.exchange(None, check ^ END_SALT, dl)
    return True


def _wait_write(a: Any, theirs: memoryview, root: int, grank: int) -> None:
    """A reader leaving early: wait for the root's write in progress (its flag "writing") to end."""
    pid = a.pid_of(root)
    end = time.monotonic() + PAIR_WRITE_WAIT
    pause = 20e-6
    while theirs[2] == _WRITING:
        if pid > 0 and not pid_alive(pid):
            return  # the root died: nothing writes any more
        if time.monotonic() > end:
            logger.error(
                "rank %d was still writing its half of a broadcast into this rank's buffer %.0f s after this rank "
                "left the call; that buffer may change until it is done",
                grank,
                PAIR_WRITE_WAIT,
            )
            return
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def allgather_direct(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool:
    """``recvbuf`` = every rank's ``sendbuf`` in rank order (both C-contiguous, same dtype), each rank copying the
    others' parts straight out of their memory; False (nothing done) where a rank cannot read the others."""
    p, me = comm.size, comm.rank
    sv = sendbuf.data.cast("B")
    n = sv.nbytes
    rv = recvbuf[: p * sendbuf.shape[0]].data.cast("B")
    check = comm.check_word() ^ SALT_ALLGATHER
    done = _compiled(comm, READ_GATHER, sv, rv, check, -1)
    if done is not None:
        return done

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        rv[me * n : (me + 1) * n] = sv
        for k in range(1, p):
            j = (me + k) % p  # each rank starts at its right neighbour: the reads spread over the owners
            read(j, rv[j * n : (j + 1) * n], offers[j][0])

    return read_directly(comm, check, [address_of(sv)], reads)


def slice_bounds(n: int, p: int, j: int) -> Tuple[int, int]:
    """Bytes ``[lo, hi)`` of member ``j``'s slice of an ``n``-byte buffer among ``p`` in :func:`allreduce_onecopy`:
    whole 64-byte lines (the last slice short), as the compiled call's."""
    lines = (n + 63) // 64
    return min(n, lines * j // p * 64), min(n, lines * (j + 1) // p * 64)


def _read_parts(read: Reader, offers: List[Tuple[int, ...]], me: int, own: np.ndarray, off: int) -> List[np.ndarray]:
    """Every member's piece at byte ``off`` of its offered buffer, as long as ``own`` (this member's, used as is),
    read into fresh arrays in member order: the inputs of a reduction by reads."""
    parts = []
    for j in range(len(offers)):
        part = own if j == me else np.empty_like(own)
        if j != me and own.size:
            read(j, part.data.cast("B"), offers[j][0] + off)
        parts.append(part)
    return parts


def _rr_compiled(comm: Any, mode: int, send: np.ndarray, recv: np.ndarray, check: int, reduce: Any) -> Optional[bool]:
    """The reduction by reads of ``mode`` (``transport.base.RR_*``) in one compiled call (``Arena.bind_reduce_read``);
    None where there is none, the reduction has no compiled kernel or the call refused (nothing published)."""
    codes = _FUSED.get((getattr(reduce, "ufunc", None), send.dtype))
    if codes is None:
        return None
    fn = comm.arena.bind_reduce_read(mode)
    return None if fn is None else fn(send, recv, check, codes[0], codes[1], comm.deadline)


def allreduce_onecopy(comm: Any, buf: np.ndarray, reduce: Any) -> bool:
    """``buf`` (C-contiguous, in place) = the reduction over ranks in rank order, no byte through shared memory: each
    rank reads its slice (:func:`slice_bounds`) of every other rank's ``buf`` and reduces it in its own; after a
    middle exchange each reads the others' reduced slices back.  False (nothing done) where a rank cannot read the
    others.  ``reduce(x, y)``: ``x op= y`` (``reduce.ufunc`` where set)."""
    p, me = comm.size, comm.rank
    check = comm.check_word() ^ SALT_ALLREDUCE
    done = _rr_compiled(comm, RR_ALLREDUCE, buf, buf, check, reduce)
    if done is not None:
        return done
    view = buf.data.cast("B")
    isz = buf.dtype.itemsize
    bounds = [slice_bounds(view.nbytes, p, j) for j in range(p)]
    lo, hi = bounds[me]

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        # our own slice copied: the result overwrites it before a later member's part is read
        parts = _read_parts(read, offers, me, buf[lo // isz : hi // isz].copy(), lo)
        if hi > lo:
            reduce_chain(buf[lo // isz : hi // isz], parts, reduce)
        comm.arena.exchange(None, check ^ MID_SALT, comm.deadline)
        for k in range(1, p):
            j = (me + k) % p
            jlo, jhi = bounds[j]
            if jhi > jlo:
                read(j, view[jlo:jhi], offers[j][0] + jlo)

    return read_directly(comm, check, [address_of(view)], reads)


def reduce_scatter_onecopy(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Any) -> bool:
    """``recvbuf`` = block ``rank`` of every rank's ``sendbuf`` (both C-contiguous, same dtype; ``p * len(recvbuf)``
    elements of it) reduced in rank order, each rank reading its block of the others' ``sendbuf``; ``recvbuf`` may
    overlap ``sendbuf``.  False (nothing done) where a rank cannot read the others."""
    me, m = comm.rank, recvbuf.shape[0]
    check = comm.check_word() ^ SALT_REDSCAT
    done = _rr_compiled(comm, RR_REDSCAT, sendbuf, recvbuf, check, reduce)
    if done is not None:
        return done
    isz = sendbuf.dtype.itemsize
    out = np.empty_like(recvbuf)  # written into recvbuf once no rank reads sendbuf any more (they may overlap)

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        reduce_chain(out, _read_parts(read, offers, me, sendbuf[me * m : (me + 1) * m], me * m * isz), reduce)

    if not read_directly(comm, check, [address_of(sendbuf.data.cast("B"))], reads):
        return False
    recvbuf[...] = out
    return True
