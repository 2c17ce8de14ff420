"""One-way queue: small broadcasts and reduces that do not synchronise every member (issue 14).

An arena exchange (:mod:`.arena`) is a full synchronisation: every member publishes and waits for all.  With
more local ranks than CPUs every call then needs every member scheduled.  A broadcast needs only root -> readers
and a reduce only non-roots -> root, so each arena group also has a queue of ``QUEUE_DEPTH`` (K) entries per
member (layout: :mod:`.layout`, region Q).  The group's one-way calls are numbered n = 1, 2, ... on every member
(``ShmQueue.n``), and call n uses entry n % K of whoever writes:

* broadcast: the root writes its payload, the check word and the seq n into its own entry and returns; a
  non-root waits for the root's entry to show n with its own check word, copies, and completes;
* reduce: a non-root writes its entry and returns; the root waits for every other member's entry of call n
  (with its check word), reduces them in member order (its own data in its place; the compiled path reduces
  SUM/PRODUCT/MIN/MAX of float32/float64/int32/int64 as numpy does, bit for bit), and completes.

Completing call n means writing n into one's *done* word (control line, u64).  **Flow control**: a member writes
its entry of call n only once every member's done word is >= n - K, so nobody still reads the entry it
overwrites (entry n % K last held call n - K at the latest).  A root thus runs up to K calls ahead of the slowest
reader, which drains them in a burst when it runs.  Every member completes call n once every member has
started it (a writer's flow condition only looks K calls back), so the queue cannot deadlock.

**Check words and the chain.**  Each member keeps ``chain``, a fold (``mix``) of the check words (the low 32 bits
of the group tag: seq and fingerprint) of the one-way calls it completed; an entry carries ``mix(chain, check)``
of its writer, and a waiter compares it with its own.  A member whose call differs in op, root, dtype or count,
or whose earlier one-way calls differed, never takes the data: it waits, and the watchdog names the mismatch
(same seq in flight with another call, or the call histories' chains diverging) on the ranks involved.  The chain
is also xor'ed into the check word of every arena exchange of the group (all_reduce, barrier, all_gather,
all_to_all, ...), so a mismatch that no one-way wait saw -- two members that both declared themselves the root
of a broadcast, both wrote and returned -- stops the group at its next arena exchange or one-way wait, where the
watchdog names it.  When is each kind detected: a reader or reduce root with another call than its source(s):
in that call (it waits); a root or reduce non-root with another call than the others: at the others' wait of
that call, else (two self-declared roots) at the next arena exchange or one-way wait of the group, else at the
latest at this member's flow wait K calls later; a member that called an arena exchange instead: in that
exchange.  The message paths and the big slots carry no chain: a mismatch followed only by those is named by
the watchdog's periodic comparison of call histories.

**Interleaving invariant.**  The queue region is disjoint from the arena slots and the big slots, and the queue
never reads or writes an arena slot: the arena's parity rule ("my slot of this parity was last read before
the others published the previous exchange, which I saw complete") holds unchanged, including for all_to_all
writing its slot in place (``next_slot``).  Queue entries are written only under flow control, and only read
by the members of that one-way call.  An arena exchange completes only once every member published it, i.e.
every member finished all its earlier calls of the group; so one-way calls never overlap an exchange on the
same member, and a root's lead is bounded by K and by the next exchange.  Groups have disjoint queues (indexed
by group id, first incarnation only, as the arena).

Waits spin (yielding the CPU at every poll on an oversubscribed host) and then sleep on the doorbell with the
arena's sleep loop (:func:`.arena.sleep_until`: deadline, dead peers, abort, close).  Wakes: a broadcast root's
write rings every member whose sleep flag is up; a reduce non-root's rings the root's; a done word rings the
members waiting for done words (their *want* word nonzero, written before their sleep flag).  Dekker as for the
arena: the writer stores, fences, then reads the flags; the sleeper raises its flag, fences, then re-checks.

The compiled path (``_native.Slots.q_*``, GIL released while spinning) and this module's Python path share the
layout and the chain, so members on either path interoperate.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from ...deadline import Deadline
from ...errors import ConfigError
from .arena import ShmArena, poll, sleep_until
from .layout import (
    ARENA_HDR,
    OFF_BELL,
    OFF_SLEEP,
    QUEUE_BYTES,
    QUEUE_CTL,
    QUEUE_DEPTH,
    QUEUE_ENTRY,
    QUEUE_GROUP,
    Segment,
    fence,
)

__all__ = ["ShmQueue", "mix"]

_MASK = 0xFFFFFFFF


def _too_large(nbytes: int) -> ConfigError:
    """The error of a one-way call of ``nbytes``, more than an entry holds (the plans never make one)."""
    return ConfigError(f"one-way call of {nbytes} bytes exceeds the queue's {QUEUE_BYTES}")


def mix(chain: int, check: int) -> int:
    """The chain after a one-way call with check word ``check`` (the compiled path's ``q_mix``)."""
    return ((chain ^ check) * 16777619) & _MASK


def _seq(n: int) -> int:
    return (n - 1) % 0xFFFFFFFF + 1  # never 0 (0: never written)


class ShmQueue:
    """The one-way queue of the arena ``arena``'s group (``key``) in the members' segments ``segs``.

    ``post``/``read``/``gather``+``ack``/``gather_reduce`` run one one-way call each (see the module docstring);
    they raise as :meth:`ShmArena.exchange` does (ClosedError, the abort error, PeerFailureError,
    DistTimeoutError) and ConfigError for a payload over ``max_bytes``.
    """

    def __init__(self, arena: ShmArena, key: int, segs: List[Segment]) -> None:
        self.arena = arena
        self.t = arena.t
        self.members = arena.members
        self.index = arena.index
        self.max_bytes = QUEUE_BYTES
        offs = [seg.queue_off + key * QUEUE_GROUP for seg in segs]
        self._segs = segs
        self._ctl = [(seg.q, off // 8) for seg, off in zip(segs, offs)]  # done at [c], want at [c + 1]
        ent = [[off + QUEUE_CTL + e * QUEUE_ENTRY for e in range(QUEUE_DEPTH)] for off in offs]
        self._hdr = [[(seg.i, o // 4) for o in es] for seg, es in zip(segs, ent)]
        self._data = [[memoryview(seg.mm)[o + ARENA_HDR :][:QUEUE_BYTES] for o in es] for seg, es in zip(segs, ent)]
        #: Python path: one-way calls completed, and the chain (the compiled path keeps both in ``nat``)
        self.n = 0
        self.chain = 0
        self._held = False
        self.nat: Any = arena._nat
        if self.nat is not None:
            self.nat.queue_init(offs, QUEUE_DEPTH, QUEUE_ENTRY, QUEUE_BYTES, OFF_BELL)

    @property
    def native(self) -> bool:
        """True when the compiled path runs this queue."""
        return self.nat is not None

    @property
    def calls(self) -> int:
        """One-way calls completed so far."""
        return int(self.nat.qn) if self.nat is not None else self.n

    def release(self) -> None:
        """Drop the views into the segments (the arena releases the compiled object)."""
        for views in self._data:
            for v in views:
                v.release()
        self._data = []
        self._hdr = []
        self._ctl = []
        self._segs = []

    def enter(self) -> None:
        """Raise the transport's abort error, or ClosedError when it closed (see ``ShmArena._enter``)."""
        self.arena._enter()

    # -- the compiled path's waits: the C call spun and returned -1 (nothing done); sleep, then call again ----
    def _sleep_nat(self, deadline: Optional[Deadline]) -> None:
        nat, members = self.nat, self.members
        self._sleep(nat.q_ready, lambda: [members[i] for i in nat.q_missing()], deadline)

    def _until_done(self, call: Any, buf: Any, check: int, peer: int, deadline: Optional[Deadline]) -> None:
        """Call the compiled ``call(buf, check, peer)`` (q_post / q_read) until it returns 0, sleeping between."""
        while True:
            r = call(buf, check, peer)
            if r == 0:
                return
            if r == -2:
                raise _too_large(memoryview(buf).nbytes)
            self._sleep_nat(deadline)

    def post_wait(self, data: Any, check: int, target: int, deadline: Optional[Deadline]) -> None:
        """Finish a compiled ``q_post`` that returned nonzero (see :meth:`post`)."""
        self._until_done(self.nat.q_post, data, check, target, deadline)

    def read_wait(self, out: Any, check: int, src: int, deadline: Optional[Deadline]) -> None:
        """Finish a compiled ``q_read`` that returned nonzero (see :meth:`read`)."""
        self._until_done(self.nat.q_read, out, check, src, deadline)

    def _gather_nat(self, buf: Any, check: int, op: int, dtype: int, reduce: bool, deadline: Optional[Deadline]) -> int:
        while True:
            r = int(self.nat.q_gather(buf, check, op, dtype, reduce))
            if r != -1:
                if r == -2:
                    raise _too_large(memoryview(buf).nbytes)
                return r
            self._sleep_nat(deadline)

    # -- one call each, either path -------------------------------------------------------------------------
    def post(self, data: Any, check: int, target: int, deadline: Optional[Deadline]) -> None:
        """Write ``data`` as this member's entry of the next one-way call and complete it (a broadcast's root:
        ``target`` is this member; a reduce's non-root: ``target`` is the root's index)."""
        self.enter()
        if self.nat is not None:
            if self.nat.q_post(data, check, target):
                self.post_wait(data, check, target, deadline)
            return
        view = memoryview(data).cast("B")
        if view.nbytes > QUEUE_BYTES:
            raise _too_large(view.nbytes)
        n = self.n + 1
        me = self.index
        q, c = self._ctl[me]
        if n > QUEUE_DEPTH:
            need = n - QUEUE_DEPTH
            ctl = self._ctl

            def flow() -> bool:
                return all(w[i] >= need for w, i in ctl) and bool(ctl)

            if not flow():
                q[c + 1] = need  # want: members completing calls ring us (before our sleep flag goes up)
                try:
                    self._wait(flow, lambda: [k for k, (w, i) in enumerate(ctl) if w[i] < need], deadline)
                finally:
                    if self._ctl:
                        q[c + 1] = 0
        e = n % QUEUE_DEPTH
        if view.nbytes:
            self._data[me][e][: view.nbytes] = view
        c2 = mix(self.chain, check)
        w, i = self._hdr[me][e]
        w[i + 1] = c2
        w[i] = _seq(n)  # last: publishes payload and check word (stores stay in order on x86)
        self.chain, self.n = c2, n
        q[c] = n
        fence()  # our entry and done word before their sleep flags (Dekker with the sleepers)
        self._wake(-1 if target == me else target)

    def read(self, out: Any, check: int, src: int, deadline: Optional[Deadline]) -> None:
        """Copy member ``src``'s entry of the next one-way call (its first ``out.nbytes`` bytes) into ``out`` once
        it shows that call and our check word, and complete the call (a broadcast's non-root)."""
        self.enter()
        if self.nat is not None:
            if self.nat.q_read(out, check, src):
                self.read_wait(out, check, src, deadline)
            return
        dst = memoryview(out).cast("B")
        if dst.nbytes > QUEUE_BYTES:
            raise _too_large(dst.nbytes)
        n = self.n + 1
        e = n % QUEUE_DEPTH
        c2, val = mix(self.chain, check), _seq(n)
        w, i = self._hdr[src][e]

        def ready() -> bool:
            return bool(w[i] == val and w[i + 1] == c2)

        if not ready():
            self._wait(ready, lambda: [] if ready() else [src], deadline)
        if dst.nbytes:
            dst[:] = self._data[src][e][: dst.nbytes]
        self.chain, self.n = c2, n
        self._complete()

    def gather(self, check: int, deadline: Optional[Deadline]) -> List[Optional[memoryview]]:
        """Wait for every other member's entry of the next one-way call (with our check word); returns their
        payload views in member order (None for this member).  They stay valid until :meth:`ack`, which the
        caller must call when done with them (a reduce's root reducing in Python)."""
        self.enter()
        if self.nat is not None:
            self._gather_nat(b"", check, 0, 0, False, deadline)
            e = self.nat.qn % QUEUE_DEPTH
        else:
            n = self.n + 1
            e = n % QUEUE_DEPTH
            c2, val = mix(self.chain, check), _seq(n)
            me, hdr = self.index, self._hdr

            def there(k: int) -> bool:
                w, i = hdr[k][e]
                return bool(w[i] == val and w[i + 1] == c2)

            def missing() -> List[int]:
                return [k for k in range(len(hdr)) if k != me and not there(k)]

            if missing():
                self._wait(lambda: bool(hdr) and not missing(), missing, deadline)
            self.chain, self.n = c2, n
            self._held = True
        return [None if k == self.index else v[e] for k, v in enumerate(self._data)]

    def ack(self) -> None:
        """Complete the call whose entries :meth:`gather` returned."""
        if self.nat is not None:
            self.nat.q_ack()
        elif self._held:
            self._held = False
            self._complete()

    def gather_reduce(self, buf: Any, op: int, dtype: int, check: int, deadline: Optional[Deadline]) -> bool:
        """:meth:`gather`, reduce every member's data into ``buf`` in member order (``buf``: this member's) and
        complete, in compiled code (``op``/``dtype``: codes of ``arena.REDUCE_OPS``/``REDUCE_TYPES``).  False,
        having done nothing, where the compiled path is off or ``buf`` is not aligned to its element size."""
        if self.nat is None:
            return False
        self.enter()
        return self._gather_nat(buf, check, op, dtype, True, deadline) == 0

    # -- Python path helpers ----------------------------------------------------------------------------------
    def _complete(self) -> None:
        q, c = self._ctl[self.index]
        q[c] = self.n
        fence()
        self._wake(-2)

    def _wake(self, target: int) -> None:
        """Ring the members asleep that may wait for what we just published: ``target`` (-1: every member) and
        those waiting for done words."""
        ring = self.t.doorbell.ring
        me = self.index
        for k, seg in enumerate(self._segs):
            if k != me and seg.i[OFF_SLEEP // 4]:
                w, c = self._ctl[k]
                if target == -1 or k == target or w[c + 1]:
                    ring(seg, force=True)

    def _wait(self, ready: Callable[[], bool], missing: Callable[[], List[int]], deadline: Optional[Deadline]) -> None:
        a = self.arena
        if a._spin and poll(ready, a._spin, a._oversubscribed):
            return
        members = self.members
        self._sleep(ready, lambda: [members[k] for k in missing()], deadline)

    def _sleep(self, ready: Callable[[], bool], missing: Callable[[], List[int]], deadline: Optional[Deadline]) -> None:
        sleep_until(
            self.t,
            ready,
            missing,
            deadline,
            self.arena._slice,
            "one-way shared-slot call",
            self.members,
            lambda: f"one-way call {self.calls + 1} of this group's queue",
        )

    def views(self) -> Sequence[Sequence[memoryview]]:
        """Every member's entry payload views (member order, then entry index): for tests and diagnostics."""
        return self._data
