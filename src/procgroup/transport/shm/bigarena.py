"""Big slots: two large buffers per member and group, for the collectives above the arena size (issue 14.1).

Groups with an id below ``BIG_GROUPS`` whose members share this host get,
next to their :class:`~.arena.ShmArena`, a :class:`ShmBigArena` (``arena.big``):
in every member's segment, a header (u64 count, u32 check word) and two
buffers of ``L`` bytes (``Segment.big``; ``PROCGROUP_SHM_BIG_SLOT``).  The
algorithms (``algorithms.bigarena``) write their own buffer, :meth:`sync`,
then read the others' buffers straight from shared memory: no messages, no
matching, no intermediate copies beyond the one into the buffer.

Slots are per group, not per transport: two groups may run collectives at
the same time from different threads, and a slot shared between them would
need a cross-process lock held across whole calls.  Per-group slots cost
``2 L`` of /dev/shm per group (tmpfs pages are reserved at formation), hence
only the first ``BIG_GROUPS`` groups get them.

A sync publishes ``count + 1`` (check word first, then the count: TSO keeps
the order), fences, and waits until every member's count reaches it.  A
member's count equal to it must come with this call's check word; a count
past it means the member passed this step, which it can only do after
seeing ours with its own check (in a sync or a settle, below), so it agreed.
Members whose calls differ (another op, size, sequence number: the check
word) never pass a sync together, and the watchdog names the mismatch.
Waits poll (yielding the CPU at every poll on an oversubscribed host), then
sleep on the doorbell like the arena's, checking abort, close, peer death
and the deadline at every slice; whoever publishes a step that completes its
own wait rings the members whose sleep flag is up (the last member to
publish a step always does).

**One-way steps.**  A reduce's non-root only writes: it publishes its part
(``sync(wait=WAIT_NONE)``) and goes on, and the root alone waits for every
member.  Such a member has not seen the others at that step (``pending``),
so before it writes a buffer or publishes again it *settles*: it waits, as a
full sync would have, until every count has reached that step with its check
word or passed it.  That keeps the two rules a full sync gives: a member
writes buffer ``t & 1`` at step t only once everyone published step t - 1,
i.e. finished reading step t - 2, the last use of that buffer; and the single
check word a member overwrites at step t + 1 was seen by everyone at step t
(a member past step t agreed with it).  The non-roots of a reduce thus never
wait for the root's reduction, and the root waits for nobody's return.  A
mismatch that no wait of its step saw (every member a non-root: each named
another root) stops the group at any member's next big-slot call, whose
settle never completes and the watchdog names it; a mismatch with a root
stops at that root's wait.

Compiled path (``_native.Big``, where the arena's extension was built and
``PROCGROUP_NATIVE`` is not 0): a sync publishes, fences and polls in one C
call with the GIL released (the same protocol, so ranks on either path meet);
:meth:`ShmBigArena.sync_reduce` adds the copy in and the reduction in member
order (all_reduce/reduce in one sync: ``algorithms.bigarena.DIRECT_MAX``), :meth:`ShmBigArena.sync_copy`
the copy in and out of a broadcast or all_gather step, and
:meth:`ShmBigArena.reduce_into` the split path's slice reduction.  The sleep
loop stays in Python on both paths.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ...deadline import Deadline
from ...errors import ClosedError
from ..base import WAIT_ALL, WAIT_NONE, BigArena
from .arena import ArenaHost, native_available, poll, sleep_until
from .layout import ARENA_HDR, OFF_SLEEP, Segment, fence

try:
    from . import _native
except ImportError:  # not built: the pure-Python syncs (arena.py logs it once)
    _native = None  # type: ignore[assignment]

__all__ = ["ShmBigArena"]


class ShmBigArena(BigArena):
    """The big slots of group ``key`` in the segments ``segs`` of ``members`` (member order).

    ``big``: bytes per buffer (the least of the members' ``Segment.big``); ``spin``, ``oversubscribed``,
    ``slice_s``: as for :class:`~.arena.ShmArena`.
    """

    def __init__(
        self,
        t: ArenaHost,
        key: int,
        members: List[int],
        segs: List[Segment],
        big: int,
        *,
        spin: float,
        oversubscribed: bool,
        slice_s: float,
        native: bool = True,
    ) -> None:
        self.t = t
        self.members = members
        self.index = members.index(t.rank)
        self.slot_bytes = big
        self._spin = spin
        self._oversubscribed = oversubscribed
        self._slice = slice_s
        self._segs = segs
        offs = [seg.big_off + key * (ARENA_HDR + 2 * seg.big) for seg in segs]
        # per member: (u64 view, index of the count) and (u32 view, index of the check word)
        self._count_at = [(seg.q, off // 8) for seg, off in zip(segs, offs)]
        self._check_at = [(seg.i, off // 4 + 2) for seg, off in zip(segs, offs)]
        self.arrays: List[List[Any]] = [
            [np.frombuffer(seg.mm, np.uint8, big, off + ARENA_HDR + k * seg.big) for seg, off in zip(segs, offs)]
            for k in (0, 1)
        ]
        self._others = [seg for i, seg in enumerate(segs) if i != self.index]
        self.turn = 0
        self.count = self._count_at[self.index][0][self._count_at[self.index][1]]  # 0 in a fresh segment
        self._check = 0
        #: our last one-way step that not every member was seen to reach: (its count, its check word), or None
        self.pending: Optional[Tuple[int, int]] = None
        self._nat: Any = None
        if native and native_available():
            self._nat = _native.Big(
                [seg.mm for seg in segs],
                offs,
                [off + ARENA_HDR for off in offs],
                [off + ARENA_HDR + seg.big for seg, off in zip(segs, offs)],
                self.index,
                big,
                OFF_SLEEP,
                int(spin * 1e9),
                oversubscribed,
            )

    @property
    def native(self) -> bool:
        """True when the syncs run the compiled fast path (``_native.Big``)."""
        return self._nat is not None

    def release(self) -> None:
        """Drop the views into the segments (before they are unmapped)."""
        if self._nat is not None:
            self._nat.release()  # its exports end once no call of ours is inside it
        self.arrays = [[], []]
        self._count_at = []
        self._check_at = []
        self._others = []
        self._segs = []

    def begin(self, check: int, deadline: Optional[Deadline] = None) -> None:
        """Start a call whose syncs carry ``check``: first :meth:`settle` a one-way step of ours."""
        if self.pending is not None:
            self.settle(deadline)
        self._check = check & 0xFFFFFFFF

    def _arrived(self, val: int, check: int) -> bool:
        """Every member's count is ``val`` with ``check``, or past ``val``."""
        for (q, c), (w, k) in zip(self._count_at, self._check_at):
            n = q[c]
            if n < val or (n == val and w[k] != check):
                return False
        return True

    def _missing(self, val: int, check: int) -> List[int]:
        return [
            m
            for m, (q, c), (w, k) in zip(self.members, self._count_at, self._check_at)
            if q[c] < val or (q[c] == val and w[k] != check)
        ]

    def _enter(self) -> None:
        t = self.t
        if t._aborted is not None:
            raise t._aborted
        if t._closed or not self._others:
            raise ClosedError(f"rank {t.rank}: big-slot collective on a closed shm transport")

    def _ring_sleepers(self) -> None:
        ring = self.t.doorbell.ring
        for seg in self._others:
            if seg.i[OFF_SLEEP // 4]:
                ring(seg, force=True)  # its flag is up: a new doorbell value, then FUTEX_WAKE

    def settle(self, deadline: Optional[Deadline]) -> None:
        """Wait until every member has reached or passed our last one-way step with its check word (see the
        module docstring); nothing to do after a full sync.  :meth:`begin` and the syncs call it first."""
        pend = self.pending
        if pend is None:
            return
        self._enter()
        val, check = pend
        nat = self._nat
        if nat is not None:
            if nat.settle(val, check) < 0:
                self._wait(val, check, deadline, nat.arrived)
        elif not self._arrived(val, check):
            self._wait(val, check, deadline)
        self.pending = None

    def sync(self, deadline: Optional[Deadline], wait: int = WAIT_ALL) -> None:
        """Publish the next count and wait for every member's (``wait`` WAIT_ALL), or for nobody's (WAIT_NONE, a
        one-way step; see the module docstring)."""
        if self.pending is not None:
            self.settle(deadline)
        self._enter()
        self.count += 1
        val, check = self.count, self._check
        nat = self._nat
        if nat is not None:  # publish, fence, check and spin in one C call (GIL released)
            r = nat.sync(val, wait, check)
            if r < 0:
                self._wait(val, check, deadline, nat.arrived)
            elif r:
                self._ring_sleepers()
            self._done(val, wait)
            return
        w, k = self._check_at[self.index]
        q, c = self._count_at[self.index]
        w[k] = check
        q[c] = val  # last: publishes what we wrote into our buffer, and the check word
        fence()  # our count before their counts and sleep flags (Dekker, as in ShmArena.exchange)
        if wait == WAIT_NONE or self._arrived(val, check):
            self._ring_sleepers()
        else:
            self._wait(val, check, deadline)
        self._done(val, wait)

    def _done(self, val: int, wait: int) -> None:
        """Step ``val`` of ours completed: a one-way one stays pending until settled."""
        self.pending = None if wait == WAIT_ALL else (val, self._check)

    def sync_reduce(
        self,
        buf: Any,
        k: int,
        op: int,
        dtype: int,
        reduce: bool,
        deadline: Optional[Deadline],
        wait: int = WAIT_ALL,
        publish: bool = True,
    ) -> bool:
        """Copy ``buf`` into this member's buffer ``k``, :meth:`sync` (``wait`` as there), and (``reduce``)
        reduce every member's buffer ``k`` into ``buf`` in member order, in one compiled call (``op``/``dtype``:
        the codes of :data:`~.arena.REDUCE_OPS`/:data:`~.arena.REDUCE_TYPES`).  ``publish`` False: nobody reads
        this member's buffer (a reduce's root), so a reducing member 0 or 1 skips the copy in and reduces its own
        part from ``buf`` (other members copy it in regardless).

        Returns False, having done nothing, where the compiled path is off or ``buf`` is not aligned to its
        element size or larger than a buffer: the caller then copies, syncs and reduces itself.
        """
        nat = self._nat
        if nat is None:
            return False
        if self.pending is not None:
            self.settle(deadline)
        self._enter()
        val = self.count + 1
        publish = publish or not reduce or self.index > 1
        r = nat.sync_reduce(buf, k, val, wait, self._check, op, dtype, reduce, publish)
        if r == -3:
            return False
        self.count = val
        if r < 0:
            self._wait(val, self._check, deadline, nat.arrived)
            if reduce:
                nat.reduce(buf, k, 0, op, dtype, None if publish else buf)
        elif r:
            self._ring_sleepers()
        self._done(val, wait)
        return True

    def put(self, k: int, off: int, data: Any, pieces: bool) -> None:
        """``data`` (a C-contiguous array) into this member's buffer ``k`` at byte ``off``.  Compiled, the copy
        streams past the caches as ``PROCGROUP_SHM_STREAM`` says (``copy_to_shared`` in ``_native.h``: ``pieces``
        where each reader takes its own part of it, not the whole); else a plain copy."""
        nat = self._nat
        if nat is not None:
            nat.put(k, off, data, pieces)
        else:
            super().put(k, off, data, pieces)

    def reduce_into(self, out: Any, k: int, off: int, op: int, dtype: int, own: Any = None) -> bool:
        """``out`` = every member's buffer ``k`` from byte ``off`` on (this member's read from ``own`` where given;
        it may be ``out`` itself), reduced in member order, in compiled code; False where the path is off."""
        nat = self._nat
        if nat is None:
            return False
        nat.reduce(out, k, off, op, dtype, own)
        return True

    def sync_copy(
        self,
        data: Any,
        k: int,
        out: Any,
        src: int,
        off: int,
        stride: int,
        chunk: int,
        deadline: Optional[Deadline],
    ) -> bool:
        """Copy ``data`` (None: nothing) into this member's buffer ``k``, :meth:`sync`, and copy into ``out``
        (None: nothing) the first ``chunk`` bytes of member ``src``'s buffer ``k`` at byte ``off`` (``src`` -1:
        every member ``m``'s at ``off + m * stride``), in one compiled call.  Where this member's part of ``out``
        is ``data`` itself (an all_gather whose input is its block of the output), that part is not copied.

        Returns False, having done nothing, where the compiled path is off or a size does not fit.
        """
        nat = self._nat
        if nat is None:
            return False
        if self.pending is not None:
            self.settle(deadline)
        self._enter()
        val = self.count + 1
        r = nat.sync_copy(data, k, val, WAIT_ALL, self._check, out, src, off, stride, chunk)
        if r == -3:
            return False
        self.count = val
        if r < 0:
            self._wait(val, self._check, deadline, nat.arrived)
            if out is not None:
                nat.copy(out, k, src, off, stride, chunk, data)
        elif r:
            self._ring_sleepers()
        return True

    def _wait(
        self, val: int, check: int, deadline: Optional[Deadline], ready: Optional[Callable[[], bool]] = None
    ) -> None:
        if ready is None:

            def ready() -> bool:
                return self._arrived(val, check)

            # poll, yielding the CPU at every poll on an oversubscribed host (as the rings' waits do): a big-slot
            # step is long enough that the member we wait for is often descheduled on a loaded host, and the
            # yield lets it run (the compiled sync has spun already)
            if self._spin and poll(ready, self._spin, self._oversubscribed):
                return
        sleep_until(
            self.t,
            ready,
            lambda: self._missing(val, check),
            deadline,
            self._slice,
            "big-slot collective",
            self.members,
            lambda: f"sync {val} of this group's big slots",
        )


def big_arena_for(t: Any, key: int, members: List[int], segs: Sequence[Segment], **kw: Any) -> Optional[ShmBigArena]:
    """A :class:`ShmBigArena` when every member's segment has big slots (None otherwise)."""
    big = min(seg.big for seg in segs)
    if not big:
        return None
    return ShmBigArena(t, key, members, list(segs), big, **kw)
