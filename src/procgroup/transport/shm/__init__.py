"""Shared-memory transport for the ranks of one host.

Every rank owns one segment in /dev/shm holding its incoming rings, one
single-producer/single-consumer ring per local peer, its doorbell (a futex
word), its arena slots and its big slots.  The modules:

* :mod:`.layout` -- segment layout, naming, creation, attachment, cleanup, memory ordering;
* :mod:`.formation` -- segments exchanged through the store, attach-then-unlink;
* :mod:`.ring` -- the rings, their record format and the rendezvous (single-copy) records;
* :mod:`.doorbell` -- sleeping and waking (the public :class:`Doorbell` the router uses);
* :mod:`.peers` -- peer liveness;
* :mod:`.arena` -- shared slots for the small collectives of a host's ranks;
* :mod:`.bigarena` -- big double-buffered slots for the larger ones (issue 14 item 1);
* :mod:`.transport` -- :class:`ShmTransport`, which ties them to the matching engine.
"""

from __future__ import annotations

from ..base import ARENA_BYTES
from .arena import ARENA_SPIN, ARENA_SPIN_OVERSUBSCRIBED, ShmArena
from .doorbell import Doorbell
from .layout import (
    ARENA_GROUPS,
    DEFAULT_RING_SIZE,
    DEFAULT_SEGMENT_BUDGET,
    MIN_RING_SIZE,
    SHM_DIR,
    cleanup_job_segments,
    segment_prefix,
    shm_supported,
)
from .ring import CHUNK, RNDV_MIN
from .transport import DEFAULT_SLICE, DEFAULT_SPIN, ShmTransport

__all__ = [
    "ShmTransport",
    "Doorbell",
    "ShmArena",
    "shm_supported",
    "cleanup_job_segments",
    "SHM_DIR",
    "segment_prefix",
    "ARENA_BYTES",
    "ARENA_GROUPS",
    "ARENA_SPIN",
    "ARENA_SPIN_OVERSUBSCRIBED",
    "RNDV_MIN",
    "CHUNK",
    "DEFAULT_RING_SIZE",
    "MIN_RING_SIZE",
    "DEFAULT_SEGMENT_BUDGET",
    "DEFAULT_SPIN",
    "DEFAULT_SLICE",
]
