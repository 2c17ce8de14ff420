"""Shared-memory transport for the ranks of one host.

Layout
------
Every rank owns one segment, ``/dev/shm/procgroup-<job>-<token>-r<rank>``,
holding its *incoming* rings, one single-producer/single-consumer ring per
local peer (slot ``i`` belongs to the ``i``-th local peer in rank order,
skipping the owner)::

    offset               size          contents
    0                    4096          segment header
      0    8  magic b"PGSHM\\0\\1\\0"
      8    4  layout version (1)
      12   4  state: 0 initialising, 1 ready, 2 closed (written by the owner)
      16   4  world size        20  4  owner rank
      24   8  owner pid         32  8  ring capacity C (power of two, >= 4096)
      40   4  number of slots S
      48   8  address of this segment in the owner's address space (the CMA probe)
      56   8  offset A of the arena region
      64   4  doorbell (futex word, own cache line)
      72   4  sleep flag: 1 while an owner thread may be asleep on the doorbell
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

The ring carries a byte stream of records: a 16-byte header ``(tag u64,
length u64)`` at a 16-byte aligned stream position (so it never wraps),
then ``length`` payload bytes, which may wrap and which stream through the
ring in chunks when the message is larger than the ring.

Large messages (>= ``RNDV_MIN``, 1 MiB) to a peer whose CMA flag is set go by
*rendezvous*: the record's length field is ``2**62 | n`` and its 16-byte
payload is ``(address of the sender's buffer, id)``; the receiver copies the
``n`` bytes with ``process_vm_readv`` (see ``_cma``; from 4 MiB on, two
threads each copy half when no rendezvous send of ours is pending -- a
one-way transfer, whose sender's core is idle -- and the host is not
oversubscribed) straight into the
matched receive buffer (or, for an unexpected message, when the receive is
posted), then sends back an acknowledgement record (length field ``2**63``,
tag = id), which completes the send.  One copy instead of two, no ring-space
ping-pong, and the sender's core is free meanwhile.  A peer we cannot read
(other uid, Yama ptrace_scope, seccomp, ``PROCGROUP_SHM_CMA=0``) gets every
message through the ring.

Memory ordering
---------------
x86-64 is TSO: stores become visible in program order and loads are not
reordered with older loads.  So "write the payload, then write ``head``"
(producer) and "read ``head``, then read the payload" (consumer) need no
fence, and likewise for ``tail`` in the other direction: each counter has a
single writer, and an aligned 8-byte store is atomic.  The only store->load
pattern (the want-space handshake: producer stores the flag then loads
``tail``, consumer stores ``tail`` then loads the flag) is fenced with a
lock-prefixed atomic (acquiring a ``threading.Lock``).  Other architectures
would need real fences around the counters; the transport logs a warning
there.

Waiting
-------
Progress happens in the calling thread inside ``wait``/``test`` (under the
transport lock, so other threads may use the transport too): drain every
incoming ring, push every pending send.  A waiter polls for ``spin`` (50
us, ``PROCGROUP_SHM_SPIN_US`` overrides; restarted whenever bytes moved, so a
streaming message never sleeps; each poll ``sched_yield``-s so that on an
oversubscribed host -- by our ranks or by other work -- the peer gets the
core instead of waiting for our whole time slice), then sleeps on its own
doorbell futex in slices of ~50 ms,
checking at every slice that its peers are alive (pidfd, else
/proc/<pid>/stat) and have not closed: a dead peer fails the requests that
depend on it with :class:`PeerFailureError` within one slice, after what it
wrote before dying has been drained.  A producer always rings the
consumer's doorbell after publishing (a unique value), and makes the
FUTEX_WAKE syscall only when the consumer's sleep flag is set: the sleeper
raises the flag, fences, then futex_wait compares the doorbell; the ringer
writes the doorbell, fences, then reads the flag (Dekker), so a sleeping
consumer cannot miss data, and a spinning one costs no syscall.  A consumer
rings the producer only when the producer's want-space flag is set.

Arena
-----
Groups whose ranks all share this host (and whose id is below
``ARENA_GROUPS``) also get an :class:`~procgroup.transport.base.Arena`:
member ``m`` publishes into its own segment's slot for the group (payload,
then check word, then count: TSO keeps that order), fences, and reads every
member's count and check.  Whoever sees every member there rings the
doorbells of the members whose sleep flag is up.  The others poll
(``ARENA_SPIN``; on a host with fewer CPUs than local ranks they
``sched_yield`` at every poll, so the members they wait for run instead),
then raise their sleep flag, fence, re-check and sleep on their doorbell
(Dekker with the completer's count-fence-flag), and check liveness, abort,
close and the deadline at every slice.  The small collectives of
``algorithms.arena`` use it: one publish and one wake instead of
log2(p) rounds of matched messages.

Matching: a header arriving for a posted receive gets its payload copied
straight from the ring into the receive buffer (one copy); any other
message is drained into the unexpected queue so that one tag never blocks
another and a full ring never deadlocks.

Cleanup
-------
Formation is attach-then-unlink: publish the segment name (and pid) through
the store, create the segment, attach to every peer's, barrier through the
store, then unlink every segment name we know.  After the group has formed
/dev/shm holds nothing of the job, whatever happens to the processes; if
formation fails, the ``finally`` unlinks everything we learned about.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import platform
import re
import select
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

from ..deadline import Deadline, as_deadline
from ..errors import BrokenError, ClosedError, ConfigError, DistTimeoutError, PeerFailureError
from . import _cma, _futex
from ._engine import EngineTransport, RecvReq, SendReq, Unexpected, delete_key_quiet as _delete_key, timeout_error
from .base import ARENA_BYTES, Arena, CompletedRequest, Request, Status

__all__ = ["ShmTransport", "shm_supported", "cleanup_job_segments", "SHM_DIR", "segment_prefix"]

logger = logging.getLogger("procgroup.transport")

SHM_DIR = "/dev/shm"
_MAGIC = b"PGSHM\x00\x01\x00"
_VERSION = 2
_ST_INIT, _ST_READY, _ST_CLOSED = 0, 1, 2
_HDR_SIZE = 4096
_OFF_STATE, _OFF_WS, _OFF_OWNER, _OFF_PID, _OFF_CAP, _OFF_NSLOTS, _OFF_ADDR = 12, 16, 20, 24, 32, 40, 48
_OFF_ARENA = 56
_OFF_BELL = 64
_OFF_SLEEP = 72  # 1 while the owner has a thread asleep on its doorbell (ringers skip the wake syscall otherwise)
_OFF_SLOTS = 128
_CTRL = 128  # control block per slot
_C_HEAD, _C_WANT, _C_CMA, _C_TAIL = 0, 8, 16, 64
_REC = struct.Struct("<QQ")  # tag, length
_REC_SIZE = 16
#: record length field flags: a rendezvous descriptor (payload: address u64, id u64) and its acknowledgement
_RNDV_BIT = 1 << 62
_ACK = 1 << 63
_LEN_MASK = _RNDV_BIT - 1
#: messages of at least this many bytes go by rendezvous (one process_vm_readv) when the peer can read us
RNDV_MIN = 1 << 20

#: groups with an id below this get arena slots (the world is group 0; new_group ids count up from 1)
ARENA_GROUPS = 16
_ARENA_HDR = 64
#: how long an arena wait polls before it sleeps (s): every local rank has a CPU / the host is oversubscribed
ARENA_SPIN = 200e-6
ARENA_SPIN_OVERSUBSCRIBED = 300e-6
_ARENA_SLOT = _ARENA_HDR + ARENA_BYTES

#: default ring capacity per (producer, consumer) pair
DEFAULT_RING_SIZE = 4 << 20
MIN_RING_SIZE = 4096
#: a rank's incoming rings take at most this much unless ring_size= says otherwise
DEFAULT_SEGMENT_BUDGET = 32 << 20
#: copy granularity, so producer and consumer overlap on large messages
CHUNK = 256 << 10
#: polling before sleeping (seconds) and the futex sleep slice between liveness checks
DEFAULT_SPIN = 50e-6
DEFAULT_SLICE = 0.05

_INT_MAX = 0x7FFFFFFF
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()
_RAW_WAKE = _futex.raw_waker()
_ZEROS = memoryview(bytes(CHUNK))
_sched_yield = getattr(os, "sched_yield", lambda: None)


def _fence() -> None:
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
    return f"procgroup-{safe}-"


def shm_supported() -> bool:
    """True when /dev/shm exists and is writable (the shm transport can work here)."""
    return os.name == "posix" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def cleanup_job_segments(job_id: str) -> List[str]:
    """Unlink every segment of ``job_id`` left in /dev/shm (e.g. by a gang SIGKILLed during formation).

    For launchers, after the whole gang is gone.  Returns the names removed.
    """
    pre = segment_prefix(job_id)
    removed = []
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


def _unlink_quiet(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - permissions
        logger.warning("could not unlink shared memory segment %s: %s", name, e)


class _PeerWatch:
    """Is a peer process alive?  pidfd where available, else /proc/<pid>/stat."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._fd_peer: Dict[int, int] = {}
        self._procs: Dict[int, int] = {}  # peer -> pid, for the /proc fallback
        self.pids: Dict[int, int] = {}

    def add(self, peer: int, pid: int, same_pidns: bool) -> None:
        self.pids[peer] = pid
        if not same_pidns or pid <= 0:
            return
        if pid == os.getpid():
            return  # ranks as threads of this process: alive as long as we are
        fd = -1
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    self._procs[peer] = pid  # already gone: the /proc check will say so
                    return
                fd = -1
        if fd >= 0:
            self._fd_peer[fd] = peer
            self._poll.register(fd, select.POLLIN)
        else:
            self._procs[peer] = pid

    def dead(self) -> List[int]:
        out: List[int] = []
        if self._fd_peer:
            for fd, _ev in self._poll.poll(0):
                p = self._fd_peer.get(fd)
                if p is not None:
                    out.append(p)
        for p, pid in self._procs.items():
            if not _proc_alive(pid):
                out.append(p)
        return out

    def forget(self, peer: int) -> None:
        for fd, p in list(self._fd_peer.items()):
            if p == peer:
                self._poll.unregister(fd)
                del self._fd_peer[fd]
                os.close(fd)
        self._procs.pop(peer, None)

    def close(self) -> None:
        for fd in list(self._fd_peer):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd_peer.clear()
        self._procs.clear()


