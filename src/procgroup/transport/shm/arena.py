"""Arena: shared slots in the members' segments, for the small collectives of ranks that share a host.

Groups whose ranks all share this host (and whose id is below
``ARENA_GROUPS``) get a :class:`ShmArena`: member ``m`` publishes into its
own segment's slot for the group (payload, then check word, then count:
TSO keeps that order), fences, and reads every member's count and check.
Whoever sees every member there rings the doorbells of the members whose
sleep flag is up.  The others poll (``ARENA_SPIN``; on a host with fewer
CPUs than local ranks they ``sched_yield`` at every poll, so the members
they wait for run instead), then raise their sleep flag, fence, re-check
and sleep on their doorbell (Dekker with the completer's
count-fence-flag), and check liveness, abort, close and the deadline at
every slice.  The small collectives of ``algorithms.arena`` use it: one
publish and one wake instead of log2(p) rounds of matched messages.

Each slot is double-buffered by call parity, so a fast member never
overwrites a slot a slow member still reads.

Compiled fast path: where the optional extension ``_native`` was built (setup.py; plain C on the CPython API)
and ``PROCGROUP_NATIVE`` is not 0, publish, fence, check and the spin run in one C call with the GIL released,
and :meth:`ShmArena.exchange_reduce` also reduces there (SUM/PRODUCT/MIN/MAX on float32/float64/int32/int64, in
member order, numpy's results bit for bit).  The slot protocol is the same, so ranks on either path exchange
with each other; the sleep loop (doorbell, deadline, peer failure, abort, close) stays in Python on both, and
the C call returns to it when its spin ends.  x86-64 only (the ordering the Python path relies on, see layout).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ...deadline import Deadline
from ...errors import BrokenError, ClosedError, ConfigError, PeerFailureError
from .. import _cma
from ..base import ARENA_BYTES, Arena, address_of, raise_if_stuck
from .doorbell import Doorbell
from .layout import ARENA_HDR, ARENA_SLOT, OFF_BELL, OFF_SLEEP, X86, Segment, fence

try:
    from . import _native
except ImportError as e:  # not built (no compiler at install time): the pure-Python path
    _native = None  # type: ignore[assignment]
    _NATIVE_MISSING = str(e)
else:
    _NATIVE_MISSING = ""

__all__ = [
    "ShmArena",
    "ArenaHost",
    "ARENA_SPIN",
    "ARENA_SPIN_OVERSUBSCRIBED",
    "ARENA_SPIN_SPANNING",
    "native_available",
    "set_streaming",
    "STREAM_MIN",
    "STREAM_PIECES_MIN",
    "REDUCE_OPS",
]

logger = logging.getLogger("procgroup.transport")

#: the reductions the compiled path does itself: op codes and element-type codes of ``exchange_reduce``
REDUCE_OPS = {"sum": 0, "product": 1, "min": 2, "max": 3}
REDUCE_TYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3}

#: how long an arena wait polls before it sleeps (s): every local rank has a CPU / the host is oversubscribed
ARENA_SPIN = 200e-6
ARENA_SPIN_OVERSUBSCRIBED = 300e-6
#: ... and one host's members of a group spanning hosts, who wait for the stage between hosts: no spin, they
#: sleep at once (a stage over TCP takes longer than a spin could catch, and a spin takes the CPU from the ranks
#: that run it).  3 netns hosts x 2 ranks on 2 CPUs, hierarchical all_reduce, whole jobs alternating (6-8
#: rounds, slowest rank per call, median), 0 against 20 us of spin: 64 KiB 0.90x (7 of 8 rounds), 256 KiB
#: 0.93x, 1 MiB 0.98x.  (An earlier A/B, 0 / 20 / 50 / 200 us: 1.11-1.19 / 1.14-1.18 / 1.20-1.27 / 1.39 ms.)
ARENA_SPIN_SPANNING = 0.0

#: copies into shared slots that every member of a group of 3 or more reads whole (``copy_to_shared`` in
#: ``_native.h``: broadcast, all_gather, an all_reduce's buffers) use streaming (non-temporal) stores from this many
#: bytes on.  The 2-CPU VM has periods (seconds to minutes; the host places the vCPUs) where a plain store to a line
#: the other CPU has read costs ~4x more: 64 KiB written where the reader had read it 28-41 us against 7.6-11 in the
#: other periods; streamed 4-5.7 in either (benchmarks/results/pass20).  N=4, whole benchmark runs alternating (3
#: rounds, auto against never): broadcast 64 KiB-4 MiB 0.21-0.34x the time, all_reduce 0.44-0.67x.
STREAM_MIN = 8 << 10
#: ... and with PROCGROUP_SHM_STREAM=always also those each member reads a piece of (all_to_all's streams, the inputs
#: of a reduction, a reduce's parts), from this many bytes on.  Not by default: the readers then fetch from memory
#: (6 GB/s here) what a plain store leaves in the writer's cache; earlier runs (4 rounds) had all_to_all 64 KiB-16 MiB
#: at 1.15-1.64x and reduce_scatter 256 KiB-1 MiB at 1.28-1.38x with those streamed (adaptively: while a timed plain
#: copy ran slower than 4 GB/s).
STREAM_PIECES_MIN = 64 << 10


def set_streaming(mode: str) -> None:
    """Apply ``PROCGROUP_SHM_STREAM`` (:class:`~procgroup.config.ShmOptions`.stream) to this process's compiled
    copies: "auto" (copies every member reads whole stream from STREAM_MIN bytes on), "always" (also those each
    member reads a piece of, from STREAM_PIECES_MIN on) or "never" (plain stores).  Each process chooses alone: the
    bytes are the same either way."""
    if _native is None:
        return
    if mode == "never":
        _native.set_stream_min(-1, -1)
    else:
        _native.set_stream_min(STREAM_MIN, STREAM_PIECES_MIN if mode == "always" else -1)


_sched_yield = getattr(os, "sched_yield", lambda: None)
_noticed = False


def native_available() -> bool:
    """True when the compiled fast path was built and can run here (x86-64)."""
    return _native is not None and X86


def _notice_once() -> None:
    global _noticed
    if not _noticed:
        _noticed = True
        why = "not built (no C compiler at install time?)" if _native is None else "x86-64 only"
        logger.info(
            "procgroup: compiled arena fast path %s; small collectives use the pure-Python path "
            "(reinstall with a C compiler for it; PROCGROUP_NATIVE=0 selects the Python path on purpose)",
            why,
        )


class ArenaHost(Protocol):
    """What an arena reads of its shm transport (the transport's own state, read without its lock)."""

    rank: int
    bytes_sent: int
    _aborted: Optional[BaseException]
    _closed: bool
    _failed: Dict[int, str]
    _seg: Optional[Segment]

    @property
    def doorbell(self) -> Doorbell:
        """The transport's doorbell."""

    def cma_pid(self, rank: int) -> int:
        """The pid of ``rank`` when this process can read its memory, else 0."""


def _no_bytes() -> int:
    return 0


#: a yield that kept the poller off the CPU this long (seconds) ends the poll (see :func:`poll`)
LONG_YIELD = 50e-6


def poll(ready: Callable[[], bool], spin: float, yld: bool) -> bool:
    """Poll ``ready()`` for ``spin`` seconds (``yld``: yielding the CPU at every poll, for the member we wait
    for may be queued behind us); True once it is, False when the spin ends or the views were released.

    A yield that kept us off the CPU for more than :data:`LONG_YIELD` with ``ready()`` still false ends the
    poll: another thread had our CPU for a time slice, and each further yield would hand it another (the
    caller then sleeps on its doorbell, and the member it waits for wakes it), as the compiled spin does.
    """
    now = time.monotonic()
    end = now + spin
    try:
        while now < end:
            if ready():
                return True
            if yld:
                _sched_yield()
                t = time.monotonic()
                if t - now > LONG_YIELD:
                    return bool(ready())
                now = t
            else:
                now = time.monotonic()
    except ValueError:  # the views were released: the transport closed (the sleep loop says so)
        pass
    return False


def sleep_until(
    t: ArenaHost,
    ready: Callable[[], bool],
    missing: Callable[[], List[int]],
    deadline: Optional[Deadline],
    slice_s: float,
    what: str,
    members: Sequence[int],
    where: Callable[[], str],
) -> None:
    """Sleep on ``t``'s doorbell until ``ready()``, checking abort, close, dead members and the deadline.

    ``missing()``: the members (global ranks) not there yet; ``what``, ``members``, ``where()``: for the
    error messages (see :func:`~procgroup.transport.base.raise_if_stuck`); ``slice_s``: the longest sleep
    without a deadline.
    """
    bell = t.doorbell
    while True:
        seg = t._seg
        if t._aborted is not None:
            raise t._aborted
        if t._closed or seg is None:
            raise ClosedError(f"rank {t.rank}: the shm transport was closed during a {what}")
        try:
            snap = seg.i[OFF_BELL // 4]  # before the check: a ring after it moves the doorbell
            if ready():
                return
            # who is missing only matters past the deadline or once a rank failed (the error names them)
            miss = missing() if t._failed or (deadline is not None and deadline.expired()) else None
        except ValueError:  # the views were released: the transport closed just now (raised above)
            continue
        if miss is not None and (deadline is not None and deadline.expired() or any(m in t._failed for m in miss)):
            raise_if_stuck(t.rank, what, miss, t._failed, deadline, members=members, where=where())
        bell.sleep(snap, slice_s if deadline is None else max(deadline.remaining(), 1e-4), ready)


class ShmArena(Arena):
    """Arena slots of group ``key`` in the segments of ``members`` (``segs``, in member order).

    ``spin``: seconds a wait polls before it sleeps (yielding the CPU at every poll when ``oversubscribed``);
    ``slice_s``: the longest sleep without a deadline; ``native``: use the compiled fast path where it was
    built (``PROCGROUP_NATIVE``).

    ``exchange`` raises ClosedError on a closed transport, the abort error after ``abort()``,
    PeerFailureError when a missing member is known dead, DistTimeoutError past the deadline,
    ConfigError for a payload larger than ``max_bytes``.
    """

    def __init__(
        self,
        t: ArenaHost,
        key: int,
        members: List[int],
        segs: List[Segment],
        *,
        spin: float,
        oversubscribed: bool,
        slice_s: float,
        native: bool = True,
    ) -> None:
        self.t = t
        self._spin = spin
        self._oversubscribed = oversubscribed
        self._slice = slice_s
        self.members = members
        self.index = members.index(t.rank)
        self.max_bytes = ARENA_BYTES
        own = segs[self.index]
        offs = [[seg.arena_off + (2 * key + k) * ARENA_SLOT for seg in segs] for k in (0, 1)]
        # per parity: (u32 view, index of the count word) of every member, and every member's payload view
        self._slots: List[List[Tuple[memoryview, int]]] = [
            [(seg.i, off // 4) for seg, off in zip(segs, offs[k])] for k in (0, 1)
        ]
        self._data = [
            [memoryview(seg.mm)[off + ARENA_HDR :][:ARENA_BYTES] for seg, off in zip(segs, offs[k])] for k in (0, 1)
        ]
        self._others = [seg for seg in segs if seg is not own]
        self._segs = segs
        self.count = 0
        #: the group's one-way queue (:mod:`.queue`; the transport sets it), whose chain every exchange folds in
        self.queue: Any = None
        self._nat: Any = None
        self._reads: Dict[int, Callable[..., Optional[bool]]] = {}  # bind_read's calls, by mode
        # every member's pid (ours included) where this process can read every other member's memory (probed at
        # formation, before any arena; pids do not change), else None: the readers and the compiled reads use them
        pids = [t.cma_pid(m) if i != self.index else os.getpid() for i, m in enumerate(members)]
        self._pids: Optional[List[int]] = pids if all(pids) else None
        self._reader = self._cma("read", "reading", "process_vm_readv", "of")
        if native:
            if native_available():
                self._nat = _native.Slots(
                    [seg.mm for seg in segs],
                    offs[0],
                    offs[1],
                    self.index,
                    ARENA_BYTES,
                    OFF_SLEEP,
                    int(spin * 1e9),
                    oversubscribed,
                )
                self._nat.set_pids(self._pids or [])  # none: its offers say "cannot", every member falls back
            else:
                _notice_once()

    @property
    def native(self) -> bool:
        """True when this arena runs the compiled fast path."""
        return self._nat is not None

    @property
    def calls(self) -> int:
        """Exchanges published so far."""
        return int(self._nat.count) if self._nat is not None else self.count

    def release(self) -> None:
        """Drop the views into the segments (before they are unmapped)."""
        if self.queue is not None:
            self.queue.release()
        if self._nat is not None:
            self._nat.release()  # its exports end once no call of ours is inside it
        for views in self._data:
            for v in views:
                v.release()
        self._slots = [[], []]
        self._others = []
        self._segs = []

    def _arrived(self, k: int, val: int, check: int) -> bool:
        slots = self._slots[k]
        for w, c in slots:
            if w[c] != val or w[c + 1] != check:
                return False
        return bool(slots)  # released (the transport closed during the spin): not arrived

    def _enter(self) -> Any:
        """The transport, after checking it is neither aborted nor closed (raises its abort error, ClosedError)."""
        t = self.t
        if t._aborted is not None:
            raise t._aborted
        if t._closed or not self._others:
            raise ClosedError(f"rank {t.rank}: shared-slot exchange on a closed shm transport")
        return t

    def exchange(self, data: Optional[Any], check: int, deadline: Optional[Deadline]) -> Sequence[memoryview]:
        """Publish ``data`` (a byte view, or None) with ``check``; returns every member's slot, in member order."""
        t = self._enter()
        nat = self._nat
        if nat is not None:
            r = nat.exchange(data, check)
            if r:
                self._settle(r, deadline, lambda: memoryview(data or b"").nbytes)
            if data is not None:
                t.bytes_sent += data.nbytes  # for `procgroup top` (procgroup.telemetry)
            return self._data[(nat.count - 1) & 1]
        n = 0 if data is None else data.nbytes
        if n > ARENA_BYTES:  # before counting the call: a refused call must not shift this member's count
            raise ConfigError(f"arena exchange of {n} bytes exceeds the slot size {ARENA_BYTES}")
        if self.queue is not None:
            check ^= self.queue.chain  # the group's one-way calls so far (the compiled call folds its own in)
        k = self.count & 1
        self.count += 1
        val = (self.count - 1) % 0xFFFFFFFF + 1  # never 0 (0: "never published")
        me = self.index
        views = self._data[k]
        if n:
            views[me][:n] = data  # type: ignore[assignment]  # n > 0: data is a buffer
            t.bytes_sent += n  # for `procgroup top` (procgroup.telemetry)
        w, c = self._slots[k][me]
        w[c + 1] = check
        w[c] = val  # last: publishes the payload and the check (stores stay in order on x86)
        fence()  # our count before their counts and sleep flags (Dekker with the other arrivers and sleepers)
        if self._arrived(k, val, check):
            self._ring_sleepers()  # we completed the exchange; members that may be asleep on it need a wake
            return views
        self._wait(k, val, check, deadline)
        return views

    def bind_barrier(self) -> Callable[[Any, int, Optional[Deadline]], None]:
        """:meth:`exchange` of no data, for a plan's repeated barriers (compiled path only): ``fn(_, check,
        deadline)`` publishes and polls in one C call and sleeps (:meth:`_settle`) only when its spin ended."""
        nat = self._nat
        assert nat is not None
        nex = nat.exchange
        t = self.t

        def fn(_: Any, check: int, deadline: Optional[Deadline]) -> None:
            if t._aborted is not None or t._closed:
                self._enter()  # raises
            r = nex(None, check)
            if r:
                self._settle(r, deadline, _no_bytes)

        return fn

    def exchange_reduce(
        self, buf: Any, op: int, dtype: int, check: int, deadline: Optional[Deadline], reduce: bool = True
    ) -> bool:
        """Publish ``buf`` and (``reduce``) reduce every member's slot into it, in member order, in one C call.

        ``op``/``dtype``: codes of :data:`REDUCE_OPS`/:data:`REDUCE_TYPES`.  Returns False, having done
        nothing, where the compiled path is off or ``buf`` is not aligned to its element size: the caller
        then uses :meth:`exchange` and reduces itself.  Raises as :meth:`exchange`.
        """
        nat = self._nat
        if nat is None:
            return False
        t = self._enter()
        r = nat.exchange_reduce(buf, check, op, dtype, reduce)
        if r:
            late = self._settle(r, deadline, lambda: buf.nbytes)
            if late is None:
                return False
            if late and reduce:
                nat.reduce(buf, op, dtype)
        t.bytes_sent += buf.nbytes  # for `procgroup top` (procgroup.telemetry)
        return True

    def exchange_reduce_block(
        self, data: Any, out: Any, op: int, dtype: int, off: int, check: int, deadline: Optional[Deadline]
    ) -> bool:
        """Publish ``data`` and reduce every member's slot from payload byte ``off`` (``out.nbytes`` bytes) into
        ``out``, in member order, in one C call (reduce_scatter's block; ``op``/``dtype`` as for
        :meth:`exchange_reduce`).  Returns False, having done nothing, where the compiled path is off or ``out``
        is not aligned or does not lie within ``data``.  Raises as :meth:`exchange`."""
        nat = self._nat
        if nat is None:
            return False
        t = self._enter()
        r = nat.exchange_reduce_block(data, out, check, op, dtype, off)
        if r:
            late = self._settle(r, deadline, lambda: data.nbytes)
            if late is None:
                return False
            if late:
                nat.reduce(out, op, dtype, off)
        t.bytes_sent += data.nbytes  # for `procgroup top` (procgroup.telemetry)
        return True

    def exchange_copy(self, data: Optional[Any], out: Any, src: int, check: int, deadline: Optional[Deadline]) -> bool:
        """Publish ``data`` (None: no bytes) and copy into ``out``, in one C call, member ``src``'s slot (its first
        ``out.nbytes`` bytes) or, with ``src`` -1, every member's first ``out.nbytes / n`` bytes in member order.

        Returns False, having done nothing, where the compiled path is off or ``out`` does not split into
        equal parts: the caller then uses :meth:`exchange` and copies itself.  Raises as :meth:`exchange`.
        """
        nat = self._nat
        if nat is None:
            return False
        t = self._enter()
        r = nat.exchange_copy(data, check, out, src)
        if r:
            each = out.nbytes if src >= 0 else out.nbytes // len(self.members)
            late = self._settle(r, deadline, lambda: max(memoryview(data or b"").nbytes, each))
            if late is None:
                return False
            if late:
                nat.copy(out, src)
        if data is not None:
            try:
                t.bytes_sent += data.nbytes  # for `procgroup top` (procgroup.telemetry)
            except AttributeError:  # bytes, bytearray
                t.bytes_sent += memoryview(data).nbytes
        return True

    def last_slots(self) -> Sequence[memoryview]:
        """Every member's payload view of the last exchange (what :meth:`exchange` returned for it)."""
        return self._data[(self.calls - 1) & 1]

    def exchange_a2a(
        self,
        spec: Any,
        head: Any,
        send: Any,
        recv: Any,
        check: int,
        deadline: Optional[Deadline],
        big: Any,
        lim: int,
        beyond: int,
    ) -> int:
        """all_to_all in one C call (``algorithms.alltoall_shm``): write ``head`` and this rank's stream (laid out
        by ``spec``) into its slot, or the stream into its big buffer ``big.turn & 1`` when longer than the slot
        and at most ``lim`` bytes, exchange, and copy every piece for this rank into ``recv``; where the longest
        stream is beyond ``beyond`` (the streams' limit) or the group has no big slots, read the pieces of the
        streams beyond the slot straight out of their senders' ``send`` and end with alltoall_shm's closing
        exchange (every header offering them: see ``_native_a2a.c``).

        Returns -1, having done nothing, where the compiled path is off or the stream fits none of these; else the
        flags 2 (big buffers used: the caller advances ``big.turn``) and 4 (the exchange completed but nothing
        was copied: the caller reads the slots itself).  Raises as :meth:`exchange`, and a failed read as
        :meth:`reader`'s reads.
        """
        nat = self._nat
        if nat is None:
            return -1
        t = self.t
        if t._aborted is not None or t._closed:
            self._enter()  # raises
        if big is None:
            bn, bk, lim = None, 0, 0
        else:
            bn, bk = big._nat, big.turn & 1  # None on the pure-Python big slots: lim is then ignored
        far = beyond if big is None or bn is not None else -1  # pure-Python big slots: Python decides the reads
        r = nat.exchange_a2a(spec, head, send, recv, check, bn, bk, lim, far)
        if r == -3:
            return -1
        return self._a2a_rest(r, spec, send, recv, bn, bk, lim, far, deadline)

    def _a2a_rest(
        self, r: int, spec: Any, send: Any, recv: Any, bn: Any, bk: int, lim: int, far: int, dl: Optional[Deadline]
    ) -> int:
        """What a compiled all_to_all that returned ``r`` (not -3) leaves to do: the sleeps, wakes, the finish after
        a sleep or a wake, a failed read's error; its flags 2 and 4 (see :meth:`exchange_a2a`)."""
        nat = self._nat
        if r == -1:  # the exchange: sleep until every member published, then copy or read
            self._sleep(nat.arrived, nat.missing, dl)
            r = nat.a2a_finish(spec, send, recv, bn, bk, lim, far)
        elif r > 0 and r & 32:  # it completed with members asleep on it, and the pieces are to be read: wake first
            self._ring_sleepers()
            r = nat.a2a_finish(spec, send, recv, bn, bk, lim, far)
        if r < 0:  # -9: a read failed (the closing exchange was not published)
            raise self._cma_error("reading", "of", "process_vm_readv", nat.rd_peer, nat.rd_errno, -1)
        if r & 16:  # read; the closing exchange waits for the others' reads
            self._sleep(nat.arrived, nat.missing, dl)
        elif r & 1:
            self._ring_sleepers()
        return int(r & 6)

    def bind_a2a(self, spec: Any, head: Any, big: Any) -> Optional[Callable[[Any, Any, int, Any, int, int], int]]:
        """:meth:`exchange_a2a` with its layout bound, for a plan's repeated calls: ``fn(send, recv, check,
        deadline, lim, beyond)``, returning as it does; None where the compiled path is off."""
        nat = self._nat
        if nat is None:
            return None
        xa = nat.exchange_a2a
        t = self.t
        bn = big._nat if big is not None else None
        reads = big is None or bn is not None  # pure-Python big slots: Python decides the reads (beyond -1)
        rest = self._a2a_rest

        def fn(send: Any, recv: Any, check: int, deadline: Optional[Deadline], lim: int, beyond: int) -> int:
            if t._aborted is not None or t._closed:
                self._enter()  # raises
            if big is not None and big.pending is not None:
                big.settle(deadline)  # our one-way step (a reduce) is past before a big buffer is written
            bk = big.turn & 1 if bn is not None else 0
            lw = lim if bn is not None else 0
            far = beyond if reads else -1
            r = xa(spec, head, send, recv, check, bn, bk, lw, far)
            if r == 0:
                return 0
            if r == -3:
                return -1
            if r > 0 and not r & 49:  # done: no wake, no sleep, no reads left
                return int(r & 6)
            return rest(r, spec, send, recv, bn, bk, lw, far, deadline)

        return fn

    def bind_read(self, mode: int) -> Optional[Callable[..., Optional[bool]]]:
        """See :meth:`Arena.bind_read`: the compiled ``exchange_read``; None where the compiled path is off."""
        nat = self._nat
        if nat is None:
            return None
        bound = self._reads.get(mode)
        if bound is not None:
            return bound
        xr, finish = nat.exchange_read, nat.read_finish
        t = self.t

        def fn(send: Any, recv: Any, check: int, end: int, root: int, deadline: Optional[Deadline]) -> Optional[bool]:
            if t._aborted is not None or t._closed:
                self._enter()  # raises
            r = xr(send, recv, check, end, mode, root)
            if r == 0:
                return True
            return self._reads_rest(r, lambda stage: finish(send, recv, end, mode, root), deadline)

        self._reads[mode] = fn
        return fn

    def bind_reduce_read(self, mode: int) -> Optional[Callable[..., Optional[bool]]]:
        """See :meth:`Arena.bind_reduce_read`: the compiled ``exchange_rr``; None where the compiled path is off."""
        nat = self._nat
        if nat is None:
            return None
        bound = self._reads.get(-1 - mode)
        if bound is not None:
            return bound
        xr = nat.exchange_rr
        t = self.t

        def fn(send: Any, recv: Any, check: int, op: int, ty: int, deadline: Optional[Deadline]) -> Optional[bool]:
            if t._aborted is not None or t._closed:
                self._enter()  # raises
            r = xr(send, recv, check, op, ty, mode, 0)
            if r == 0:
                return True
            return self._reads_rest(r, lambda stage: xr(send, recv, check, op, ty, mode, stage), deadline)

        self._reads[-1 - mode] = fn
        return fn

    def _reads_rest(self, r: int, again: Callable[[int], int], deadline: Optional[Deadline]) -> Optional[bool]:
        """What a compiled call of one-copy reads (``exchange_read``, ``exchange_rr``) that returned ``r`` (not 0)
        leaves to do: sleep on or ring an exchange and continue with ``again(stage)`` (1: after the opening one, 2:
        after the middle one), until done (True), nobody moved anything (False: a member cannot read), refused
        (None: nothing published), or a read failed (the error)."""
        nat = self._nat
        while r < 0:
            if r == -1 or r == -7:  # the opening / middle exchange: sleep until every member is there, go on
                self._sleep(nat.arrived, nat.missing, deadline)
                r = again(1 if r == -1 else 2)
            elif r == -8 or r == -10:  # ... completed with members asleep on it: wake them first
                self._ring_sleepers()
                r = again(1 if r == -8 else 2)
            elif r == -5:  # read; the closing exchange waits for the others' reads
                self._sleep(nat.arrived, nat.missing, deadline)
                return True
            elif r == -6:
                return False
            elif r == -3:
                return None
            else:
                raise self._cma_error("reading", "of", "process_vm_readv", nat.rd_peer, nat.rd_errno, -1)
        if r:
            self._ring_sleepers()
        return True

    def _cma_error(self, verb: str, prep: str, call: str, i: int, err: int, n: int) -> Exception:
        """The error of a process_vm_readv / _writev of ``n`` bytes (-1: not known) with member ``i`` that failed
        with errno ``err``."""
        me, m = self.t.rank, self.members[i]
        what = f"{verb} {n} bytes" if n >= 0 else verb
        if err == errno.ESRCH:
            return PeerFailureError(f"rank {me}: {what} {prep} rank {m}: rank {m} died", peer=m)
        return BrokenError(
            f"rank {me}: {what} {prep} rank {m} through {call} failed: {os.strerror(err)}; set PROCGROUP_SHM_CMA=0 "
            "to move them as messages"
        )

    def _settle(self, r: int, deadline: Optional[Deadline], nbytes: Callable[[], int]) -> Optional[bool]:
        """What a compiled publish-and-poll call that returned ``r`` (not 0) leaves to do.

        ``r`` > 0: complete, and members may sleep on it: rings them; False.  -3: refused, nothing done (the
        caller takes the Python path); None.  -2: the data does not fit a slot: ConfigError naming ``nbytes()``.
        Otherwise the spin ended before every member came: sleeps here until they do (deadline, dead peers and
        abort as :meth:`exchange`); True, and the caller finishes the copy or reduction the call left undone.
        """
        if r > 0:
            self._ring_sleepers()
            return False
        if r == -3:
            return None
        if r == -2:
            raise ConfigError(f"arena exchange of {nbytes()} bytes exceeds the slot size {ARENA_BYTES}")
        nat = self._nat
        assert nat is not None
        self._sleep(nat.arrived, nat.missing, deadline)
        return True

    def _ring_sleepers(self) -> None:
        ring = self.t.doorbell.ring
        for seg in self._others:
            if seg.i[OFF_SLEEP // 4]:
                ring(seg, force=True)  # its flag is up: a new doorbell value, then FUTEX_WAKE

    def _wait(self, k: int, val: int, check: int, deadline: Optional[Deadline]) -> None:
        def ready() -> bool:
            return self._arrived(k, val, check)

        if self._spin and poll(ready, self._spin, self._oversubscribed):
            return
        slots = self._slots[k]

        def missing() -> List[int]:
            return [i for i, (w, c) in enumerate(slots) if w[c] != val or w[c + 1] != check]

        self._sleep(ready, missing, deadline)

    def _sleep(self, ready: Callable[[], bool], missing: Callable[[], List[int]], deadline: Optional[Deadline]) -> None:
        """Sleep on the doorbell until ``ready()``, checking abort, close, dead members and the deadline."""
        members = self.members
        sleep_until(
            self.t,
            ready,
            lambda: [members[i] for i in missing()],
            deadline,
            self._slice,
            "shared-slot exchange",
            members,
            lambda: f"call {self.calls} of this group's arena",
        )

    def reader(self) -> Optional[Callable[[int, memoryview, int], None]]:
        """``read(i, out, addr)``: ``out.nbytes`` bytes at address ``addr`` of member ``i``'s memory into ``out``,
        in one process_vm_readv, where this process can read every other member's memory; else None.  Made once,
        with the arena."""
        return self._reader

    def writer(self) -> Optional[Callable[[int, memoryview, int], None]]:
        """``write(i, data, addr)``: ``data`` to address ``addr`` of member ``i``'s memory, in one
        process_vm_writev, where this process can read every other member's memory (the same permission) and the
        call is allowed here (:func:`._cma.can_write`); else None."""
        if not X86:  # the handshake of a write (algorithms.onecopy.bcast_pair) needs fence() to be a full barrier
            return None
        return self._cma("write", "writing", "process_vm_writev", "to") if _cma.can_write() else None

    def fence(self) -> None:
        """A full memory barrier (:func:`.layout.fence`: a full one on x86, where :meth:`writer` is offered)."""
        fence()

    def pid_of(self, i: int) -> int:
        """The process id of member ``i`` where this process can read its memory, else 0."""
        return self.t.cma_pid(self.members[i])

    def _cma(self, copy: str, verb: str, call: str, prep: str) -> Optional[Callable[[int, memoryview, int], None]]:
        """The reader or writer: ``copy``, the :mod:`._cma` function's name (looked up per call), and the words of
        its error messages."""
        pids = self._pids
        if pids is None:
            return None

        def move(i: int, buf: memoryview, addr: int) -> None:
            n = buf.nbytes
            if not n:
                return
            try:
                getattr(_cma, copy)(pids[i], address_of(buf), addr, n)
            except OSError as e:
                raise self._cma_error(verb, prep, call, i, e.errno or 0, n) from e

        return move

    def next_slot(self) -> Optional[memoryview]:
        """This member's payload view of the next exchange's slot (see :meth:`Arena.next_slot`).

        Writing it before ``exchange(None, ...)`` is safe: this member's slot of that parity was last read by
        the others before they published the previous exchange, which this member saw complete."""
        self._enter()
        k = (self._nat.count if self._nat is not None else self.count) & 1
        return self._data[k][self.index]
