"""Segment layout, naming and cleanup of the shared-memory transport.

Every rank owns one segment, ``/dev/shm/procgroup-<job>-<token>-r<rank>``,
holding its *incoming* rings, one single-producer/single-consumer ring per
local peer (slot ``i`` belongs to the ``i``-th local peer in rank order,
skipping the owner)::

    offset               size          contents
    0                    4096          segment header
      0    8  magic b"PGSHM\\0\\1\\0"
      8    4  layout version (2)
      12   4  state: 0 initialising, 1 ready, 2 closed (written by the owner)
      16   4  world size        20  4  owner rank
      24   8  owner pid         32  8  ring capacity C (power of two, >= 4096)
      40   4  number of slots S
      48   8  address of this segment in the owner's address space (the CMA probe)
      56   8  offset A of the arena region
      64   4  doorbell (futex word, own cache line)
      72   4  sleep flag: 1 while an owner thread may be asleep on the doorbell
      80   8  big-slot buffer size L (0: no big slots)
      88   8  offset Z of the big-slot region
      128  4*S slot table: the source rank of each slot
    4096                 S * 128       ring control blocks, per slot:
      +0   8  head  (bytes ever written; written by the producer only)
      +8   4  want-space flag (written by the producer only)
      +16  4  CMA flag: the owner can process_vm_readv the producer's memory
               (written by the consumer at formation, before the attach barrier)
      +64  8  tail  (bytes ever consumed; written by the consumer only)
    align(4096)          S * C         ring data, slot i at data + i*C
    A                    G * 2 * (64 + B)  arena slots: group index g, parity k at
                                       A + (2g + k) * (64 + B); per slot
      +0   4  published count (u32, 0: never; written last)
      +4   4  check word
      +64  B  payload (B = ``ARENA_BYTES``)
    Q = A + 16 * 2 * (64 + B)  G * (64 + K * E)  one-way queues (:mod:`.queue`): group g at
                                       Q + g * (64 + K * E); control line
      +0   8  done: one-way calls of the group this rank completed (u64)
      +8   8  want: nonzero while this rank waits for the others' done words
      then K = ``QUEUE_DEPTH`` entries of E = 64 + P bytes (P = ``QUEUE_BYTES``),
      one-way call n in entry n % K; per entry
      +0   4  seq: n (u32, mod 2**32 - 1 + 1, never 0; written last)
      +4   4  check word: the writer's chain folded with the call's check word
      +64  P  payload
    Z                    BIG_GROUPS * (64 + 2 * L)  big slots (:mod:`.bigarena`): group g at
                                       Z + g * (64 + 2L); per slot
      +0   8  published count (u64, 0: never; written last)
      +8   4  check word
      +64  2L two buffers of L bytes, alternating by step

Memory ordering
---------------
x86-64 is TSO: stores become visible in program order and loads are not
reordered with older loads.  So "write the payload, then write ``head``"
(producer) and "read ``head``, then read the payload" (consumer) need no
fence, and likewise for ``tail`` in the other direction: each counter has a
single writer, and an aligned 8-byte store is atomic.  The only store->load
patterns (the want-space handshake, the doorbell's sleep flag) are fenced
with :func:`fence`, a lock-prefixed atomic (acquiring a ``threading.Lock``).
Other architectures would need real fences around the counters; the
transport logs a warning there.

Cleanup
-------
Formation (:mod:`.formation`) is attach-then-unlink: after the group has
formed, /dev/shm holds nothing of the job, whatever happens to the
processes.  :func:`cleanup_job_segments` removes what a gang killed during
formation left behind.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import platform
import re
import threading
import time
from typing import Callable, List, Optional

from ...config import SHM_DIR, SHM_SEGMENT_PREFIX
from ...deadline import Deadline
from ...errors import BrokenError, ConfigError, DistTimeoutError, PeerFailureError
from .. import _futex
from ..base import ARENA_BYTES

__all__ = [
    "SHM_DIR",
    "segment_prefix",
    "shm_supported",
    "cleanup_job_segments",
    "Segment",
    "create_segment",
    "attach_segment",
    "choose_ring_size",
    "fence",
    "ARENA_GROUPS",
    "QUEUE_DEPTH",
    "QUEUE_BYTES",
    "QUEUE_ENTRY",
    "QUEUE_GROUP",
    "BIG_GROUPS",
    "DEFAULT_BIG_SLOT",
    "choose_big_slot",
    "DEFAULT_RING_SIZE",
    "MIN_RING_SIZE",
]

logger = logging.getLogger("procgroup.transport")

#: madvise(MADV_POPULATE_WRITE): prefault a range writable (Linux >= 5.14; Python < 3.13 has no constant)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if platform.system() == "Linux" else 0)

MAGIC = b"PGSHM\x00\x01\x00"
VERSION = 4
ST_INIT, ST_READY, ST_CLOSED = 0, 1, 2
HDR_SIZE = 4096
OFF_VERSION, OFF_STATE, OFF_WS, OFF_OWNER, OFF_PID, OFF_CAP, OFF_NSLOTS, OFF_ADDR = 8, 12, 16, 20, 24, 32, 40, 48
OFF_ARENA = 56
OFF_BELL = 64
OFF_SLEEP = 72  # 1 while the owner has a thread asleep on its doorbell (ringers skip the wake syscall otherwise)
OFF_BIG, OFF_BIG_REGION = 80, 88  # big-slot buffer size (0: none) and offset of the big-slot region
OFF_SLOTS = 128
CTRL = 128  # control block per slot
C_HEAD, C_WANT, C_CMA, C_TAIL = 0, 8, 16, 64

#: groups with an id below this get arena slots (the world is group 0; new_group ids count up from 1)
ARENA_GROUPS = 16
ARENA_HDR = 64
ARENA_SLOT = ARENA_HDR + ARENA_BYTES
#: one-way queue (:mod:`.queue`) of every arena group: entries per member (a root runs at most this many one-way
#: calls ahead of the slowest member), payload bytes per entry (larger broadcasts/reduces take the arena slots)
QUEUE_DEPTH = 32
QUEUE_BYTES = 2048
QUEUE_CTL = 64
QUEUE_ENTRY = ARENA_HDR + QUEUE_BYTES
QUEUE_GROUP = QUEUE_CTL + QUEUE_DEPTH * QUEUE_ENTRY
#: groups with an id below this get big slots too (two buffers of the chosen size per member)
BIG_GROUPS = 4
#: default size of one big-slot buffer (``ShmOptions.big_slot`` / PROCGROUP_SHM_BIG_SLOT), and the least
#: worth having (less than this, when /dev/shm is small, and groups get no big slots)
DEFAULT_BIG_SLOT = 1 << 20
MIN_BIG_SLOT = 64 << 10

#: default ring capacity per (producer, consumer) pair
DEFAULT_RING_SIZE = 4 << 20
MIN_RING_SIZE = 4096
#: a rank's incoming rings take at most this much unless ring_size= says otherwise
DEFAULT_SEGMENT_BUDGET = 32 << 20

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: CPython's lock acquire is a lock-prefixed atomic RMW on x86."""
    _fence_lock.acquire()
    _fence_lock.release()


