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

Users: all_to_all's streams above ``select.BIG_LIMIT['all_to_all']`` (``alltoall_shm``), and broadcasts above
``select.BIG_LIMIT['broadcast']`` among three or more ranks (:func:`bcast_direct`): every reader copies the root's
buffer at once, where the scatter + all-gather of messages moves each byte through the rings twice.  At 64 MiB
on 2 CPUs that took 23.7-24.0 against 16.2-16.7 ms at N=4 and 16.1-18.0 against 9.6-9.7 at N=3 (at 32 MiB
11.1-11.4 against 8.5-8.6, and 8.0-8.4 against 5.1-5.3; slowest rank per call, median).  At N=2 the message
path reads the root's buffer with two threads and wins (5.0 against 7.0 ms), so it stays.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

__all__ = ["read_directly", "bcast_direct", "address_of"]

#: ``read(i, out, addr)``: see ``Arena.reader``
Reader = Callable[[int, memoryview, int], None]

_SALT_BCAST = 0xB0C5_0000


def address_of(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer (0 when empty)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if view.nbytes else 0


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
    a.exchange(None, check ^ 0x5A5A_0000, dl)
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
