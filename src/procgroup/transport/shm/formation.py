"""Formation of the shared-memory transport: segments created, exchanged through the store, attached, unlinked.

Formation is attach-then-unlink: publish the segment name (and pid) through
the store, create the segment, attach to every peer's, barrier through the
store, then unlink every segment name we know.  After the group has formed
/dev/shm holds nothing of the job, whatever happens to the processes; if
formation fails, the ``finally`` unlinks everything we learned about.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Dict, List, NamedTuple, Optional, cast

from ...deadline import Deadline
from ...errors import DistTimeoutError
from .. import _cma, _futex
from .._engine import delete_key_quiet
from .layout import (
    C_CMA,
    CTRL,
    HDR_SIZE,
    MAGIC,
    OFF_ADDR,
    Segment,
    attach_segment,
    choose_big_slot,
    choose_ring_size,
    create_segment,
    segment_prefix,
    unlink_quiet,
)
from .peers import PeerWatch, pid_namespace

__all__ = ["Formed", "form_segments"]

logger = logging.getLogger("procgroup.transport")


class Formed(NamedTuple):
    """What formation produced: our segment, every peer's segment, and the watch over the peers' processes."""

    seg: Segment
    peer_segs: Dict[int, Segment]
    watch: PeerWatch


def form_segments(
    store: Any,
    rank: int,
    world_size: int,
    local: List[int],
    *,
    job_id: str,
    prefix: str,
    ring_size: Optional[int],
    deadline: Deadline,
    cma: bool,
    big_slot: Optional[int] = None,
) -> Formed:
    """Create this rank's segment, attach to every local peer's, and unlink them all once everyone attached.

    Collective over ``local`` (sorted ranks sharing this host, ``rank`` among them), through ``store``
    keys under ``prefix``.  ``cma``: probe whether each peer's memory can be read with process_vm_readv
    (and record the answer in the peer's ring control block of our segment).  Raises DistTimeoutError
    past ``deadline`` (naming the ranks missing), PeerFailureError when a peer dies meanwhile, ConfigError
    for a bad ``ring_size`` or a full /dev/shm; on failure nothing stays mapped or in /dev/shm.
    ``big_slot``: bytes of each big-slot buffer (None: :func:`~.layout.choose_big_slot`'s default; 0: none).
    """
    peers = [r for r in local if r != rank]
    cap = choose_ring_size(len(peers), ring_size)
    big = choose_big_slot(len(local), big_slot)
    name = f"{segment_prefix(job_id)}{os.urandom(6).hex()}-r{rank}"  # (not secrets: its import costs ~10 ms)
    pidns = pid_namespace()
    learned = [name]
    watch = PeerWatch()
    seg: Optional[Segment] = None
    peer_segs: Dict[int, Segment] = {}
    ok = False
    try:
        store.set(f"{prefix}/seg/{rank}", json.dumps({"name": name, "pid": os.getpid(), "pidns": pidns}).encode())
        seg = create_segment(name, rank, world_size, peers, cap, big)
        for p in peers:
            info = json.loads(
                _store_get(store, rank, deadline, f"{prefix}/seg/{p}", f"rank {p} to publish its shared memory segment")
            )
            learned.append(info["name"])
            pid = int(info["pid"])
            same_ns = info.get("pidns") == pidns
            watch.add(p, pid, same_ns)
            pseg = attach_segment(
                info["name"], p, pid, rank=rank, deadline=deadline, peer_dead=functools.partial(_is_dead, watch, p)
            )
            peer_segs[p] = pseg
            if same_ns and cma and _probe_cma(pid, pseg):
                seg.i[(HDR_SIZE + seg.slot_of(p) * CTRL + C_CMA) // 4] = 1
        store.set(f"{prefix}/attached/{rank}", b"1")
        if peers:
            _store_wait(
                store,
                rank,
                deadline,
                [f"{prefix}/attached/{p}" for p in peers],
                "every local rank to attach to the shared memory segments",
            )
        ok = True
        delete_key_quiet(store, f"{prefix}/seg/{rank}")  # every peer attached, so every peer read it
    finally:
        for n in learned:  # attach-then-unlink: nothing of ours stays in /dev/shm
            unlink_quiet(n)
        if not ok:
            for s in peer_segs.values():
                s.close()
            if seg is not None:
                seg.close()
            watch.close()
    assert seg is not None
    return Formed(seg, peer_segs, watch)


def _is_dead(watch: PeerWatch, peer: int) -> bool:
    return peer in watch.dead()


def _probe_cma(pid: int, pseg: Segment) -> bool:
    """Can we process_vm_readv the memory of ``pid``?  Read its segment's magic through its own address."""
    if not _cma.AVAILABLE or pid <= 0:
        return False
    addr = pseg.q[OFF_ADDR // 8]
    if not addr:
        return False
    buf = bytearray(8)
    try:
        _cma.read(pid, _futex.buffer_address(buf), addr, 8)
    except OSError as e:
        logger.debug("shm: no cross-memory attach to pid %d (%s): large messages go through the ring", pid, e)
        return False
    return bytes(buf) == MAGIC


def _store_get(store: Any, rank: int, deadline: Deadline, key: str, what: str) -> bytes:
    try:
        return cast(bytes, store.get(key, timeout=deadline.remaining_or_none()))
    except (DistTimeoutError, TimeoutError) as e:
        raise DistTimeoutError(
            f"rank {rank}: shm transport setup: timed out after {deadline.elapsed():.2f}s waiting for {what}; "
            "did every rank call init_process_group? (extend with timeout=)"
        ) from e


def _store_wait(store: Any, rank: int, deadline: Deadline, keys: List[str], what: str) -> None:
    try:
        store.wait(keys, timeout=deadline.remaining_or_none())
    except (DistTimeoutError, TimeoutError) as e:
        missing = []
        try:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        except Exception:  # noqa: BLE001 - best effort detail for the message
            pass
        raise DistTimeoutError(
            f"rank {rank}: shm transport setup: timed out after {deadline.elapsed():.2f}s waiting for {what}"
            + (f" (missing ranks {', '.join(missing)})" if missing else "")
        ) from e