def _align(n: int, a: int) -> int:
    return (n + a - 1) & ~(a - 1)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def segment_prefix(job_id: str) -> str:
    """File-name prefix of every segment of ``job_id`` (for cleanup and tests)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id))[:48] or "job"
    return f"{SHM_SEGMENT_PREFIX}{safe}-"


def shm_supported() -> bool:
    """True when /dev/shm exists and is writable (the shm transport can work here)."""
    return os.name == "posix" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def cleanup_job_segments(job_id: str) -> List[str]:
    """Unlink every segment of ``job_id`` left in /dev/shm (e.g. by a gang SIGKILLed during formation).

    For launchers, after the whole gang is gone.  Returns the names removed; never raises (an unreadable
    directory or an unremovable file is skipped).
    """
    pre = segment_prefix(job_id)
    removed: List[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for n in names:
        if n.startswith(pre):
            try:
                os.unlink(os.path.join(SHM_DIR, n))
                removed.append(n)
            except OSError:
                pass
    return removed


def unlink_quiet(name: str) -> None:
    """Unlink segment ``name`` from /dev/shm; a missing one is fine, any other failure is logged, never raised."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - permissions
        logger.warning("could not unlink shared memory segment %s: %s", name, e)


class Segment:
    """One mapped segment: the mmap plus u32 (``i``) and u64 (``q``) views of it.

    ``layout()`` reads the ring geometry from the header (after the owner wrote it).
    """

    __slots__ = (
        "name",
        "mm",
        "q",
        "i",
        "addr",
        "cap",
        "nslots",
        "data_off",
        "size",
        "arena_off",
        "queue_off",
        "big",
        "big_off",
    )

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self.mm = mm
        self.size = len(mm)
        mv = memoryview(mm)
        self.q = mv.cast("Q")
        self.i = mv.cast("I")
        mv.release()
        self.addr = _futex.buffer_address(mm)
        self.cap = 0
        self.nslots = 0
        self.data_off = 0
        self.arena_off = 0
        self.queue_off = 0
        self.big = 0
        self.big_off = 0

    def layout(self) -> None:
        """Read capacity, slot count and the arena offset from the header."""
        self.cap = self.q[OFF_CAP // 8]
        self.nslots = self.i[OFF_NSLOTS // 4]
        self.data_off = HDR_SIZE + _align(self.nslots * CTRL, 4096)
        self.arena_off = self.q[OFF_ARENA // 8]
        self.queue_off = self.arena_off + ARENA_GROUPS * 2 * ARENA_SLOT
        self.big = self.q[OFF_BIG // 8]
        self.big_off = self.q[OFF_BIG_REGION // 8]

    def slot_of(self, src: int) -> int:
        """Index of the ring that rank ``src`` writes into; ConfigError if the segment has none for it."""
        for s in range(self.nslots):
            if self.i[OFF_SLOTS // 4 + s] == src:
                return s
        raise ConfigError(f"shared memory segment {self.name} has no ring for rank {src}")

    def prefault_rings(self) -> None:
        """Map the rings' pages into this process now (MADV_POPULATE_WRITE; Linux >= 5.14, else nothing).

        Otherwise the first pass of each ring through a mapping takes a page fault per 4 KiB, in the writer and
        again in the reader: +2 faults on every 4 KiB message until the ring has wrapped once (issue 14).
        """
        n = self.nslots * self.cap
        if not n or not _MADV_POPULATE_WRITE:
            return
        start = self.data_off & ~(mmap.PAGESIZE - 1)
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE, start, self.data_off + n - start)
        except (OSError, ValueError):  # an older kernel (EINVAL): the pages fault in on first use instead
            pass

    def data(self, slot: int) -> memoryview:
        """A view of the data area of ring ``slot`` (the caller releases it)."""
        off = self.data_off + slot * self.cap
        return memoryview(self.mm)[off : off + self.cap]

    def close(self) -> None:
        """Release the views and unmap; a view still exported elsewhere leaves the unmap to the GC."""
        for v in (self.q, self.i):
            try:
                v.release()
            except Exception:  # noqa: BLE001 - a released/exported view: nothing more to do
                pass
        try:
            self.mm.close()
        except BufferError:  # a data view is still exported somewhere; the GC will unmap it
            pass


def rings_size(nslots: int, cap: int) -> int:
    """Bytes of header, control blocks and ring data of a segment with ``nslots`` rings of ``cap`` bytes."""
    return HDR_SIZE + _align(nslots * CTRL, 4096) + nslots * cap


def big_region_size(big: int) -> int:
    """Bytes of the big-slot region for buffers of ``big`` bytes (0: none)."""
    return BIG_GROUPS * (ARENA_HDR + 2 * big) if big else 0


def segment_size(nslots: int, cap: int, big: int = 0) -> int:
    """Total size of a segment: its rings, the arena slots, the one-way queues and the big slots (buffers of
    ``big`` bytes)."""
    return rings_size(nslots, cap) + ARENA_GROUPS * (2 * ARENA_SLOT + QUEUE_GROUP) + big_region_size(big)


def choose_big_slot(nlocal: int, big_slot: Optional[int]) -> int:
    """The big-slot buffer size: ``big_slot`` if given (0: none; ConfigError unless 0 or a multiple of 4096
    >= MIN_BIG_SLOT), else the default, halved until every local rank's big slots fit in a quarter of /dev/shm
    (0 when not even MIN_BIG_SLOT does: groups then use the message-based algorithms above the arena size)."""
    if big_slot is not None:
        if big_slot and (big_slot < MIN_BIG_SLOT or big_slot % 4096):
            raise ConfigError(
                f"big_slot={big_slot} must be 0 (off) or a multiple of 4096 >= {MIN_BIG_SLOT} (PROCGROUP_SHM_BIG_SLOT)"
            )
        return big_slot
    if nlocal < 2:
        return 0
    big = DEFAULT_BIG_SLOT
    try:
        st = os.statvfs(SHM_DIR)
        budget = st.f_bavail * st.f_frsize // (4 * nlocal)
    except OSError:
        return big
    while big >= MIN_BIG_SLOT and big_region_size(big) > budget:
        big >>= 1
    return big if big >= MIN_BIG_SLOT else 0


def choose_ring_size(npeers: int, ring_size: Optional[int]) -> int:
    """The ring capacity: ``ring_size`` if given (ConfigError unless a power of two >= MIN_RING_SIZE),
    else the default, shrunk so every local rank's segment fits in half of /dev/shm."""
    if ring_size is not None:
        if ring_size < MIN_RING_SIZE or ring_size & (ring_size - 1):
            raise ConfigError(f"ring_size={ring_size} must be a power of two >= {MIN_RING_SIZE}")
        return ring_size
    if npeers == 0:
        return MIN_RING_SIZE
    budget = DEFAULT_SEGMENT_BUDGET
    try:
        st = os.statvfs(SHM_DIR)
        # leave room for every local rank's segment, and half of /dev/shm for others
        budget = min(budget, st.f_bavail * st.f_frsize // (2 * (npeers + 1)))
    except OSError:
        pass
    return max(MIN_RING_SIZE, min(DEFAULT_RING_SIZE, _pow2_floor(budget // npeers)))


def create_segment(name: str, rank: int, world_size: int, peers: List[int], cap: int, big: int = 0) -> Segment:
    """Create, size and initialise this rank's segment (state READY last).

    Raises ConfigError when /dev/shm has no room (naming the fixes), OSError for other failures.
    """
    size = segment_size(len(peers), cap, big)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)  # fail now with ENOSPC rather than SIGBUS later
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ConfigError(
                    f"not enough space in {SHM_DIR} for a {size >> 20} MiB shared memory segment "
                    f"({len(peers)} rings of {cap >> 10} KiB, big slots of {big >> 10} KiB): enlarge {SHM_DIR} "
                    "(docker: --shm-size), pass a smaller ring_size or PROCGROUP_SHM_BIG_SLOT, "
                    "or use PROCGROUP_TRANSPORT=tcp"
                ) from e
            os.ftruncate(fd, size)  # filesystems without fallocate
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    seg = Segment(name, mm)
    q, i = seg.q, seg.i
    mm[0:8] = MAGIC
    i[OFF_VERSION // 4] = VERSION
    i[OFF_WS // 4] = world_size
    i[OFF_OWNER // 4] = rank
    q[OFF_PID // 8] = os.getpid()
    q[OFF_CAP // 8] = cap
    i[OFF_NSLOTS // 4] = len(peers)
    q[OFF_ADDR // 8] = seg.addr  # where this segment lives in the owner's address space (the CMA probe)
    q[OFF_ARENA // 8] = rings_size(len(peers), cap)
    q[OFF_BIG // 8] = big
    q[OFF_BIG_REGION // 8] = segment_size(len(peers), cap)  # after the arena slots
    for s, p in enumerate(peers):
        i[OFF_SLOTS // 4 + s] = p
    seg.layout()
    seg.prefault_rings()
    i[OFF_STATE // 4] = ST_READY  # last: peers wait for it
    return seg


def attach_segment(
    name: str, peer: int, pid: int, *, rank: int, deadline: Deadline, peer_dead: Callable[[], bool]
) -> Segment:
    """Map the segment ``name`` of rank ``peer`` once its owner marked it ready (polling with backoff).

    Raises ConfigError for another layout version or owner, BrokenError for a truncated segment,
    PeerFailureError when ``peer_dead()`` says the owner died, DistTimeoutError past ``deadline``.
    """
    path = os.path.join(SHM_DIR, name)
    delay = 0.0005
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size) if size >= HDR_SIZE else None
            finally:
                os.close(fd)
            if mm is not None:
                seg = Segment(name, mm)
                if seg.i[OFF_STATE // 4] in (ST_READY, ST_CLOSED) and bytes(mm[0:8]) == MAGIC:
                    if seg.i[OFF_VERSION // 4] != VERSION or seg.i[OFF_OWNER // 4] != peer:
                        seg.close()
                        raise ConfigError(
                            f"shared memory segment {name} of rank {peer} has an unexpected layout: "
                            "run the same procgroup version on every rank"
                        )
                    seg.layout()
                    if seg.size < segment_size(seg.nslots, seg.cap, seg.big):
                        seg.close()
                        raise BrokenError(f"shared memory segment {name} of rank {peer} is truncated")
                    seg.prefault_rings()
                    return seg
                seg.close()
        if peer_dead():
            raise PeerFailureError(
                f"rank {rank}: rank {peer} (pid {pid}) died while the shm transport was being set up", peer=peer
            )
        if deadline.expired():
            raise DistTimeoutError(
                f"rank {rank}: shm transport setup: the segment {name} of rank {peer} (pid {pid}) did not appear "
                f"after {deadline.elapsed():.2f}s; is rank {peer} alive and on this host?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
