"""ShmTransport: the shared-memory transport among the ranks of one host.

The pieces live in their own modules: :mod:`.layout` (segment layout,
naming, cleanup), :mod:`.formation` (segments exchanged through the store,
attach-then-unlink), :mod:`.ring` (the SPSC rings and their record format),
:mod:`.doorbell` (futex doorbells, sleeping and waking), :mod:`.peers`
(peer liveness) and :mod:`.arena` (shared slots for small collectives).
This module ties them to the matching engine
(:class:`~procgroup.transport._engine.EngineTransport`).

Large messages (>= ``RNDV_MIN``, 8 MiB, or, sent by isend, too large for
the ring at once) to a peer that can read our memory go by rendezvous: the receiver copies
them with ``process_vm_readv`` (see ``_cma``; from 4 MiB on, two threads
each copy half when no rendezvous send of ours is pending -- a one-way
transfer, whose sender's core is idle -- and the host is not
oversubscribed) straight into the matched receive buffer (or, for an
unexpected message, when the receive is posted), then acknowledges, which
completes the send.  One copy instead of two, no ring-space ping-pong, and
the sender's core is free meanwhile.  A peer we cannot read (other uid,
Yama ptrace_scope, seccomp, ``PROCGROUP_SHM_CMA=0``)
gets every message through the ring.

Waiting
-------
Progress happens in the calling thread inside ``wait``/``test`` (under the
transport lock, so other threads may use the transport too): drain every
incoming ring, push every pending send.  A waiter polls for ``spin`` (50
us, ``PROCGROUP_SHM_SPIN_US`` overrides through :class:`ShmOptions`;
restarted whenever bytes moved, so a streaming message never sleeps; each
poll ``sched_yield``-s so that on an oversubscribed host -- by our ranks or
by other work -- the peer gets the core instead of waiting for our whole
time slice), then sleeps on its own doorbell (:mod:`.doorbell`) in slices
of ~50 ms, checking at every slice that its peers are alive (:mod:`.peers`)
and have not closed: a dead peer fails the requests that depend on it with
:class:`PeerFailureError` within one slice, after what it wrote before
dying has been drained.  A consumer rings the producer only when the
producer's want-space flag is set.

Matching: a header arriving for a posted receive gets its payload copied
straight from the ring into the receive buffer (one copy); any other
message is drained into the unexpected queue so that one tag never blocks
another and a full ring never deadlocks.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import time
from typing import Any, Dict, List, Optional, Sequence, Union

from ...config import SHM_DIR, ShmOptions
from ...deadline import Deadline, as_deadline
from ...errors import BrokenError, ClosedError, ConfigError, PeerFailureError
from .. import _cma, _futex
from .._engine import EngineTransport, RecvReq, SendReq, Unexpected, timeout_error
from ..base import Arena, CompletedRequest, Request, Status, address_of
from . import p2pfast as _p2pfast
from .arena import ARENA_SPIN, ARENA_SPIN_OVERSUBSCRIBED, ARENA_SPIN_SPANNING, ShmArena, set_streaming
from .bigarena import ShmBigArena, big_arena_for
from .doorbell import Doorbell
from .formation import form_segments
from .layout import (
    ARENA_GROUPS,
    BIG_GROUPS,
    OFF_BELL,
    OFF_SLEEP,
    OFF_STATE,
    ST_CLOSED,
    X86,
    Segment,
    fence,
    shm_supported,
)
from .peers import PeerWatch
from .queue import ShmQueue
from .ring import (
    ACK,
    CHUNK,
    LEN_MASK,
    REC,
    REC_SIZE,
    RNDV_BIT,
    Flow,
    InRing,
    OutRing,
    RndvEntry,
    by_rendezvous,
)

try:  # recv_fast's poll and the fast path's record write/read, compiled (optional, like the arena's _native)
    from . import _p2pwait
except ImportError:  # pragma: no cover - not built: all in Python
    _p2pwait = None  # type: ignore[assignment]

__all__ = ["ShmTransport", "DEFAULT_SPIN", "DEFAULT_SLICE"]

logger = logging.getLogger("procgroup.transport")

#: polling before sleeping (seconds) and the futex sleep slice between liveness checks
DEFAULT_SPIN = 50e-6
DEFAULT_SLICE = 0.05

_sched_yield = getattr(os, "sched_yield", lambda: None)

#: what a ring is receiving into: a posted receive, or an unexpected message's buffer
_Target = Union[RecvReq, Unexpected]


class ShmTransport(EngineTransport):
    """Transport among the ranks of one host through shared-memory rings (see the module docstring).

    Collective: every rank of ``local_ranks`` constructs it with the same
    store, ``prefix`` and ``local_ranks``, within ``deadline``.  ``options``
    (:class:`~procgroup.config.ShmOptions`; the defaults when None -- the
    environment is not read here) turns the single-copy path, the split
    reads and the arena on or off and sets the spin.  ``ring_size``: bytes
    per ring, a power of two >= 4096 (default: 4 MiB, less when /dev/shm is
    small).  Raises ConfigError without a writable /dev/shm or for a bad
    ``ring_size``, DistTimeoutError when a local rank does not show up in
    time, PeerFailureError when one dies during formation.
    """

    kind = "shm"
    # the fast path's attributes as slots: an instance has more than the 30 that CPython 3.11 keeps in its
    # inline layout, so each of these reads was a dict lookup (the rest stay in the instance dict)
    __slots__ = (
        "_lock",
        "_out",
        "_in",
        "_in_list",
        "_closed",
        "_aborted",
        "_failed",
        "_posted",
        "_unexpected",
        "_pending_out",
        "_hooks",
        "_put",
        "_put_stream",
        "_take",
        "_stream",
        "_wait_head",
        "_bell",
        "_c_bell",
        "_flow",
        "_ring",
        "_spin",
        "_spin_ns",
        "_yield",
        "_fast_spun",
        "_core",
        "_fsends",
        "_frecvs",
        "fast_handoffs",
        "bytes_sent",
    )

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
        options: Optional[ShmOptions] = None,
    ) -> None:
        local = sorted(set(int(r) for r in local_ranks))
        if rank not in local:
            raise ConfigError(f"rank {rank} is not in local_ranks {local}")
        self.bytes_sent = 0  # (a slot: Transport's class default does not reach it)
        super().__init__(rank, world_size, local)
        if not shm_supported():
            raise ConfigError(f"the shm transport needs a writable {SHM_DIR}; use PROCGROUP_TRANSPORT=tcp on this host")
        if not X86:
            logger.warning("shm transport on %s: its lock-free rings assume x86 memory ordering", platform.machine())
        opts = options if options is not None else ShmOptions()
        self._deadline = as_deadline(deadline)
        self._spin = spin if opts.spin_us is None else max(0.0, opts.spin_us * 1e-6)
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
        self._oversubscribed = len(local) > ncpu
        set_streaming(opts.stream)  # this process's copies into shared slots (arena.STREAM_MIN)
        self._arena_spin = (
            self._spin
            if opts.spin_us is not None
            else ARENA_SPIN_OVERSUBSCRIBED
            if self._oversubscribed
            else ARENA_SPIN
        )
        # ... and a spanning group's host slots (arena(spanning=True)), whose members wait for a stage between hosts
        self._spanning_spin = self._spin if opts.spin_us is not None else ARENA_SPIN_SPANNING
        # a large single-copy read in two threads (the GIL is released in the syscall) when a core is likely
        # idle: not on an oversubscribed host, and (see _rndv_read_locked) not while a peer reads from us
        self._split_reads = ncpu > 1 and not self._oversubscribed and opts.split
        self._arena_on = opts.arena
        self._native = opts.native
        #: the fast path's compiled helpers: a poll with the GIL released, the record write and read
        #: (PROCGROUP_NATIVE=0 or not built: Python)
        fast_c = _p2pwait if opts.native and X86 else None
        self._wait_head = fast_c.wait_head if fast_c is not None else None
        self._put = fast_c.put if fast_c is not None else None
        self._take = fast_c.take if fast_c is not None else None
        #: put rings the doorbell and take releases the ring in C (a build whose layout agrees with ours)
        self._c_bell = fast_c is not None and (getattr(fast_c, "OFF_BELL", 0), getattr(fast_c, "OFF_SLEEP", 0)) == (
            OFF_BELL,
            OFF_SLEEP,
        )
        #: mid-size blocking messages stream through the ring in C (p2pfast; with the compiled doorbell only)
        self._stream = getattr(fast_c, "stream", None) if self._c_bell else None
        self._put_stream = getattr(fast_c, "put_stream", None) if self._stream is not None else None
        self._spin_ns = int(self._spin * 1e9)
        self._arenas: List[ShmArena] = []
        self._bigs: Dict[int, ShmBigArena] = {}  # group key -> its big slots (one object per key: its turn persists)
        self._slice = slice_s
        #: blocking sends and receives that took the fast path in Python (see fast_sends/fast_recvs)
        self._fsends = 0
        self._frecvs = 0
        self._core: Any = None  # send_fast/recv_fast in C (_p2pwait.Core; set once the rings exist)
        self.fast_handoffs = 0  # streamed records whose peer stalled mid-record: the general path finished them
        self._fast_spun = 0.0  # when recv_fast last gave up after its spin (see _wait_req)
        self._flow = Flow()  # bumped whenever bytes move through a ring: a waiter keeps spinning while they do
        self._bell = Doorbell(rank, world_size, self._lock, slice_s, self._kick, self._maybe_check_peers_locked)
        self._ring = self._bell.ring  # the hot path, bound once
        self._next_live = 0.0
        self._watch = PeerWatch()
        self._rndv: Dict[int, SendReq] = {}  # rendezvous id -> send waiting for the receiver's acknowledgement
        self._rid = 0
        self._in: Dict[int, InRing] = {}
        self._out: Dict[int, OutRing] = {}
        self._in_list: List[InRing] = []
        self._pending_out: List[OutRing] = []
        self._peer_segs: Dict[int, Segment] = {}
        self._seg: Optional[Segment] = None
        formed = form_segments(
            store,
            rank,
            world_size,
            local,
            job_id=job_id,
            prefix=prefix,
            ring_size=ring_size,
            deadline=self._deadline,
            cma=_cma.enabled(opts),
            big_slot=opts.big_slot,
        )
        seg = self._seg = self._bell.seg = formed.seg
        self._peer_segs = formed.peer_segs
        self._watch = formed.watch
        peers = [r for r in local if r != rank]
        for p in peers:
            pseg = self._peer_segs[p]
            self._in[p] = InRing(p, seg, seg.slot_of(p), pseg)
            self._out[p] = OutRing(p, pseg, pseg.slot_of(rank), self._bell, self._flow)
        self._in_list = [self._in[p] for p in peers]
        self._core = _p2pfast.compiled_core(self, fast_c)  # send_fast/recv_fast in C (None: Python)

    @property
    def fast_sends(self) -> int:
        """Blocking sends that took the fast path (send_fast; for tests and `top`)."""
        return self._fsends + (self._core.counts()[0] if self._core is not None else 0)

    @property
    def fast_recvs(self) -> int:
        """Blocking receives that took the fast path (recv_fast; for tests and `top`)."""
        return self._frecvs + (self._core.counts()[1] if self._core is not None else 0)

    def sent_bytes(self) -> int:
        """Payload bytes sent to other ranks so far (bytes_sent plus the compiled fast path's)."""
        return self.bytes_sent + (self._core.counts()[2] if self._core is not None else 0)

    @property
    def doorbell(self) -> Doorbell:
        """This rank's doorbell: how another transport's waiter sleeps on shm activity and drives shm progress.

        The router's wait loop is ``snap = bell.snapshot(); if not done(): bell.sleep(snap, timeout)``, with
        ``bell.kick()`` inside ``done()`` and ``bell.poke()`` from other transports' activity hooks.
        """
        return self._bell

    def cma_pid(self, rank: int) -> int:
        """The pid of ``rank`` when this process can read its memory (process_vm_readv, probed at formation;
        ``PROCGROUP_SHM_CMA``), else 0."""
        o = self._out.get(rank)
        return self._watch.pids.get(rank, 0) if o is not None and o.cma else 0

    def _release_all(self) -> None:
        if self._core is not None:
            self._core.release()  # (its exports of the rings' buffers first: the memoryviews are released below)
        for a in self._arenas:
            a.release()
        self._arenas.clear()
        for b in self._bigs.values():
            b.release()
        self._bigs.clear()
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
            self._seg = self._bell.seg = None
        self._watch.close()

    # -- arenas ---------------------------------------------------------------------------
    def arena(self, key: int, members: Sequence[int], *, spanning: bool = False) -> Optional[Arena]:
        """Shared slots for group ``key`` among ``members`` (all on this host), or None where there are none.

        ``spanning`` (one host's members of a group spanning hosts): the slots' waits spin only
        ``ARENA_SPIN_SPANNING`` (none) before they sleep, unless ``PROCGROUP_SHM_SPIN_US`` was set.  Those members wait
        for the stage between hosts, and a spin that cannot pay off takes the CPU from the ranks doing that stage:
        3 hosts x 2 ranks on 2 CPUs, 64 KiB all_reduce 1.39 -> 1.16 ms, 256 KiB 2.12 -> 1.68 ms (slowest rank per
        call, median).

        None when the arena is off (``ShmOptions.arena``), ``key`` >= ARENA_GROUPS, fewer than two members,
        this rank not a member, a member on another host, or the transport closed.
        """
        ms = [int(m) for m in members]
        if not self._arena_on or not 0 <= key < ARENA_GROUPS or len(ms) < 2 or self.rank not in ms:
            return None
        if any(m != self.rank and m not in self._peer_segs for m in ms):
            return None  # a member on another host
        with self._lock:
            seg = self._seg
            if self._closed or seg is None:
                return None
            segs = [seg if m == self.rank else self._peer_segs[m] for m in ms]
            spin = self._spanning_spin if spanning else self._arena_spin
            a = ShmArena(
                self,
                key,
                ms,
                segs,
                spin=spin,
                oversubscribed=self._oversubscribed,
                slice_s=self._slice,
                native=self._native,
            )
            a.queue = ShmQueue(a, key, segs)
            self._arenas.append(a)
            if key < BIG_GROUPS:
                b = self._bigs.get(key)
                if b is None or b.members != ms:
                    b = big_arena_for(
                        self,
                        key,
                        ms,
                        segs,
                        spin=spin,
                        oversubscribed=self._oversubscribed,
                        slice_s=self._slice,
                        native=self._native,
                    )
                    if b is not None:
                        self._bigs[key] = b
                a.big = b
            return a

    def _notify_locked(self) -> None:
        bell = self._bell
        if bell.sleepers and bell.seg is not None:
            self._ring(bell.seg)
        for fn in self._hooks:
            fn()

    # -- sending ----------------------------------------------------------------------------
    def _send_remote(self, dst: int, tag: int, view: memoryview) -> Request:
        n = view.nbytes
        with self._lock:
            if self._closed:
                raise ClosedError(f"rank {self.rank}: send to rank {dst} on a closed shm transport")
            o = self._out[dst]
            if o.cma and by_rendezvous(n, o.cap):
                # rendezvous: the receiver copies straight from our buffer, then acknowledges
                s = SendReq(self, dst, tag, view)
                self._rid += 1
                self._rndv[self._rid] = s
                self._post_ctl_locked(o, tag, RNDV_BIT | n, REC.pack(address_of(view), self._rid))
                return s
            if not o.pending and o.try_write(tag, view):  # fast path: the whole message fits now
                return CompletedRequest(Status(dst, n))
            s = SendReq(self, dst, tag, view)
            o.pending.append(s)
            if len(o.pending) == 1:
                self._pending_out.append(o)
                if self._push(o):
                    self._notify_locked()
        return s

    def _post_ctl_locked(self, o: OutRing, tag: int, length_field: int, payload: bytes) -> None:
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
                            self._watch.pids.get(src, 0), address_of(req.out), addr, n
                        )
                except OSError as e:
                    if e.errno == errno.ESRCH:
                        req.error = self._peer_error(req, src, f"rank {src} died (its memory is gone)")
                    else:
                        req.error = BrokenError(
                            f"rank {self.rank}: reading a {n}-byte message of rank {src} (tag {req.tag}) through "
                            f"process_vm_readv failed: {e}; set PROCGROUP_SHM_CMA=0 to send large messages "
                            "through the rings"
                        )
                else:
                    req.status = Status(src, n)
        req.out = None  # type: ignore[assignment]  # RecvReq.out (_engine) is typed non-optional; drop the export
        o = self._out.get(src)
        if o is not None and src not in self._failed:
            self._post_ctl_locked(o, rid, ACK, b"")

    def _entry_matched_locked(self, entry: Unexpected) -> None:
        if isinstance(entry, RndvEntry) and entry.waiter is not None:
            req = entry.waiter
            entry.waiter = None
            self._rndv_read_locked(req, entry.src, entry.addr, entry.nbytes, entry.rid)

    def _push(self, o: OutRing) -> bool:
        """Write as much of ``o``'s pending sends as fits; True if one completed. Lock held."""
        completed = o.push()
        if not o.pending:
            try:
                self._pending_out.remove(o)
            except ValueError:
                pass
        return completed

    # -- receiving ---------------------------------------------------------------------------
    def _drain(self, r: InRing) -> bool:
        """Consume what ring ``r`` holds; True if a request completed or a message arrived. Lock held."""
        q = r.seg.q
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
                if head < t + REC_SIZE:
                    break
                tag, length = REC.unpack_from(data, t & mask)
                if length > LEN_MASK:  # a control record
                    if length == ACK:
                        tail = t + REC_SIZE
                        s = self._rndv.pop(tag, None)
                        if s is not None:
                            if s.error is None:
                                s.status = Status(s.peer, s.nbytes)
                            s.view = None  # type: ignore[assignment]  # SendReq.view is non-optional; drop export
                        progressed = True
                        continue
                    if head < t + 2 * REC_SIZE:
                        break  # the descriptor is not all there yet
                    addr, rid = REC.unpack_from(data, (t + REC_SIZE) & mask)
                    tail = t + 2 * REC_SIZE
                    length &= LEN_MASK
                    req = self._match_locked(src, tag)
                    if req is not None:
                        self._rndv_read_locked(req, src, addr, length, rid)
                    else:
                        self._add_unexpected_locked(tag, RndvEntry(src, length, addr, rid))
                    progressed = True
                    continue
                tail = t + REC_SIZE
                req = self._match_locked(src, tag)
                if req is not None:
                    if length > req.out.nbytes:
                        req.error = self._size_error(req, src, length)
                        dest = None
                    else:
                        dest = req.out
                    target: _Target = req
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
                        dest[off : off + k] = data[pos : pos + k]
                    else:
                        dest[off : off + first] = data[pos:]
                        dest[off + first : off + k] = data[: k - first]
                tail += k
                off += k
                n -= k
                self._flow.moved += 1
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

    def _release(self, r: InRing, tail: int) -> None:
        r.tail = tail
        seg = r.seg
        seg.q[r.tail_i] = tail
        fence()
        if seg.i[r.want_i]:
            self._ring(r.peer_seg)

    def _complete(self, target: _Target, src: int, n: int) -> None:
        if isinstance(target, RecvReq):
            if target.error is None:
                target.status = Status(src, n)
            target.out = None  # type: ignore[assignment]  # RecvReq.out is typed non-optional; drop the export
        else:
            self._entry_done_locked(target)

    def _progress_locked(self, skip: Optional[InRing] = None) -> bool:
        """A progress pass: drain every incoming ring but ``skip`` (whose next record a fast receive may take),
        push pending sends, wake our waiters when anything moved. Lock held."""
        progressed = False
        for r in self._in_list:
            if r is not skip and self._drain(r):
                progressed = True
        if self._pending_out:
            for o in list(self._pending_out):
                if self._push(o):
                    progressed = True
        if progressed:
            self._notify_locked()
        return progressed

    # -- the blocking small-message fast path (procgroup.p2p.send/recv): in .p2pfast --------------------
    send_fast = _p2pfast.send_fast
    recv_fast = _p2pfast.recv_fast

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
            elif pseg.i[OFF_STATE // 4] == ST_CLOSED:
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
                e = target
                if e.waiter is not None:
                    self._fail_entry_locked(e, self._peer_error(e.waiter, peer, reason))
                else:
                    self._fail_entry_locked(e, PeerFailureError(reason, peer=peer))
        for rid, s in list(self._rndv.items()):
            if s.peer == peer:
                del self._rndv[rid]
                if s.status is None and s.error is None:
                    s.error = self._peer_error(s, peer, reason)
                s.view = None  # type: ignore[assignment]  # SendReq.view is typed non-optional; drop the export
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
        """One progress pass plus a due liveness check (``doorbell.kick()``: for waiters on other transports)."""
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
        bell = self._bell
        flow = self._flow
        spin_end = 0.0
        addr = 0
        while True:
            with lock:
                if not self._closed:
                    snap = bell.value()
                    moved = flow.moved
                    self._progress_locked()
                    if flow.moved != moved:
                        spin_end = 0.0  # data is flowing (a large message streams): keep polling
                st: Optional[Status] = req.status
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
                    if now - self._fast_spun < 1e-3:  # recv_fast spun for this receive just now: sleep at once
                        spin_end = now
                        self._fast_spun = 0.0
                elif now >= spin_end:
                    self._maybe_check_peers_locked(now)
                    if req.status is None and req.error is None:
                        spinning = False
                        addr = bell.raise_flag_locked()
            if spinning:
                if self._yield:
                    _sched_yield()  # an oversubscribed host: let the peer we wait for run
                continue
            fence()  # the sleep flag before the doorbell compare (Dekker with Doorbell.ring)
            try:
                t = self._slice
                if deadline is not None:
                    t = min(t, deadline.remaining())
                _futex.futex_wait(addr, snap, min(t, self._next_live - time.monotonic() + 1e-3))
            finally:
                bell.lower_flag()

    # -- closing ---------------------------------------------------------------------------------
    def _fail_inflight_locked(self, err: BaseException) -> None:
        for s in self._rndv.values():
            if s.status is None and s.error is None:
                s.error = err
            s.view = None  # type: ignore[assignment]  # SendReq.view is typed non-optional; drop the export
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
                head.view = None  # type: ignore[assignment]  # SendReq.view is typed non-optional: pad with zeros
                o.pending.append(head)
            elif o in self._pending_out:
                self._pending_out.remove(o)

    def _close_locked(self) -> None:
        self._bell.closed = True  # with _closed: pokes and doorbell sleeps stop
        super()._close_locked()
        seg = self._seg
        if seg is not None:
            seg.i[OFF_STATE // 4] = ST_CLOSED
            self._ring(seg, force=True)
            for p, pseg in self._peer_segs.items():  # let blocked peers notice now rather than at their next slice
                if p not in self._failed:
                    self._ring(pseg, force=True)

    def _after_close(self) -> None:
        bell = self._bell
        with bell.idle:
            bell.wait_idle_locked(1.0)
            self._release_all()

    def __repr__(self) -> str:
        return f"<ShmTransport rank {self.rank} peers {sorted(self._peers)}{' closed' if self._closed else ''}>"