def _proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    st = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return st not in (b"Z", b"X", b"x")


def _pidns() -> Optional[int]:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class _Segment:
    """One mapped segment: the mmap plus u32/u64 views of it."""

    __slots__ = ("name", "mm", "q", "i", "addr", "cap", "nslots", "data_off", "size", "arena_off")

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

    def layout(self) -> None:
        self.cap = self.q[_OFF_CAP // 8]
        self.nslots = self.i[_OFF_NSLOTS // 4]
        self.data_off = _HDR_SIZE + _align(self.nslots * _CTRL, 4096)
        self.arena_off = self.q[_OFF_ARENA // 8]

    def slot_of(self, src: int) -> int:
        for s in range(self.nslots):
            if self.i[_OFF_SLOTS // 4 + s] == src:
                return s
        raise ConfigError(f"shared memory segment {self.name} has no ring for rank {src}")

    def data(self, slot: int) -> memoryview:
        off = self.data_off + slot * self.cap
        return memoryview(self.mm)[off:off + self.cap]

    def close(self) -> None:
        for v in (self.q, self.i):
            try:
                v.release()
            except Exception:  # noqa: BLE001 - a released/exported view: nothing more to do
                pass
        try:
            self.mm.close()
        except BufferError:  # a data view is still exported somewhere; the GC will unmap it
            pass


def _rings_size(nslots: int, cap: int) -> int:
    return _HDR_SIZE + _align(nslots * _CTRL, 4096) + nslots * cap


def _segment_size(nslots: int, cap: int) -> int:
    return _rings_size(nslots, cap) + ARENA_GROUPS * 2 * _ARENA_SLOT


class _InRing:
    """Consumer side of the ring peer -> me (lives in my segment)."""

    __slots__ = ("src", "data", "cap", "mask", "head_i", "tail_i", "want_i", "tail", "cur", "peer_seg")

    def __init__(self, src: int, seg: _Segment, slot: int, peer_seg: _Segment) -> None:
        base = _HDR_SIZE + slot * _CTRL
        self.src = src
        self.data = seg.data(slot)
        self.cap = seg.cap
        self.mask = seg.cap - 1
        self.head_i = (base + _C_HEAD) // 8
        self.tail_i = (base + _C_TAIL) // 8
        self.want_i = (base + _C_WANT) // 4
        self.tail = seg.q[self.tail_i]
        self.cur: Optional[list] = None  # [dest view or None, offset, length, target]
        self.peer_seg = peer_seg


class _OutRing:
    """Producer side of the ring me -> dst (lives in dst's segment)."""

    __slots__ = ("dst", "seg", "data", "cap", "mask", "head_i", "tail_i", "want_i", "head", "pending", "wanting", "cma")

    def __init__(self, dst: int, seg: _Segment, slot: int) -> None:
        base = _HDR_SIZE + slot * _CTRL
        self.dst = dst
        self.seg = seg
        self.data = seg.data(slot)
        self.cap = seg.cap
        self.mask = seg.cap - 1
        self.head_i = (base + _C_HEAD) // 8
        self.tail_i = (base + _C_TAIL) // 8
        self.want_i = (base + _C_WANT) // 4
        self.head = seg.q[self.head_i]
        self.pending: Deque[SendReq] = deque()
        self.wanting = False
        self.cma = bool(seg.i[(base + _C_CMA) // 4])  # dst probed that it can process_vm_readv our memory


class _RndvEntry(Unexpected):
    """A rendezvous message that arrived before its receive: the payload is still in the sender's memory."""

    __slots__ = ("addr", "rid")

    def __init__(self, src: int, nbytes: int, addr: int, rid: int) -> None:
        super().__init__(src, bytearray(), nbytes, False)
        self.addr = addr
        self.rid = rid


class _ShmArena(Arena):
    """Arena slots of one group in the members' segments (see "Arena" in the module docstring)."""

    def __init__(self, t: "ShmTransport", key: int, members: List[int]) -> None:
        self.t = t
        self.members = members
        self.index = members.index(t.rank)
        self.max_bytes = ARENA_BYTES
        segs = [t._seg if m == t.rank else t._peer_segs[m] for m in members]
        offs = [[seg.arena_off + (2 * key + k) * _ARENA_SLOT for seg in segs] for k in (0, 1)]  # type: ignore[union-attr]
        # per parity: (u32 view, index of the count word) of every member, and every member's payload view
        self._slots = [[(seg.i, off // 4) for seg, off in zip(segs, offs[k])] for k in (0, 1)]  # type: ignore[union-attr]
        self._data = [[memoryview(seg.mm)[off + _ARENA_HDR:][:ARENA_BYTES] for seg, off in zip(segs, offs[k])]  # type: ignore[union-attr]
                      for k in (0, 1)]
        self._others = [seg for seg in segs if seg is not t._seg]
        self.count = 0

    def release(self) -> None:
        for views in self._data:
            for v in views:
                v.release()
        self._slots = [[], []]
        self._others = []

    def _arrived(self, k: int, val: int, check: int) -> bool:
        for w, c in self._slots[k]:
            if w[c] != val or w[c + 1] != check:
                return False
        return True

    def exchange(self, data: Optional[Any], check: int, deadline: Optional[Deadline]) -> Sequence[memoryview]:
        t = self.t
        if t._aborted is not None:
            raise t._aborted
        if t._closed or not self._others:
            raise ClosedError(f"rank {t.rank}: shared-slot exchange on a closed shm transport")
        k = self.count & 1
        self.count += 1
        val = (self.count - 1) % 0xFFFFFFFF + 1  # never 0 (0: "never published")
        me = self.index
        views = self._data[k]
        if data is not None:
            n = data.nbytes
            if n > ARENA_BYTES:
                raise ConfigError(f"arena exchange of {n} bytes exceeds the slot size {ARENA_BYTES}")
            if n:
                views[me][:n] = data
        w, c = self._slots[k][me]
        w[c + 1] = check
        w[c] = val  # last: publishes the payload and the check (stores stay in order on x86)
        _fence()  # our count before their counts and sleep flags (Dekker with the other arrivers and sleepers)
        if self._arrived(k, val, check):
            # we completed the exchange; members that may be asleep on it need a wake (see _sleep)
            for seg in self._others:
                if seg.i[_OFF_SLEEP // 4]:
                    t._ring(seg, force=True)  # its flag is up: a new doorbell value, then FUTEX_WAKE
            return views
        self._wait(k, val, check, deadline)
        return views

    def _wait(self, k: int, val: int, check: int, deadline: Optional[Deadline]) -> None:
        t = self.t
        arrived = self._arrived
        spin = t._arena_spin
        if spin:
            end = time.monotonic() + spin
            yld = t._oversubscribed
            while time.monotonic() < end:
                if arrived(k, val, check):
                    return
                if yld:
                    _sched_yield()  # the member we wait for may be queued behind us
        while True:
            seg = t._seg
            if t._aborted is not None:
                raise t._aborted
            if t._closed or seg is None:
                raise ClosedError(f"rank {t.rank}: the shm transport was closed during a shared-slot exchange")
            snap = seg.i[_OFF_BELL // 4]  # before the check: a ring after it moves the doorbell
            if arrived(k, val, check):
                return
            missing = [m for (w, c), m in zip(self._slots[k], self.members) if w[c] != val or w[c + 1] != check]
            dead = [m for m in missing if m in t._failed]
            if dead:
                raise PeerFailureError(
                    f"rank {t.rank}: shared-slot exchange with ranks {self.members} cannot complete: "
                    f"{t._failed[dead[0]]}", peer=dead[0],
                )
            if deadline is not None and deadline.expired():
                raise DistTimeoutError(
                    f"rank {t.rank}: shared-slot exchange (call {self.count} of this group's arena): "
                    f"ranks {missing} of {self.members} did not arrive within {deadline.elapsed():.2f}s"
                )
            t._sleep_on_bell(snap, t._slice if deadline is None else max(deadline.remaining(), 1e-4),
                             lambda: arrived(k, val, check))


class ShmTransport(EngineTransport):
    """Transport among the ranks of one host through shared-memory rings (see the module docstring).

    Collective: every rank of ``local_ranks`` constructs it with the same
    store, ``prefix`` and ``local_ranks``.
    """

    kind = "shm"

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        local_ranks: Sequence[int],
        job_id: str,
        deadline: Any = None,
        prefix: str = "transport/shm",
        ring_size: Optional[int] = None,
        spin: float = DEFAULT_SPIN,
        slice_s: float = DEFAULT_SLICE,
    ) -> None:
        local = sorted(set(int(r) for r in local_ranks))
        if rank not in local:
            raise ConfigError(f"rank {rank} is not in local_ranks {local}")
        super().__init__(rank, world_size, local)
        if not shm_supported():
            raise ConfigError(f"the shm transport needs a writable {SHM_DIR}; use PROCGROUP_TRANSPORT=tcp on this host")
        if not _X86:
            logger.warning("shm transport on %s: its lock-free rings assume x86 memory ordering", platform.machine())
        self._deadline = as_deadline(deadline)
        self._spin = spin
        from ..config import ENV, env_bool

        env_spin = os.environ.get(ENV.SHM_SPIN_US, "").strip()
        if env_spin:
            try:
                self._spin = max(0.0, float(env_spin) * 1e-6)
            except ValueError:
                raise ConfigError(f"{ENV.SHM_SPIN_US}={env_spin!r} is not a number of microseconds") from None
        # sched_yield while spinning: when the host is oversubscribed -- by our ranks or by anything else -- the
        # peer we wait for may be queued behind us; without the yield it waits for our whole time slice (~0.75 ms)
        self._yield = True
        # shared-slot (arena) waits: a plain spin when every local rank can have a CPU; on an oversubscribed
        # host a spin that yields the CPU at every poll, so the members we wait for run in our stead
        # (cheaper than a futex sleep and wake per member per collective)
        try:
            ncpu = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            ncpu = os.cpu_count() or 1
        self._oversubscribed = len(set(local_ranks)) > ncpu
        self._arena_spin = self._spin if env_spin else ARENA_SPIN_OVERSUBSCRIBED if self._oversubscribed else ARENA_SPIN
        # a large single-copy read in two threads (the GIL is released in the syscall) when a core is likely
        # idle: not on an oversubscribed host, and (see _rndv_read_locked) not while a peer reads from us
        self._split_reads = ncpu > 1 and not self._oversubscribed and env_bool(ENV.SHM_SPLIT, default=True)
        self._arena_on = env_bool(ENV.SHM_ARENA, default=True)
        self._arenas: List["_ShmArena"] = []
        self._slice = slice_s
        self._seq = 0
        self._moved = 0  # bumped whenever bytes move through a ring: a waiter keeps spinning while they do
        self._sleepers = 0
        self._idle = threading.Condition(self._lock)
        self._next_live = 0.0
        self._watch = _PeerWatch()
        self._rndv: Dict[int, SendReq] = {}  # rendezvous id -> send waiting for the receiver's acknowledgement
        self._rid = 0
        self._in: Dict[int, _InRing] = {}
        self._out: Dict[int, _OutRing] = {}
        self._in_list: List[_InRing] = []
        self._pending_out: List[_OutRing] = []
        self._peer_segs: Dict[int, _Segment] = {}
        self._seg: Optional[_Segment] = None
        self._form(store, local, job_id, prefix, ring_size)

    # -- formation ----------------------------------------------------------------------
    def _form(self, store: Any, local: List[int], job_id: str, prefix: str, ring_size: Optional[int]) -> None:
        me = self.rank
        peers = [r for r in local if r != me]
        cap = self._choose_ring_size(len(peers), ring_size)
        name = f"{segment_prefix(job_id)}{os.urandom(6).hex()}-r{me}"  # (not secrets: its import costs ~10 ms)
        pidns = _pidns()
        learned = [name]
        ok = False
        try:
            store.set(f"{prefix}/seg/{me}", json.dumps({"name": name, "pid": os.getpid(), "pidns": pidns}).encode())
            self._seg = self._create(name, peers, cap)
            for p in peers:
                info = json.loads(self._store_get(store, f"{prefix}/seg/{p}", f"rank {p} to publish its shared memory segment"))
                learned.append(info["name"])
                self._watch.add(p, int(info["pid"]), info.get("pidns") == pidns)
                self._peer_segs[p] = self._attach(info["name"], p, int(info["pid"]))
                if info.get("pidns") == pidns and self._probe_cma(int(info["pid"]), self._peer_segs[p]):
                    self._seg.i[(_HDR_SIZE + self._seg.slot_of(p) * _CTRL + _C_CMA) // 4] = 1
            store.set(f"{prefix}/attached/{me}", b"1")
            if peers:
                self._store_wait(store, [f"{prefix}/attached/{p}" for p in peers], "every local rank to attach to the shared memory segments")
            ok = True
            _delete_key(store, f"{prefix}/seg/{me}")  # every peer attached, so every peer read it
        finally:
            for n in learned:  # attach-then-unlink: nothing of ours stays in /dev/shm
                _unlink_quiet(n)
            if not ok:
                self._release_all()
        seg = self._seg
        assert seg is not None
        for p in peers:
            pseg = self._peer_segs[p]
            ir = _InRing(p, seg, seg.slot_of(p), pseg)
            self._in[p] = ir
            self._out[p] = _OutRing(p, pseg, pseg.slot_of(me))
        self._in_list = [self._in[p] for p in peers]

    @staticmethod
    def _probe_cma(pid: int, pseg: _Segment) -> bool:
        """Can we process_vm_readv the memory of ``pid``?  Read its segment's magic through its own address."""
        if not _cma.enabled() or pid <= 0:
            return False
        addr = pseg.q[_OFF_ADDR // 8]
        if not addr:
            return False
        buf = bytearray(8)
        try:
            _cma.read(pid, _futex.buffer_address(buf), addr, 8)
        except OSError as e:
            logger.debug("shm: no cross-memory attach to pid %d (%s): large messages go through the ring", pid, e)
            return False
        return bytes(buf) == _MAGIC

    def _choose_ring_size(self, npeers: int, ring_size: Optional[int]) -> int:
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

    def _create(self, name: str, peers: List[int], cap: int) -> _Segment:
        size = _segment_size(len(peers), cap)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # fail now with ENOSPC rather than SIGBUS later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ConfigError(
                        f"not enough space in {SHM_DIR} for a {size >> 20} MiB shared memory segment "
                        f"({len(peers)} rings of {cap >> 10} KiB): enlarge {SHM_DIR} (docker: --shm-size), "
                        "pass a smaller ring_size, or use PROCGROUP_TRANSPORT=tcp"
                    ) from e
                os.ftruncate(fd, size)  # filesystems without fallocate
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = _Segment(name, mm)
        q, i = seg.q, seg.i
        mm[0:8] = _MAGIC
        i[8 // 4] = _VERSION
        i[_OFF_WS // 4] = self.world_size
        i[_OFF_OWNER // 4] = self.rank
        q[_OFF_PID // 8] = os.getpid()
        q[_OFF_CAP // 8] = cap
        i[_OFF_NSLOTS // 4] = len(peers)
        q[_OFF_ADDR // 8] = seg.addr  # where this segment lives in the owner's address space (the CMA probe)
        q[_OFF_ARENA // 8] = _rings_size(len(peers), cap)
        for s, p in enumerate(peers):
            i[_OFF_SLOTS // 4 + s] = p
        seg.layout()
        i[_OFF_STATE // 4] = _ST_READY  # last: peers wait for it
        return seg

    def _attach(self, name: str, peer: int, pid: int) -> _Segment:
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
                    mm = mmap.mmap(fd, size) if size >= _HDR_SIZE else None
                finally:
                    os.close(fd)
                if mm is not None:
                    seg = _Segment(name, mm)
                    if seg.i[_OFF_STATE // 4] in (_ST_READY, _ST_CLOSED) and bytes(mm[0:8]) == _MAGIC:
                        if seg.i[8 // 4] != _VERSION or seg.i[_OFF_OWNER // 4] != peer:
                            seg.close()
                            raise ConfigError(f"shared memory segment {name} of rank {peer} has an unexpected layout: "
                                              "run the same procgroup version on every rank")
                        seg.layout()
                        if seg.size < _segment_size(seg.nslots, seg.cap):
                            seg.close()
                            raise BrokenError(f"shared memory segment {name} of rank {peer} is truncated")
                        return seg
                    seg.close()
            if peer in self._watch.dead():
                raise PeerFailureError(f"rank {self.rank}: rank {peer} (pid {pid}) died while the shm transport was being set up",
                                       peer=peer)
            if self._deadline.expired():
                raise DistTimeoutError(
                    f"rank {self.rank}: shm transport setup: the segment {name} of rank {peer} (pid {pid}) did not appear "
                    f"after {self._deadline.elapsed():.2f}s; is rank {peer} alive and on this host?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _store_get(self, store: Any, key: str, what: str) -> bytes:
        try:
            return store.get(key, timeout=self._deadline.remaining_or_none())
        except (DistTimeoutError, TimeoutError) as e:
            raise DistTimeoutError(
                f"rank {self.rank}: shm transport setup: timed out after {self._deadline.elapsed():.2f}s waiting for {what}; "
                "did every rank call init_process_group? (extend with timeout=)"
            ) from e

    def _store_wait(self, store: Any, keys: List[str], what: str) -> None:
        try:
            store.wait(keys, timeout=self._deadline.remaining_or_none())
        except (DistTimeoutError, TimeoutError) as e:
            missing = []
            try:
                missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            except Exception:  # noqa: BLE001 - best effort detail for the message
                pass
            raise DistTimeoutError(
                f"rank {self.rank}: shm transport setup: timed out after {self._deadline.elapsed():.2f}s waiting for {what}"
                + (f" (missing ranks {', '.join(missing)})" if missing else "")
            ) from e

    def _release_all(self) -> None:
        for a in self._arenas:
            a.release()
        self._arenas.clear()
        for ir in self._in.values():
            ir.data.release()
        for o in self._out.values():
            o.data.release()
        self._in.clear()
        self._out.clear()
        self._in_list = []
        for s in self._peer_segs.values():
            s.close()
        self._peer_segs.clear()
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        self._watch.close()

    # -- arenas ---------------------------------------------------------------------------
    def arena(self, key: int, members: Sequence[int]) -> Optional[Arena]:
        ms = [int(m) for m in members]
        if not self._arena_on or not 0 <= key < ARENA_GROUPS or len(ms) < 2 or self.rank not in ms:
            return None
        if any(m != self.rank and m not in self._peer_segs for m in ms):
            return None  # a member on another host
        with self._lock:
            if self._closed or self._seg is None:
                return None
            a = _ShmArena(self, key, ms)
            self._arenas.append(a)
            return a

    # -- doorbells ------------------------------------------------------------------------
    def _ring(self, seg: _Segment, force: bool = False) -> None:
        """Write a value no other ringer writes into ``seg``'s doorbell, then wake its sleepers.

        The wake syscall is skipped when the owner has no thread asleep: it raises its sleep flag,
        fences and only then compares the doorbell in futex_wait; we write the doorbell, fence and
        only then read the flag, so one of us sees the other's write.
        """
        self._seq += 1
        i = seg.i
        i[_OFF_BELL // 4] = (self._seq * self.world_size + self.rank + 1) & 0xFFFFFFFF
        if not force:
            _fence()
            if not i[_OFF_SLEEP // 4]:
                return
        w = _RAW_WAKE
        if w is not None:
            w[0](w[1], seg.addr + _OFF_BELL, 1, _INT_MAX)
        else:
            _futex.futex_wake(seg.addr + _OFF_BELL)

    def _notify_locked(self) -> None:
        if self._sleepers and self._seg is not None:
            self._ring(self._seg)
        for fn in self._hooks:
            fn()

    def _bell_value(self) -> int:
        return self._seg.i[_OFF_BELL // 4]  # type: ignore[union-attr]

    # -- sending ----------------------------------------------------------------------------
    def _send_remote(self, dst: int, tag: int, view: memoryview) -> Request:
        n = view.nbytes
        with self._lock:
            if self._closed:
                raise ClosedError(f"rank {self.rank}: send to rank {dst} on a closed shm transport")
            o = self._out[dst]
            if n >= RNDV_MIN and o.cma:
                # rendezvous: the receiver copies straight from our buffer, then acknowledges
                s = SendReq(self, dst, tag, view)
                self._rid += 1
                self._rndv[self._rid] = s
                self._post_ctl_locked(o, tag, _RNDV_BIT | n, _REC.pack(_cma.address_of(view), self._rid))
                return s
            if not o.pending:
                # fast path: the whole message fits now
                seg = o.seg
                h = (o.head + 15) & ~15
                end = h + _REC_SIZE + n
                if end - seg.q[o.tail_i] <= o.cap and n <= CHUNK:
                    data = o.data
                    pos = h & o.mask
                    _REC.pack_into(data, pos, tag, n)
                    if n:
                        pos += _REC_SIZE
                        first = o.cap - pos
                        if n <= first:
                            data[pos:pos + n] = view
                        else:
                            data[pos:] = view[:first]
                            data[:n - first] = view[first:]
                    o.head = end
                    seg.q[o.head_i] = end
                    self._ring(seg)
                    return CompletedRequest(Status(dst, n))
            s = SendReq(self, dst, tag, view)
            o.pending.append(s)
            if len(o.pending) == 1:
                self._pending_out.append(o)
                if self._push(o):
                    self._notify_locked()
        return s

    def _post_ctl_locked(self, o: _OutRing, tag: int, length_field: int, payload: bytes) -> None:
        """Queue a record whose length field is ``length_field`` (rendezvous descriptor, acknowledgement). Lock held."""
        c = SendReq(self, o.dst, tag, memoryview(payload))
        c.extra = length_field
        o.pending.append(c)
        if len(o.pending) == 1:
            self._pending_out.append(o)
            self._push(o)

    def _rndv_read_locked(self, req: RecvReq, src: int, addr: int, n: int, rid: int) -> None:
        """Copy a rendezvous message of ``src`` into ``req`` (one process_vm_readv), then acknowledge. Lock held."""
        if req.error is None:
            if n > req.out.nbytes:
                req.error = self._size_error(req, src, n)
            else:
                try:
                    if n:
                        # two threads only when nobody is reading from us meanwhile (a one-way transfer such as
                        # a broadcast: the sender's core is idle); in an exchange both cores already copy
                        (_cma.read_parallel if self._split_reads and not self._rndv else _cma.read)(
                            self._watch.pids.get(src, 0), _cma.address_of(req.out), addr, n)
                except OSError as e:
                    if e.errno == errno.ESRCH:
                        req.error = self._peer_error(req, src, f"rank {src} died (its memory is gone)")
                    else:
                        req.error = BrokenError(
                            f"rank {self.rank}: reading a {n}-byte message of rank {src} (tag {req.tag}) through "
                            f"process_vm_readv failed: {e}; set PROCGROUP_SHM_CMA=0 to send large messages through the rings"
                        )
                else:
                    req.status = Status(src, n)
        req.out = None  # type: ignore[assignment]
        o = self._out.get(src)
        if o is not None and src not in self._failed:
            self._post_ctl_locked(o, rid, _ACK, b"")

    def _entry_matched_locked(self, entry: Unexpected) -> None:
        if isinstance(entry, _RndvEntry) and entry.waiter is not None:
            req = entry.waiter
            entry.waiter = None
            self._rndv_read_locked(req, entry.src, entry.addr, entry.nbytes, entry.rid)

    def _push(self, o: _OutRing) -> bool:
        """Write as much of ``o``'s pending sends as fits; True if one completed. Lock held."""
        seg = o.seg
        q = seg.q
        data, cap, mask = o.data, o.cap, o.mask
        head = o.head
        published = head
        completed = False
        while True:
            tail = q[o.tail_i]
            blocked = False
            while o.pending:
                s = o.pending[0]
                if not s.hdr_done:
                    h = (head + 15) & ~15
                    if h + _REC_SIZE - tail > cap:
                        blocked = True
                        break
                    _REC.pack_into(data, h & mask, s.tag, s.nbytes if s.extra is None else s.extra)
                    head = h + _REC_SIZE
                    s.hdr_done = True
                view = s.view
                off = s.off
                rem = s.nbytes - off
                while rem:
                    free = cap - (head - tail)
                    if free <= 0:
                        if head != published:
                            q[o.head_i] = head
                            published = head
                            self._ring(seg)
                        tail = q[o.tail_i]
                        free = cap - (head - tail)
                        if free <= 0:
                            break
                    k = min(free, rem, CHUNK)
                    pos = head & mask
                    first = cap - pos
                    if view is None:  # an aborted send: pad the record with zeros
                        src_v, soff = _ZEROS, 0
                    else:
                        src_v, soff = view, off
                    if k <= first:
                        data[pos:pos + k] = src_v[soff:soff + k]
                    else:
                        data[pos:] = src_v[soff:soff + first]
                        data[:k - first] = src_v[soff + first:soff + k]
                    head += k
                    off += k
                    rem -= k
                    self._moved += 1
                    if rem:  # publish each chunk of a large message so the consumer overlaps with us
                        q[o.head_i] = head
                        published = head
                        self._ring(seg)
                s.off = off
                if rem:
                    blocked = True
                    break
                o.pending.popleft()
                if s.error is None:
                    s.status = Status(o.dst, s.nbytes)
                s.view = None  # type: ignore[assignment]
                completed = True
            if head != published:
                q[o.head_i] = head
                published = head
                self._ring(seg)
            if not blocked:
                if o.wanting:
                    seg.i[o.want_i] = 0
                    o.wanting = False
                break
            # blocked for space: raise the want flag, fence, and look again (Dekker with the consumer)
            if not o.wanting:
                seg.i[o.want_i] = 1
                o.wanting = True
                _fence()
                continue
            break
        o.head = head
        if not o.pending:
            try:
                self._pending_out.remove(o)
            except ValueError:
                pass
        return completed

    # -- receiving ---------------------------------------------------------------------------
    def _drain(self, r: _InRing) -> bool:
        """Consume what ring ``r`` holds; True if a request completed or a message arrived. Lock held."""
        seg = self._seg
        q = seg.q  # type: ignore[union-attr]
        head = q[r.head_i]
        tail = r.tail
        if head == tail:
            return False
        data, cap, mask = r.data, r.cap, r.mask
        src = r.src
        progressed = False
        while True:
            cur = r.cur
            if cur is None:
                t = (tail + 15) & ~15
                if head < t + _REC_SIZE:
                    break
                tag, length = _REC.unpack_from(data, t & mask)
                if length > _LEN_MASK:  # a control record
                    if length == _ACK:
                        tail = t + _REC_SIZE
                        s = self._rndv.pop(tag, None)
                        if s is not None:
                            if s.error is None:
                                s.status = Status(s.peer, s.nbytes)
                            s.view = None  # type: ignore[assignment]
                        progressed = True
                        continue
                    if head < t + 2 * _REC_SIZE:
                        break  # the descriptor is not all there yet
                    addr, rid = _REC.unpack_from(data, (t + _REC_SIZE) & mask)
                    tail = t + 2 * _REC_SIZE
                    length &= _LEN_MASK
                    req = self._match_locked(src, tag)
                    if req is not None:
                        self._rndv_read_locked(req, src, addr, length, rid)
                    else:
                        self._add_unexpected_locked(tag, _RndvEntry(src, length, addr, rid))
                    progressed = True
                    continue
                tail = t + _REC_SIZE
                req = self._match_locked(src, tag)
                if req is not None:
                    if length > req.out.nbytes:
                        req.error = self._size_error(req, src, length)
                        dest = None
                    else:
                        dest = req.out
                    target: object = req
                else:
                    entry = Unexpected(src, bytearray(length), length, False)
                    self._add_unexpected_locked(tag, entry)
                    dest = memoryview(entry.buf)
                    target = entry
                progressed = True
                if length == 0:
                    self._complete(target, src, 0)
                    continue
                cur = r.cur = [dest, 0, length, target]
            dest, off, length, target = cur
            avail = head - tail
            if avail <= 0:
                break
            n = min(avail, length - off)
            while n:
                k = n if n <= CHUNK else CHUNK
                pos = tail & mask
                first = cap - pos
                if dest is not None:
                    if k <= first:
                        dest[off:off + k] = data[pos:pos + k]
                    else:
                        dest[off:off + first] = data[pos:]
                        dest[off + first:off + k] = data[:k - first]
                tail += k
                off += k
                n -= k
                self._moved += 1
                if n:
                    self._release(r, tail)
            if off == length:
                r.cur = None
                self._complete(target, src, length)
                progressed = True
            else:
                cur[1] = off
                break
        self._release(r, tail)
        return progressed

    def _release(self, r: _InRing, tail: int) -> None:
        r.tail = tail
        seg = self._seg
        seg.q[r.tail_i] = tail  # type: ignore[union-attr]
        _fence()
        if seg.i[r.want_i]:  # type: ignore[union-attr]
            self._ring(r.peer_seg)

    def _complete(self, target: object, src: int, n: int) -> None:
        if isinstance(target, RecvReq):
            if target.error is None:
                target.status = Status(src, n)
            target.out = None  # type: ignore[assignment]  # drop the buffer export
        else:
            self._entry_done_locked(target)  # type: ignore[arg-type]

    def _progress_locked(self) -> bool:
        progressed = False
        for r in self._in_list:
            if self._drain(r):
                progressed = True
        if self._pending_out:
            for o in list(self._pending_out):
                if self._push(o):
                    progressed = True
        if progressed:
            self._notify_locked()
        return progressed

    # -- liveness ----------------------------------------------------------------------------------
    def _check_peers_locked(self) -> None:
        dead = set(self._watch.dead())
        for p, pseg in self._peer_segs.items():
            if p in self._failed:
                continue
            pid = self._watch.pids.get(p, 0)
            reason = None
            if p in dead:
                reason = f"rank {p} (pid {pid}) died"
            elif pseg.i[_OFF_STATE // 4] == _ST_CLOSED:
                reason = f"rank {p} (pid {pid}) closed its transport"
            if reason is not None:
                r = self._in.get(p)
                if r is not None:
                    self._drain(r)  # everything it wrote before dying is still deliverable
                self._watch.forget(p)
                self._fail_peer_locked(p, reason)

    def _maybe_check_peers_locked(self, now: float) -> None:
        if now >= self._next_live:
            self._next_live = now + self._slice
            self._check_peers_locked()

    def _fail_peer_locked(self, peer: int, reason: str) -> None:
        r = self._in.get(peer)
        if r is not None and r.cur is not None:
            target = r.cur[3]
            r.cur = None
            if isinstance(target, RecvReq):
                if target.error is None and target.status is None:
                    target.error = self._peer_error(target, peer, reason)
            else:
                e = target  # type: ignore[assignment]
                if e.waiter is not None:
                    self._fail_entry_locked(e, self._peer_error(e.waiter, peer, reason))
                else:
                    self._fail_entry_locked(e, PeerFailureError(reason, peer=peer))
        for rid, s in list(self._rndv.items()):
            if s.peer == peer:
                del self._rndv[rid]
                if s.status is None and s.error is None:
                    s.error = self._peer_error(s, peer, reason)
                s.view = None  # type: ignore[assignment]
        o = self._out.get(peer)
        if o is not None and o.pending:
            for s in o.pending:
                s.error = self._peer_error(s, peer, reason)
            o.pending.clear()
            try:
                self._pending_out.remove(o)
            except ValueError:
                pass
        super()._fail_peer_locked(peer, reason)

    # -- waiting ---------------------------------------------------------------------------------
    def _kick(self) -> None:
        """One progress pass plus a due liveness check (the router calls it while waiting on other transports)."""
        with self._lock:
            if not self._closed:
                self._progress_locked()
                self._maybe_check_peers_locked(time.monotonic())

    def _test_req(self, req: Any) -> bool:
        with self._lock:
            if not self._closed:
                self._progress_locked()
                if req.status is None and req.error is None:
                    self._maybe_check_peers_locked(time.monotonic())
        return req.status is not None or req.error is not None

    def _wait_req(self, req: Any, deadline: Optional[Deadline]) -> Status:
        lock = self._lock
        spin_end = 0.0
        addr = 0
        while True:
            with lock:
                if not self._closed:
                    bell = self._bell_value()
                    moved = self._moved
                    self._progress_locked()
                    if self._moved != moved:
                        spin_end = 0.0  # data is flowing (a large message streams): keep polling
                st = req.status
                if st is not None:
                    return st
                if req.error is not None:
                    raise req.error
                if self._closed:  # pragma: no cover - close() sets an error on every pending request
                    raise ClosedError(f"rank {self.rank}: the shm transport was closed")
                now = time.monotonic()
                if deadline is not None and deadline.expired():
                    raise timeout_error(self.rank, req, deadline, self.kind)
                spinning = True
                if not spin_end:
                    spin_end = now + self._spin
                elif now >= spin_end:
                    self._maybe_check_peers_locked(now)
                    if req.status is None and req.error is None:
                        spinning = False
                        self._sleepers += 1
                        self._seg.i[_OFF_SLEEP // 4] = 1  # type: ignore[union-attr]
                        addr = self._seg.addr + _OFF_BELL  # type: ignore[union-attr]
            if spinning:
                if self._yield:
                    _sched_yield()  # an oversubscribed host: let the peer we wait for run
                continue
            _fence()  # the sleep flag before the doorbell compare (Dekker with _ring)
            try:
                t = self._slice
                if deadline is not None:
                    t = min(t, deadline.remaining())
                _futex.futex_wait(addr, bell, min(t, self._next_live - time.monotonic() + 1e-3))
            finally:
                with lock:
                    self._sleepers -= 1
                    if not self._sleepers:
                        self._clear_sleep_flag()
                        self._idle.notify_all()

    # -- router support ------------------------------------------------------------------------
    def _activity_snapshot(self) -> int:
        with self._lock:
            return 0 if self._closed else self._bell_value()

    def _sleep_on_bell(self, snapshot: int, timeout: float, ready: Optional[Callable[[], bool]] = None) -> None:
        """Sleep until our doorbell moves from ``snapshot`` (or ``timeout``), as a waiter; for the router and arenas.

        ``ready``: re-checked after the sleep flag is up and fenced, so a waker that tests the flag after its own
        fence (the arena's completer) either sees the flag and rings, or is seen by this check.
        """
        with self._lock:
            if self._closed:
                return
            self._maybe_check_peers_locked(time.monotonic())
            self._sleepers += 1
            self._seg.i[_OFF_SLEEP // 4] = 1  # type: ignore[union-attr]
            addr = self._seg.addr + _OFF_BELL  # type: ignore[union-attr]
        _fence()
        try:
            if ready is None or not ready():
                _futex.futex_wait(addr, snapshot, min(timeout, self._slice))
        finally:
            with self._lock:
                self._sleepers -= 1
                if not self._sleepers:
                    self._clear_sleep_flag()
                    self._idle.notify_all()

    def _clear_sleep_flag(self) -> None:
        seg = self._seg
        if seg is not None:
            try:
                seg.i[_OFF_SLEEP // 4] = 0
            except ValueError:  # released during close
                pass

    def _poke(self) -> None:
        """Ring our own doorbell (another transport's reader thread saw activity); lock held or not."""
        seg = self._seg
        if seg is not None and not self._closed:
            try:
                seg.i[_OFF_BELL // 4] = (seg.i[_OFF_BELL // 4] + 0x10000001) & 0xFFFFFFFF
                _futex.futex_wake(seg.addr + _OFF_BELL)
            except ValueError:  # released during close
                pass

    # -- closing ---------------------------------------------------------------------------------
    def _fail_inflight_locked(self, err: BaseException) -> None:
        for s in self._rndv.values():
            if s.status is None and s.error is None:
                s.error = err
            s.view = None  # type: ignore[assignment]
        self._rndv.clear()
        for r in self._in.values():
            cur = r.cur
            if cur is not None:
                target = cur[3]
                if isinstance(target, RecvReq):
                    if target.status is None and target.error is None:
                        target.error = err
                    cur[0] = None  # keep consuming the stream, into nowhere: the buffer is the user's again
                elif target.waiter is not None:
                    target.waiter.error = err
                    target.waiter = None
        for o in self._out.values():
            for s in o.pending:
                if s.status is None and s.error is None:
                    s.error = err
            head = o.pending[0] if o.pending else None
            o.pending.clear()
            if head is not None and head.hdr_done and head.off < head.nbytes:
                # half written: finish the record with zeros (not the user's buffer) so the ring stays framed
                head.view = None  # type: ignore[assignment]
                o.pending.append(head)
            elif o in self._pending_out:
                self._pending_out.remove(o)

    def _close_locked(self) -> None:
        super()._close_locked()
        seg = self._seg
        if seg is not None:
            seg.i[_OFF_STATE // 4] = _ST_CLOSED
            self._ring(seg, force=True)
            for p, pseg in self._peer_segs.items():  # let blocked peers notice now rather than at their next slice
                if p not in self._failed:
                    self._ring(pseg, force=True)

    def _after_close(self) -> None:
        with self._idle:
            end = time.monotonic() + 1.0
            while self._sleepers and time.monotonic() < end:
                self._idle.wait(0.05)
            self._release_all()

    def __repr__(self) -> str:
        return f"<ShmTransport rank {self.rank} peers {sorted(self._peers)}{' closed' if self._closed else ''}>"
