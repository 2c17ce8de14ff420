"""ProcessGroup: ranks, subgroups, sequence numbers, deadlines, async work, error context.

A :class:`World` is the per-process state of one ``init_process_group``: the
store, the transport, every rank's host.  A :class:`ProcessGroup` is an
ordered subset of the world's ranks with its own id (agreed through the
store, so it is the same on every member) and its own sequence counter.

Tags and fingerprints: :mod:`procgroup.tags`.

Flight recorder.  Each group keeps its last ``FLIGHT_RECORDS`` collectives
(seq, op, signature, start, end, state) for hang reports and SIGUSR1 dumps.

Threads.  One thread at a time may be inside a call of a group: a second thread's call raises
:class:`~procgroup.errors.ConcurrentUseError` (naming both threads) before it takes a sequence
number.  In groups of procgroup's own API, a call from a thread other than the group's home
thread (the caller of init_process_group or new_group) adds that thread's name to its
signature, so calls of differently named threads never pair up across ranks (the watchdog
reports a mismatch instead of a mixed-up sum): name the threads that run collectives alike on
every rank.  Groups made through backends.create_group (the torch plug-in, Ray) have no home
thread: torch and Ray call from threads of their own, and order their calls themselves.

Async work.  ``async_op=True`` runs the collective on the group's single
worker thread (ops of one group run in call order); a blocking op first
waits for the group's outstanding async work, so program order is kept.
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import queue
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .algorithms.comm import STEP_BITS, Comm, ScratchPool
from .config import SafeObjects, safe_objects
from .deadline import Deadline, wait_seconds
from .errors import (
    BrokenError,
    ClosedError,
    CollectiveMismatchError,
    ConcurrentUseError,
    ConfigError,
    DistTimeoutError,
    ForkedProcessError,
    GroupBrokenError,
    PeerFailureError,
    ProcGroupError,
    describe,
)
from .flight import FLIGHT_RECORDS, FlightRecord, as_record, describe_signature
from .groupcore import COMPILED, GroupCore
from .tags import (  # noqa: F401 - re-exported: their home was this module
    FP_MASK,
    GID_LIMIT,
    P2P_CODE_MASK,
    P2P_CODE_SHIFT,
    P2P_TAG_LIMIT,
    SEQ_MASK,
    collective_tag,
    dtype_code,
    dtype_of_code,
    fingerprint,
    p2p_tag,
)
from .transport.base import Request, Transport
from .watchdog import (
    GroupStatus,
    describe_roll_call,
    first_failure,
    record_broken,
    recorded_abort,
    roll_call,
    rolled_state,
)
from .work import BREAKING, P2PWork, Work, wait_now

__all__ = [
    "World",
    "abort_world",
    "ProcessGroup",
    "Work",
    "SLOW",
    "GID_LIMIT",
    "P2P_TAG_LIMIT",
    "P2P_CODE_MASK",
    "p2p_tag",
    "dtype_code",
]

CHAIN_WINDOW = 4096
_get_ident = threading.get_ident
_monotonic = time.monotonic
_crc32 = zlib.crc32
#: what :meth:`ProcessGroup.run_plan` returns when the call must take :meth:`ProcessGroup.run` instead
SLOW = object()


#: every live group of this process (the fork hook and the world's broken mark reach them all)
_LIVE: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


@dataclass(frozen=True)
class Failure:
    """The error that broke a group: what failed, when, and how (kept for the errors of every later call)."""

    op: str
    seq: Optional[int]
    group: str
    error: str  # the exception's type name
    text: str  # its message
    wall: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        """'all_reduce (seq 6514) in group WORLD failed 3.2s ago (at 01:02:03 UTC) with DistTimeoutError: ...'."""
        at = time.strftime("%H:%M:%S UTC", time.gmtime(self.wall))
        seq = f" (seq {self.seq})" if self.seq is not None else ""
        head = self.text.split(". Roll call")[0]
        return (
            f"{self.op}{seq} in group {self.group} failed {time.monotonic() - self.mono:.1f}s ago "
            f"(at {at}) with {self.error}: {head}"
        )


@dataclass
class World:
    """Per-process state shared by every group of one init."""

    rank: int
    size: int
    transport: Transport
    store: Any = None  # procgroup.store.Store
    hosts: List[str] = field(default_factory=list)  # host key per global rank (equal => same machine)
    hostnames: List[str] = field(default_factory=list)  # readable host name per global rank
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    backend: str = "cpu"
    timeout: float = 300.0
    #: global rank whose process hosts the store (None: the launcher or a file): if it is unreachable, it died
    store_host: Optional[int] = None
    #: the backend's :class:`~procgroup.backends.base.CollectiveEngine`, asked first by every collective
    #: (None: procgroup's own algorithms over ``transport``)
    engine: Any = None
    on_close: List[Callable[[], None]] = field(default_factory=list)
    #: safe mode of the object collectives, read from the environment once per init (a call's safe= wins)
    safe_objects: SafeObjects = field(default_factory=safe_objects)
    #: set when the default group broke (every group of this world then refuses calls; see ProcessGroup.broken)
    broken: Optional[Failure] = None
    #: the process that formed this world: in a child forked after init it is not ``os.getpid()`` (see forked)
    pid: int = field(default_factory=os.getpid)
    #: planned calls take the compiled bookkeeping (procgroup.groupcore) where it was built (``PROCGROUP_NATIVE``)
    native: bool = True

    def forked(self) -> bool:
        """True in a child forked after init: the world (sockets, shared memory, store) is the parent's."""
        return self.pid != os.getpid()

    def close(self) -> None:
        """Run the on_close callbacks (transport, store connections, watchdog) in reverse order; idempotent.

        In a forked child it only forgets them: closing would shut the parent's connections down."""
        if self.forked():
            self.on_close.clear()
            return
        for fn in reversed(self.on_close):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort during shutdown; errors already reported
                pass
        self.on_close.clear()


