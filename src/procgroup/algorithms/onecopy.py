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
  N=2 keeps the ring.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

from ..transport.base import address_of

__all__ = ["read_directly", "bcast_direct", "allgather_direct", "END_SALT"]

#: ``read(i, out, addr)``: see ``Arena.reader``
Reader = Callable[[int, memoryview, int], None]

#: folded into the check word of the exchange that ends a call (its first exchange has the call's own)
END_SALT = 0x5A5A_0000
_SALT_BCAST = 0xB0C5_0000
_SALT_ALLGATHER = 0xA11_0000


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


def bcast_direct(comm: Any, buf: np.ndarray, root: int) -> bool:
    """``root``'s ``buf`` (C-contiguous) to every rank, each reader copying it straight out of the root's memory;
    False (nothing done) where a rank cannot read the others: the caller's message algorithm then runs."""
    view = buf.data.cast("B")
    me = comm.rank

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        if me != root:
            read(root, view, offers[root][0])

    return read_directly(comm, comm.check_word() ^ _SALT_BCAST, [address_of(view) if me == root else 0], reads)


def allgather_direct(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> bool:
    """``recvbuf`` = every rank's ``sendbuf`` in rank order (both C-contiguous, same dtype), each rank copying the
    others' parts straight out of their memory; False (nothing done) where a rank cannot read the others."""
    p, me = comm.size, comm.rank
    sv = sendbuf.data.cast("B")
    n = sv.nbytes
    rv = recvbuf[: p * sendbuf.shape[0]].data.cast("B")

    def reads(read: Reader, offers: List[Tuple[int, ...]]) -> None:
        rv[me * n : (me + 1) * n] = sv
        for k in range(1, p):
            j = (me + k) % p  # each rank starts at its right neighbour: the reads spread over the owners
            read(j, rv[j * n : (j + 1) * n], offers[j][0])

    return read_directly(comm, comm.check_word() ^ _SALT_ALLGATHER, [address_of(sv)], reads)