_STOP = object()
_UNSET = object()


class ProcessGroup(GroupCore):  # GroupCore: the compiled base or its Python twin (procgroup.groupcore)
    """An ordered set of global ranks that run collectives together.

    The per-call fields (sequence number, chain, flight, token, Comm) live in the base class
    :class:`~procgroup.groupcore.GroupCore`, whose compiled ``run_plan`` takes planned calls where it was built.
    """

    # Rarely set, so class defaults (set on the instance when they change): CPython keeps up to 29 instance
    # attributes inline, more cost ~3 ns per access, ~20 a planned call (tests/unit/test_plans.py counts them)
    #: the async worker's queue and thread (one attribute: made on the first async op), or None
    _async: Optional[Tuple["queue.Queue[Any]", threading.Thread]] = None
    _closed = False
    _host_arena: Any = None  # a group spanning hosts: its members' slots on this host (made with _arena)
    _gen_fp = 0  # the incarnation's fingerprint salt (gen > 0 only)
    broken: Optional[Failure] = None  # the error that broke this group (or its world), once one has
    #: what the watchdog learned out of band (see abort_world): the next call raises it, then the group is broken
    _aborted: Optional[BaseException] = None

    def __init__(
        self,
        world: World,
        ranks: Sequence[int],
        gid: int,
        name: str,
        timeout: Optional[float] = None,
        gen: int = 0,
    ) -> None:
        if not 0 <= gid < GID_LIMIT:
            raise ConfigError(
                f"group id {gid} exceeds the limit of {GID_LIMIT} groups alive at once "
                "(destroy_process_group(group) on every member of groups no longer needed frees their ids)"
            )
        self.world = world
        self.ranks: List[int] = list(ranks)
        self.gid = gid
        # incarnation of a reused id: mixed into collective tags so a destroyed incarnation's stragglers never match
        self.gen = gen
        if gen:
            self._gen_fp = (gen * 40503) & FP_MASK
        self.name = name
        self.timeout = float(timeout if timeout is not None else world.timeout)
        self._rank = self.ranks.index(world.rank) if world.rank in self.ranks else -1
        self._hosts = [world.hosts[g] if world.hosts else "localhost" for g in self.ranks]
        self._seq = 0
        self.last_completed = -1
        #: blocking send/recv: (recv?, peer argument, tag, dtype) -> (peer, transport tag, fast op) (procgroup.p2p)
        self.p2p_routes: Dict[Any, Any] = {}
        #: FlightRecords, and planned calls' compact [seq, plan, start, end] entries (flight.as_record reads both)
        self.flight: "collections.deque[Any]" = collections.deque(maxlen=FLIGHT_RECORDS)
        # rolling hash of every call's fingerprint, in call order: equal on all members while their calls agree
        self._chain = 0
        self.chain: "collections.deque[Tuple[int, int]]" = collections.deque(maxlen=CHAIN_WINDOW)
        self.inflight: Any = None  # the call in flight: its flight recorder entry (None: none)
        self._scratch = ScratchPool()
        self._comm: Optional[Comm] = None  # reused by blocking calls (one at a time: async ones get their own)
        self._plan_dl = Deadline(0.0, 0.0)  # run_plan's, reset per call
        self._comm_busy = False
        self._fast = world.native  # run_plan's compiled path (where built): off with PROCGROUP_NATIVE=0
        self._lock = threading.Lock()
        #: a token that the thread inside a call of this group holds (see run): a second thread finds it gone and
        #: gets ConcurrentUseError.  A list (pop to take, append to give back: each one atomic) rather than a
        #: Lock: ~0.1 us less a call (a planned 4 B call costs 2-3 us)
        self._busy = [True]
        self._owner = 0  # its thread ident (0: none)
        #: the group's home thread: calls from any other thread add its name to their signature.
        #: init_process_group and new_group make their caller the home thread (set_home_thread); a group made
        #: otherwise (backends.create_group: the torch plug-in, Ray) has none (0): torch and Ray call from
        #: threads of their own, whose names differ across ranks, so there only the one-thread check applies
        self._home = 0
        self._pending: List[Work] = []
        self._child_groups = 0  # groups created with this one as parent (for consistent ids)
        self._arena: Any = _UNSET  # the transport's shared slots for this group (None: it has none), made on first use
        #: planned calls (procgroup.plans): what a repeated collective derives once, keyed by the call's shape
        self.plans: Dict[tuple, Any] = {}
        #: why this group refuses every call (None: usable): "closed", "broken", "forked", "aborted" (abort_world);
        #: checked first by every call
        self._halt: Optional[str] = None
        if world.broken is not None:  # (the class default: None)
            self.broken = world.broken
            self._halt = "broken"
        if world.forked():
            self._halt = "forked"
        _LIVE.add(self)

    # -- queries -------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank in the group, -1 when not a member."""
        return self._rank

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    def is_member(self) -> bool:
        """True when this process is one of the group's ranks."""
        return self._rank >= 0

    @property
    def seq(self) -> int:
        """The sequence number the next collective of this group will get."""
        return self._seq

    def group_rank_of(self, global_rank: int) -> int:
        """The group rank of ``global_rank``; ConfigError when it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ConfigError(f"global rank {global_rank} is not in group {self.name} (ranks {self.ranks})") from None

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.name!r}, ranks={self.ranks}, rank={self._rank})"

    # -- running collectives -------------------------------------------------------------
    def _deadline(self, timeout: Optional[float]) -> Deadline:
        """The deadline of a call: ``timeout`` (seconds or a timedelta) from now, else the group's timeout."""
        timeout = wait_seconds(timeout)
        return Deadline.after(self.timeout if timeout is None else timeout)

    def _context(
        self, e: BaseException, op: str, seq: Optional[int], dl: Optional[Deadline], extra: str = ""
    ) -> BaseException:
        """Same exception type, message prefixed with op/seq/rank/group/elapsed and the fix (``dl`` None: a call
        refused before it started, no elapsed time)."""
        if isinstance(e, BrokenError) and self.world.store is not None:
            why = recorded_abort(self.world.store, self.gid)
            if why is not None:  # the peer left because it found a mismatch: that is the cause
                e = CollectiveMismatchError(why)
            elif isinstance(e, PeerFailureError):  # collectives and point-to-point alike
                e = first_failure(self.world.store, e, self.world.store_host)
        head = describe(
            op, seq=seq, rank=self.world.rank, group=self.name, elapsed=None if dl is None else dl.elapsed()
        )
        if extra:
            head += f" [{extra}]"
        msg = f"{head}: Timed out waiting: {e}" if isinstance(e, DistTimeoutError) else f"{head}: {e}"
        if isinstance(e, DistTimeoutError) and seq is not None and self.world.store is not None:
            msg += ". Roll call: " + self._roll_call(seq)
        if isinstance(e, DistTimeoutError) and dl is not None:
            msg += (
                f". The deadline was {dl.timeout:.1f}s: if the other ranks are just slower, raise it with timeout= "
                "(init_process_group or this call) or PROCGROUP_TIMEOUT; "
                "if a rank never reaches this call, fix that rank"
            )
        elif isinstance(e, PeerFailureError):
            msg += ". A peer process died; the launcher's root-cause report shows why"
        new = copy.copy(e)
        new.args = (msg,)
        new.__cause__ = e
        return new

    def _roll_call(self, seq: int) -> str:
        """Which members reached ``seq`` and where the others are (through the store; best effort, bounded).

        This rank's own entry is its live state, not what its watchdog last published."""
        try:
            st = self.status()
            states = roll_call(self.world.store, st)
            states[self.world.rank] = dict(rolled_state(st), t=time.time())
            return describe_roll_call(st, states, seq)
        except Exception as e:  # noqa: BLE001 - the timeout error matters more than the report
            return f"unavailable ({e})"

    # -- refusing calls: destroyed, broken ----------------------------------------------------------
    def halted(self, op: str) -> BaseException:
        """The error a call ``op`` gets on a group that refuses calls (see ``_halt``)."""
        if self._halt == "forked":
            return ForkedProcessError(forked_message(op, self.world.pid))
        if self._halt == "aborted":  # see abort_world
            self._halt = "broken"
            if self.broken is None and self._aborted is not None:  # the first call since: the cause, in context
                err = self._context(self._aborted, op, None, None, "refused before it started")
                self.mark_broken(err, op, None)  # every later call: GroupBrokenError naming it
                return err
        if self._halt == "broken" and self.broken is not None:
            return GroupBrokenError(
                f"{op} on rank {self.world.rank} in group {self.name}: the group is broken since "
                f"{self.broken.describe()}. Its members are out of step, so every later call would hang or mix "
                "up data: call destroy_process_group() and init_process_group() again, or restart the job"
            )
        return ClosedError(f"{op}: process group {self.name} was destroyed")

    def mark_broken(self, e: BaseException, op: str, seq: Optional[int]) -> None:
        """Refuse every later call after ``e`` (a deadline, a dead peer, a mismatch); the default group's
        failure breaks its whole world.  A deadline is also recorded in the store, so that a member that is
        still waiting (stopped, or slow) fails within a watchdog interval instead of at its own deadline."""
        if self.broken is not None:
            return
        f = Failure(op, seq, self.name, type(e).__name__, str(e))
        groups = [self]
        if self.gid == 0:
            self.world.broken = f
            groups = [g for g in list(_LIVE) if g.world is self.world]
        for g in groups:
            if g.broken is None:
                g.broken = f
            if g._halt is None:  # an "aborted" group raises its cause first, then is broken
                g._halt = "broken"
        if isinstance(e, DistTimeoutError) and self.world.store is not None:
            record_broken(self.world.store, self.gid, f.describe())

    def _drain_async(self) -> None:
        while self._pending:
            w = self._pending[0]
            try:
                w.wait()
            except BaseException:  # noqa: BLE001 - reported through that Work; the blocking op proceeds
                pass
            if self._pending and self._pending[0] is w:
                self._pending.pop(0)

    def run(
        self,
        op: str,
        fn: Callable[[Comm], Any],
        *,
        timeout: Optional[float] = None,
        async_op: bool = False,
        signature: tuple = (),
    ) -> Any:
        """Run ``fn(comm)`` as collective ``op``; returns its result, or a Work when ``async_op``.

        ``signature``: what every member must agree on, e.g. ``("all_reduce", "float32", 4, "SUM")``.
        Raises :class:`ClosedError` after :meth:`close`; errors of ``fn`` get the op's context (see
        :meth:`_context`).  A blocking call first waits for the group's outstanding async work.
        """
        if self._halt is not None:
            raise self.halted(op)
        me = _get_ident()
        try:  # one thread at a time (a nested call of the same thread is let through)
            self._busy.pop()
        except IndexError:
            nested = True
        else:
            self._owner = me
            nested = False
        if nested and self._owner != me:
            raise self._concurrent(op, me)  # before a seq is taken: the group stays in step
        try:
            sig = signature or (op,)
            if self._home and me != self._home:  # so calls of differently named threads never match across ranks
                sig = sig + (f"thread={threading.current_thread().name}",)
            fp = fingerprint(sig)
            with self._lock:
                seq = self._seq
                self._seq += 1
                self._chain = zlib.crc32(fp.to_bytes(2, "little"), self._chain)
                self.chain.append((seq, self._chain))
                mine = False
                if not async_op and not self._comm_busy:
                    self._comm_busy = mine = True  # reuse the group's Comm (a nested call builds its own)
            tag = collective_tag(self.gid, seq, fp ^ self._gen_fp)
            if not async_op:
                try:
                    if self._pending:
                        self._drain_async()
                    return self._execute(fn, op, sig, seq, tag, timeout, mine)
                finally:
                    if mine:
                        self._comm_busy = False
            work = Work(op, self)
            self._pending = [w for w in self._pending if not w.is_completed()]
            self._pending.append(work)
            self._submit(work, functools.partial(self._execute, fn, op, sig, seq, tag, timeout, False))
            return work
        finally:
            if not nested:
                self._owner = 0  # cleared before the release: a thread that finds its own id here is nested
                self._busy.append(True)

    def set_home_thread(self) -> None:
        """Make the calling thread this group's home thread (see the module's notes on threads)."""
        self._home = _get_ident()

    def _concurrent(self, op: str, me: int) -> ConcurrentUseError:
        """The error of ``op`` called by thread ``me`` while another thread is inside a call of this group."""
        names = {t.ident: t.name for t in threading.enumerate()}
        owner = self._owner or self._home  # run_plan leaves it 0 in the home thread (the only one it admits then)
        rec = self.inflight  # the owner's call (None: it is still waiting for the group's async work)
        if rec is not None:
            rec = as_record(rec)
        busy, seq = (rec.op, rec.seq) if rec is not None else ("a call", self._seq - 1)
        other = f"thread {names.get(owner, '?')!r} (ident {owner})" if owner else "another thread"
        return ConcurrentUseError(
            f"{op} on rank {self.world.rank} in group {self.name} from thread {names.get(me, '?')!r} (ident {me}), "
            f"while {other} is inside {busy} (seq {seq}) on the same group. A group serves one thread at a "
            "time: its members pair calls by sequence number, so two threads would mix their data. This call "
            "was refused before taking a sequence number (the group is still in step). Give each thread a "
            "group of its own (new_group), or serialize the calls with a lock"
        )

    def _execute(
        self, fn: Callable[[Comm], Any], op: str, sig: tuple, seq: int, tag: int, timeout: Optional[float], reuse: bool
    ) -> Any:
        """Run one collective now: its deadline, flight record and Comm (the group's own when ``reuse``).

        Keeps the flight record and the group's progress; a ProcGroupError gets the op's context.
        """
        if timeout is None:
            now = time.monotonic()
            dl = Deadline(now + self.timeout, now)
        else:
            dl = self._deadline(timeout)
            now = dl.start
        rec = FlightRecord(seq, op, sig, now)
        self.flight.append(rec)
        self.inflight = rec
        comm = self._comm if reuse else None
        if comm is None:
            arena, t = self.arena(), self.world.transport
            comm = Comm(t, self.ranks, self._rank, tag, dl, self._hosts, self._scratch, arena, self._host_arena)
            if reuse:
                self._comm = comm
        else:
            comm.tag = tag << STEP_BITS
            comm.deadline = dl
        try:
            result = fn(comm)
        except ProcGroupError as e:
            raise self._failed(rec, e, op, seq, dl, sig)  # noqa: B904 - _context sets __cause__ itself
        except BaseException:
            rec.state, rec.end = "failed", time.monotonic()
            self.inflight = None
            raise
        rec.state, rec.end = "completed", time.monotonic()
        self.last_completed = seq
        self.inflight = None
        return result

    def _failed(
        self, rec: FlightRecord, e: ProcGroupError, op: str, seq: int, dl: Deadline, sig: tuple
    ) -> BaseException:
        """Record the failure of call ``seq`` and return its error in context (breaking the group when it must)."""
        rec.state, rec.end = "failed", time.monotonic()
        err = self._context(e, op, seq, dl, describe_signature(sig))  # the roll call shows this rank in seq
        self.inflight = None
        if isinstance(err, BREAKING):
            self.mark_broken(err, op, seq)
        return err

    def _run_plan_py(self, plan: Any, a: Any = None, b: Any = None) -> Any:
        """Run a planned blocking collective (:class:`procgroup.plans.Plan`) with the call's arrays ``a``, ``b``.

        The lean twin of :meth:`run` + :meth:`_execute` for a call that the plan already resolved: the same
        guards (halted, one thread at a time), sequence number, fingerprint chain, flight record, deadline
        and tag, hence the same check word and the same errors.  Returns :data:`SLOW` without taking a
        sequence number when the call needs :meth:`run`'s general path: another thread is inside a call (run
        raises ConcurrentUseError), a nested call, async work outstanding, or a thread other than the home one
        (its name joins the signature).
        """
        if self._halt is not None:
            raise self.halted(plan.op)
        me = _get_ident()
        home = self._home
        if self._pending or (home and me != home):
            return SLOW
        try:
            self._busy.pop()
        except IndexError:
            return SLOW
        if not home:
            self._owner = me  # with a home thread, only it gets here: _concurrent names it when _owner is 0
        try:
            # the engine's split (Plan.post/done): start the operation first, so that the bookkeeping below
            # runs while it is in flight; post never waits (the wait is done's, under the deadline set below)
            post = plan.post
            req = err = None
            if post is not None:
                try:
                    req = post(a, b)
                except ProcGroupError as e:
                    err = e  # raised below, once the call has its sequence number and flight record
            seq = self._seq
            self._seq = seq + 1
            self._chain = chain = _crc32(plan.fpb, self._chain)
            self.chain.append((seq, chain))
            now = _monotonic()
            # one Deadline per group, reset per planned call (a new one costs ~0.3 us): planned calls of a group
            # run one at a time (the lock above) and nothing keeps a call's deadline past its return
            dl = self._plan_dl
            dl.at = now + self.timeout
            dl.start = now
            rec = [seq, plan, now, None]  # flight.as_record: a FlightRecord costs ~0.2 us a call more
            self.flight.append(rec)
            self.inflight = rec
            try:
                if req is not None:  # the posted operation needs only the deadline: no Comm, no tag
                    # its first polls inline (done, a call, only if they fail): MPI's schedules take 1-3 of them
                    try:  # req.Test() each time: ~20 ns less a call than a bound method's
                        quick = req.Test() or req.Test() or req.Test()
                    except Exception as e:  # noqa: BLE001 - the engine's own error (MPI's): fail() converts it
                        raise plan.fail(e) from None
                    rec[3] = now if quick or not plan.done(dl, req) else _monotonic()  # quick: no clock read
                elif err is not None:
                    raise err
                elif plan.direct:  # fn(a, check word, deadline): no Comm (Comm.check_word of the one it would get)
                    plan.fn(a, ((seq & SEQ_MASK) << 16) | plan.fpx, dl)
                    rec[3] = _monotonic()  # completed
                else:
                    tag = (self.gid << 32) | ((seq & SEQ_MASK) << 16) | plan.fpx
                    comm = self._comm
                    if comm is None or self._comm_busy:
                        comm = Comm(
                            self.world.transport,
                            self.ranks,
                            self._rank,
                            tag,
                            dl,
                            self._hosts,
                            self._scratch,
                            self.arena(),
                            self._host_arena,
                        )
                        if self._comm is None:
                            self._comm = comm
                    else:
                        comm.tag = tag << STEP_BITS
                        comm.deadline = dl
                    plan.fn(comm, a, b)
                    rec[3] = _monotonic()  # completed
            except BaseException as e:
                raise self._plan_failed(e, rec, plan, seq)  # noqa: B904 - _context sets __cause__; others: e itself
            self.last_completed = seq
            self.inflight = None
            return None
        finally:
            if not home:
                self._owner = 0
            self._busy.append(True)

    if not COMPILED:  # else GroupCore.run_plan (compiled) does the common case and hands every other to _run_plan_py
        run_plan = _run_plan_py

    def _plan_failed(self, e: BaseException, entry: list, plan: Any, seq: int) -> BaseException:
        """What a planned call ``seq`` raises when its work raised ``e`` (both run_plan paths): a procgroup error in
        the op's context (breaking the group where it must), any other ``e`` itself; its flight entry failed."""
        if isinstance(e, ProcGroupError):
            return self._failed(self._solid(entry), e, plan.op, seq, self._plan_dl, plan.sig)
        solid = self._solid(entry)
        solid.state, solid.end = "failed", _monotonic()
        self.inflight = None
        return e

    def _solid(self, entry: list) -> FlightRecord:
        """A planned call's compact flight entry as a FlightRecord, put in its place (to record a failure)."""
        rec = as_record(entry)
        fl = self.flight
        if fl and fl[-1] is entry:
            fl[-1] = rec
        return rec

    def status(self) -> GroupStatus:
        """A snapshot of this group's progress for the watchdog and the roll call (copies; no locks held)."""
        inflight = self.inflight
        return GroupStatus(
            gid=self.gid,
            name=self.name,
            ranks=tuple(self.ranks),
            member=self._rank >= 0,
            closed=self._closed,
            inflight=None if inflight is None else as_record(inflight),
            last_completed=self.last_completed,
            chain=tuple(self.chain),
            flight=tuple(as_record(e) for e in tuple(self.flight)),  # tuple(): a snapshot in one C call
        )

    def arena(self) -> Any:
        """The transport's :class:`~procgroup.transport.base.Arena` for this group, or None (asked once).

        Made under the group's lock: the async worker and the caller's thread (a plan being built) may ask at
        the same moment, and two arena objects over the same slots would count calls separately (a hang)."""
        a = self._arena
        if a is _UNSET:
            with self._lock:
                a = self._arena
                if a is _UNSET:
                    one_host = len(set(self._hosts)) == 1  # as the shm transport decides, whatever the transport
                    first = self._rank >= 0 and self.gen == 0  # keyed by gid: first incarnation only
                    a = self._arena = self.world.transport.arena(self.gid, self.ranks) if first and one_host else None
                    if first and not one_host:
                        # a group spanning hosts has no arena of its own, so its key is free on every host: the
                        # members on this host share slots under it (the hierarchical all_reduce's local stages)
                        mine = self._hosts[self._rank]
                        local = [g for g, h in zip(self.ranks, self._hosts) if h == mine]
                        if len(local) > 1:
                            self._host_arena = self.world.transport.arena(self.gid, local, spanning=True)
        return a

    def _submit(self, work: Work, fn: Callable[[], Any]) -> None:
        w = self._async
        if w is None:
            q: "queue.Queue[Any]" = queue.Queue()
            t = threading.Thread(target=self._worker, args=(q,), name=f"procgroup-{self.name}", daemon=True)
            self._async = w = (q, t)
            t.start()
        w[0].put((work, fn))

    def _worker(self, q: "queue.Queue[Any]") -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            work, fn = item
            try:
                work._finish(result=fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                work._finish(exc=e)

    # -- point-to-point ------------------------------------------------------------------
    def p2p(
        self,
        op: str,
        req: Request,
        timeout: Optional[float],
        finish: Callable[[Any], Any],
        ctx: Any,
        probe: Optional[Callable[[], Optional[BaseException]]] = None,
    ) -> P2PWork:
        """A Work over a transport request of a point-to-point op, with the group's deadline and error context.

        ``probe``: asked while a wait lasts (see P2PWork._wait_probing); an error it returns fails the op.
        """
        return P2PWork(op, self, req, self._deadline(timeout), finish, ctx, probe)

    def p2p_now(
        self,
        op: str,
        req: Request,
        timeout: Optional[float],
        finish: Callable[[Any], Any],
        ctx: Any,
        probe: Optional[Callable[[], Optional[BaseException]]] = None,
    ) -> Any:
        """A blocking point-to-point op: as ``p2p(...).wait()`` and its result, without making a Work."""
        return wait_now(self, op, req, self._deadline(timeout), finish, ctx, probe)

    def close(self) -> None:
        """Stop the group's worker thread and release its scratch memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._halt != "forked":
            self._halt = "closed"
        elif self.world.forked():  # the worker thread and the scratch memory are the parent's
            return
        if self._async is not None:
            self._async[0].put(_STOP)
            self._async[1].join(timeout=5.0)
        self._scratch.clear()
        self.plans.clear()
        if self.world.engine is not None and self.gid != 0:  # its id may be reused: the engine must not keep it
            self.world.engine.forget_group(self.gid)


def abort_world(world: World, exc: BaseException) -> None:
    """The watchdog learned out of band that ``world`` cannot go on (a mismatch, a dead peer, a member that gave
    up on a group): the transport fails its pending and later waits with ``exc``, and the next call of every
    group of the world raises ``exc`` at once, whether or not that call would wait.

    The transport alone is not enough: a call whose operation completes without waiting never asks it (the two
    "roots" of a mismatched broadcast both complete, and so do barriers whose members arrive together), so a job
    could run on past the mismatch."""
    world.transport.abort(exc)
    for g in list(_LIVE):
        if g.world is world and g._halt is None:
            g._aborted = exc
            g._halt = "aborted"


def forked_message(op: str, parent: int) -> str:
    """The error of ``op`` in a child forked after init_process_group (in process ``parent``)."""
    return (
        f"{op}: this process was forked after init_process_group (by pid {parent}; this is pid {os.getpid()}): "
        "its process group, connections and shared memory belong to the parent, and using them here would mix "
        "this child's messages into the parent's collectives. Call procgroup.init_process_group() in the child "
        "for a group of its own (with its own rank and world size), or start children with the 'spawn' or "
        "'forkserver' start method (multiprocessing.get_context('spawn'))"
    )


def _after_fork_in_child() -> None:
    """In a child forked after init: every group refuses calls (ForkedProcessError) and tears nothing down."""
    for g in list(_LIVE):
        g._halt = "forked"


os.register_at_fork(after_in_child=_after_fork_in_child)
