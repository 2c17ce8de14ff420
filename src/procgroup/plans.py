"""Planned calls: what a repeated small collective derives once, per group (issue 14 item 2).

A loop that calls ``all_reduce(x)`` on the same kind of buffer spent most of a 4 B call's ~10 us in Python
deriving, on every call, what was the same as last time: the group, the flat view, the dtype's name, the
reduce kernel, the signature and its fingerprint, the engine's plan, the algorithm.  A :class:`Plan` keeps
all of that for one call shape: the group (a plan lives in ``ProcessGroup.plans``), the collective, dtype,
element count, reduce op and root.  A planned call then does only what must happen per call
(:meth:`ProcessGroup.run_plan`): the halted/thread/fork guards, the sequence number, the fingerprint chain,
the flight record the watchdog and the mismatch detection read, the deadline, the exchange, the reduction.

What a plan holds never depends on the buffer itself (its address, its data): a buffer reallocated with the
same shape and dtype uses the same plan, and the call's arrays are passed in on every call.  The arrays are
checked per call (a numpy array, C-contiguous, writable where results go); anything else takes the general
path, which builds the plan.  Signature, fingerprint and check word are exactly the general path's, so ranks
that take different paths for the same call still meet.

Invalidation: plans belong to one ProcessGroup object, so a destroyed group's plans die with it (close()
also clears them) and a group that reuses its id starts with none; a broken, destroyed or forked group
refuses the call before the plan runs.  The algorithm choice is cached only where it does not depend on a
tunable threshold: the arena (one member's bytes fit its slot) and the backend engine's plans; the big slots'
(``select.BIG_LIMIT`` is compared per call: above it the call takes select's choice); everything else asks
``algorithms.select`` on every call.  While ``select.FORCE`` pins any algorithm, no plan is used.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import algorithms as alg
from .algorithms.allreduce import allreduce_hierarchical, allreduce_multileader
from .algorithms.alltoall_shm import SALT, alltoall_shm, native_done, one_window, prepare, shm_applies
from .algorithms.arena import (
    _EMPTY,
    _FUSED,
    allgather_arena,
    allreduce_arena,
    barrier_arena,
    bcast_arena,
    bcast_queue,
    fits,
    queue_for,
    reduce_arena,
    reduce_queue,
)
from .algorithms.bigarena import allreduce_big, bind_allgather, bind_bcast, bind_reduce, bind_reduce_scatter
from .algorithms.comm import STEP_BITS, Comm
from .algorithms.hierbind import bind_hierarchical, bind_multileader
from .algorithms.onecopy import END_SALT, SALT_ALLGATHER, SALT_BCAST
from .algorithms.select import (
    BIG_LIMIT,
    all_gather_unread,
    big_limit,
    big_slots_for,
    broadcast_unread,
    choose_all_reduce,
    onecopy_for,
    tunables,
)
from .deadline import Deadline
from .groupcore import PlanCore
from .ops import ReduceOp, finalize
from .process_group import ProcessGroup
from .tags import FP_MASK, fingerprint
from .transport.base import READ_BCAST, READ_GATHER

__all__ = [
    "Plan",
    "PLAN_LIMIT",
    "remember",
    "all_reduce",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_list",
]

#: plans one group keeps; past that the cache starts over (a loop over many shapes still works, unplanned)
PLAN_LIMIT = 256

#: keys of the plan caches: the collective
AR, BC, RD, BA, AG, RS, A2A, A2AL = 1, 2, 3, 4, 5, 6, 7, 8

Fn = Callable[[Any, Any, Any], None]


class Plan(PlanCore):  # PlanCore: the compiled base or its Python twin (procgroup.groupcore)
    """One call shape of one group: op name, signature, fingerprint (bytes for the chain, and xor the
    group's generation for the tag) and ``fn(comm, a, b)``, the call's work on its arrays ``a``, ``b``.
    (``fpb``, ``fpx``, ``fn`` and ``post`` live in the base :class:`~procgroup.groupcore.PlanCore`.)"""

    __slots__ = ("op", "sig", "done", "fail")

    def __init__(self, g: ProcessGroup, op: str, sig: tuple, fn: Fn) -> None:
        fp = fingerprint(sig)
        self.op = op
        self.sig = sig
        self.fpb = fp.to_bytes(2, "little")
        self.fpx = (fp ^ g._gen_fp) & FP_MASK
        self.fn = fn
        #: the engine's split of the call (``CollectiveEngine.post_first``): ``post(a, b)`` starts it before
        #: run_plan's bookkeeping, ``done(deadline, handle)`` completes it after (once the handle's first
        #: ``Test()``s found it pending), ``fail(exc)`` turns an error of ``Test()`` into procgroup's; None: ``fn``
        #: does the whole call
        self.post: Any = None
        self.done: Any = None
        self.fail: Any = None
        #: ``fn`` takes ``(a, check word, deadline)`` instead of ``(comm, a, b)`` (no Comm to set up: run_plan
        #: passes the call's check word, ``Comm.check_word()`` of the Comm it would have made)
        self.direct = False

    def split(
        self, g: ProcessGroup, kind: str, nbytes: int, dtype: Any = None, reduce_op: Any = None, root: int = -1
    ) -> "Plan":
        """Ask the world's engine for this plan's post/done split of collective ``kind`` (see
        ``CollectiveEngine.post_first``); returns the plan."""
        eng = g.world.engine
        pd = eng.post_first(g, kind, self.fpx, nbytes, dtype, reduce_op, root) if eng is not None else None
        if pd is not None:
            self.post, self.done, self.fail = pd
        return self

    def __repr__(self) -> str:
        return f"Plan({self.op}, {self.sig})"


def remember(g: ProcessGroup, key: tuple, plan: Plan) -> Plan:
    """Keep ``plan`` under ``key`` in ``g``'s cache (bounded by PLAN_LIMIT)."""
    plans = g.plans
    if len(plans) >= PLAN_LIMIT:
        plans.clear()
    plans[key] = plan
    return plan


def _probe(g: ProcessGroup) -> Comm:
    """A Comm of ``g`` for asking the selection (no messages: size, hosts, the arena and, for a group spanning
    hosts, its host's slots; ``g.arena()`` makes both on first use)."""
    arena = g.arena()
    return Comm(g.world.transport, g.ranks, g.rank(), 0, Deadline(float("inf")), g._hosts, None, arena, g._host_arena)


def _compiled(g: ProcessGroup) -> Any:
    """The group's arena where it runs the compiled fast path (``ShmArena.native``), else None: plans for it
    call its one-call methods straight (``exchange_reduce``, ``exchange_copy``), without the algorithm layer."""
    a = g.arena()
    return a if getattr(a, "native", False) else None


#: a planned call's check word: ``Comm.check_word()`` of the comm ``run_plan`` set up, inlined
_CW_SHIFT, _CW_MASK = STEP_BITS, 0xFFFFFFFF


def _fused_codes(kern: Any, dt: Any) -> Any:
    try:
        return _FUSED.get((getattr(kern, "ufunc", None), dt))
    except TypeError:  # an unhashable dtype key
        return None


def _arena_fits(g: ProcessGroup, nbytes: int) -> bool:
    return g.size() > 1 and nbytes > 0 and fits(_probe(g), nbytes)


def all_reduce(g: ProcessGroup, dt: Any, n: int, op: ReduceOp, dname: str, kern: Any, fast: Any) -> Plan:
    """The plan of ``all_reduce`` of ``n`` elements of ``dt`` with ``op`` (``fast``: the engine's plan)."""
    avg = op is ReduceOp.AVG
    core: Callable[..., None]
    spanning = None
    if fast is not None:
        core = fast
    else:
        algo = alg.all_reduce
        if _arena_fits(g, n * _itemsize(dt)) and choose_all_reduce(_probe(g), n * _itemsize(dt), n) is allreduce_arena:
            algo = allreduce_arena
        else:
            spanning = _spanning(g, n, dt, kern)  # a group spanning hosts: its all_reduce bound once

        def core(c: Any, a: Any) -> None:
            algo(c, a, kern)

        if spanning is not None:
            core = spanning

    if avg:

        def fn(c: Any, a: Any, b: Any) -> None:
            core(c, a)
            finalize(op, a, c.size, dt)

    elif fast is not None:

        def fn(c: Any, a: Any, b: Any) -> None:
            fast(c, a)

    elif spanning is not None:
        sfn = spanning

        def fn(c: Any, a: Any, b: Any) -> None:
            sfn(c, a)

    elif algo is allreduce_arena and (ar := _compiled(g)) is not None and (codes := _fused_codes(kern, dt)):
        xr, rop, rty = ar.exchange_reduce, codes[0], codes[1]

        def fn(c: Any, a: Any, b: Any) -> None:
            if not xr(a, rop, rty, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline, True):
                algo(c, a, kern)  # not aligned: nothing was published, the general arena path

    elif (
        choose_all_reduce(_probe(g), n * _itemsize(dt), n) is allreduce_big
        and (bfn := _bound_big(g, "all_reduce", n * _itemsize(dt), dt, -1, kern)) is not None
    ):
        nb = n * _itemsize(dt)

        def fn(c: Any, a: Any, b: Any) -> None:
            if nb <= BIG_LIMIT["all_reduce"]:
                bfn(c, a)  # the big slots' one-sync all_reduce in one compiled call
            else:
                algo(c, a, kern)  # the limit was lowered since the plan was built: select's choice

    else:

        def fn(c: Any, a: Any, b: Any) -> None:
            algo(c, a, kern)

    plan = Plan(g, "all_reduce", ("all_reduce", dname, n, op.name), fn)
    return plan.split(g, "all_reduce", n * _itemsize(dt), dt, op) if fast is not None else plan


def broadcast(g: ProcessGroup, dt: Any, n: int, root: int, dname: str, fast: Any) -> Plan:
    """The plan of ``broadcast`` of ``n`` elements of ``dt`` from group rank ``root``."""
    algo = fast or (bcast_arena if _arena_fits(g, n * _itemsize(dt)) else alg.broadcast)
    qu = queue_for(g.arena(), n * _itemsize(dt)) if algo is bcast_arena else None
    ar = _compiled(g) if algo is bcast_arena else None
    fn: Fn
    if qu is not None:  # one-way, direct (no Comm)
        plan = Plan(g, "broadcast", ("broadcast", dname, n, f"root={root}"), _bcast_queue_fn(qu, g.rank(), root))
        plan.direct = True
        return plan
    if fast is None and algo is alg.broadcast and (bfn := _bound_big(g, "broadcast", n * _itemsize(dt), dt, root)):
        nb = n * _itemsize(dt)
        members = len(g.arena().members)

        def fn(c: Any, a: Any, b: Any) -> None:
            if nb <= big_limit("broadcast", members):
                bfn(c, a)  # the big slots' one-step broadcast in one compiled call
            else:
                algo(c, a, root)  # the limit was lowered since the plan was built: select's choice

    elif fast is None and algo is alg.broadcast and (rd := _reads(g, "broadcast", n * _itemsize(dt), dt, READ_BCAST)):
        nb, arena = n * _itemsize(dt), g.arena()

        def fn(c: Any, a: Any, b: Any) -> None:
            if onecopy_for(arena, "broadcast", nb):  # select's choice (its limits are compared per call)
                ck = c.check_word() ^ SALT_BCAST
                done = rd(a, a, ck, ck ^ END_SALT, root, c.deadline)  # onecopy.bcast_direct in one C call
                if done:
                    return
                if done is False:  # a member cannot read the root: select's next choice, on every member alike
                    broadcast_unread(c, a, root)
                    return
            algo(c, a, root)

    elif ar is not None:
        xc = ar.exchange_copy
        if g.rank() == root:

            def fn(c: Any, a: Any, b: Any) -> None:
                if not xc(a, _EMPTY, root, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline):
                    algo(c, a, root)  # nothing was published: the general arena path

        else:

            def fn(c: Any, a: Any, b: Any) -> None:
                if not xc(None, a, root, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline):
                    algo(c, a, root)

    else:

        def fn(c: Any, a: Any, b: Any) -> None:
            algo(c, a, root)

    plan = Plan(g, "broadcast", ("broadcast", dname, n, f"root={root}"), fn)
    return plan.split(g, "broadcast", n * _itemsize(dt), root=root) if fast is not None else plan


def reduce(g: ProcessGroup, dt: Any, n: int, op: ReduceOp, root: int, dname: str, kern: Any, fast: Any) -> Plan:
    """The plan of ``reduce`` of ``n`` elements of ``dt`` with ``op`` into group rank ``root``."""
    avg = op is ReduceOp.AVG
    if fast is not None:
        core = fast
    else:
        algo = reduce_arena if _arena_fits(g, n * _itemsize(dt)) else alg.reduce

        def core(c: Any, a: Any, r: int) -> None:
            algo(c, a, kern, r)

    fn: Fn
    qu = queue_for(g.arena(), n * _itemsize(dt)) if fast is None and algo is reduce_arena else None
    if qu is not None:  # one-way, direct (no Comm)
        qfn = _reduce_queue_fn(qu, g.rank(), root, kern, dt, op, g.size())
        plan = Plan(g, "reduce", ("reduce", dname, n, op.name, f"root={root}"), qfn)
        plan.direct = True
        return plan
    if fast is None and not avg and algo is reduce_arena and (ar := _compiled(g)) and (codes := _fused_codes(kern, dt)):
        xr, rop, rty, here = ar.exchange_reduce, codes[0], codes[1], g.rank() == root

        def fn(c: Any, a: Any, b: Any) -> None:
            if not xr(a, rop, rty, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline, here):
                algo(c, a, kern, root)  # not aligned: nothing was published, the general arena path

    elif (
        fast is None
        and not avg
        and algo is alg.reduce
        and (bfn := _bound_big(g, "reduce", n * _itemsize(dt), dt, root, kern)) is not None
    ):
        nb = n * _itemsize(dt)

        def fn(c: Any, a: Any, b: Any) -> None:
            if nb <= BIG_LIMIT["reduce"]:
                bfn(c, a)  # the big slots' one-sync reduce in one compiled call (a non-root one-way)
            else:
                core(c, a, root)  # the limit was lowered since the plan was built: select's choice

    else:

        def fn(c: Any, a: Any, b: Any) -> None:
            core(c, a, root)
            if avg and c.rank == root:
                finalize(op, a, c.size, dt)

    plan = Plan(g, "reduce", ("reduce", dname, n, op.name, f"root={root}"), fn)
    return plan.split(g, "reduce", n * _itemsize(dt), dt, op, root) if fast is not None else plan


#: a direct plan's function (``Plan.direct``): ``fn(a, check word, deadline)``
DirectFn = Callable[[Any, int, Any], None]


def _queue_step(qu: Any, call: Any, wait: Any, root: int) -> DirectFn:
    """A compiled one-way call (``q_post``/``q_read`` and its ``*_wait``): the C call straight, Python only to
    sleep (``wait``) or to raise for a closed/aborted transport."""
    t, enter = qu.t, qu.enter

    def fn(a: Any, cw: int, dl: Any) -> None:
        if t._aborted is not None or t._closed:
            enter()  # raises
        if call(a, cw, root):
            wait(a, cw, root, dl)

    return fn


def _bcast_queue_fn(qu: Any, me: int, root: int) -> DirectFn:
    """A planned one-way broadcast through the group's queue (``algorithms.arena.bcast_queue``), direct."""
    if not qu.native:

        def fn_py(a: Any, cw: int, dl: Any) -> None:
            bcast_queue(qu, a, me, root, cw, dl)

        return fn_py
    if me == root:
        return _queue_step(qu, qu.nat.q_post, qu.post_wait, root)
    return _queue_step(qu, qu.nat.q_read, qu.read_wait, root)


def _reduce_queue_fn(qu: Any, me: int, root: int, kern: Any, dt: Any, op: ReduceOp, size: int) -> DirectFn:
    """A planned one-way reduce through the group's queue (``algorithms.arena.reduce_queue``), direct; compiled:
    the C call straight (a non-root's post, the root's fused gather-and-reduce), else the general queue path."""
    avg = op is ReduceOp.AVG
    codes = _fused_codes(kern, dt)
    if qu.native and me != root:
        return _queue_step(qu, qu.nat.q_post, qu.post_wait, root)
    if qu.native and not avg and codes is not None:
        t, enter = qu.t, qu.enter
        gather, rop, rty = qu.nat.q_gather, codes[0], codes[1]

        def fn_root(a: Any, cw: int, dl: Any) -> None:
            if t._aborted is not None or t._closed:
                enter()  # raises
            if gather(a, cw, rop, rty, True):  # not yet (nothing done) or not aligned: the general queue path
                reduce_queue(qu, a, kern, me, root, cw, dl)

        return fn_root

    def fn(a: Any, cw: int, dl: Any) -> None:
        reduce_queue(qu, a, kern, me, root, cw, dl)
        if avg and me == root:
            finalize(op, a, size, dt)

    return fn


def barrier(g: ProcessGroup, fast: Any) -> Plan:
    """The plan of ``barrier`` (``fast``: the engine's)."""
    algo = fast or (barrier_arena if g.size() > 1 and g.arena() is not None else alg.barrier)
    if algo is barrier_arena and (ar := _compiled(g)) is not None:  # the arena's exchange, called with no Comm
        plan = Plan(g, "barrier", ("barrier",), ar.bind_barrier())
        plan.direct = True
        return plan

    def fn(c: Any, a: Any, b: Any) -> None:
        algo(c)

    plan = Plan(g, "barrier", ("barrier",), fn)
    return plan.split(g, "barrier", 0) if fast is not None else plan


def all_gather(g: ProcessGroup, dt: Any, n: int, dname: str, fast: Any) -> Plan:
    """The plan of ``all_gather_into_tensor`` of ``n`` elements of ``dt`` per rank (``a`` in, ``b`` out)."""
    algo = fast or (allgather_arena if _arena_fits(g, n * _itemsize(dt)) else alg.all_gather)
    ar = _compiled(g) if algo is allgather_arena else None
    fn: Fn
    if algo is alg.all_gather and (big_fn := _allgather_big(g, n * _itemsize(dt), dt)) is not None:
        nb = n * _itemsize(dt)
        members = len(g.arena().members)

        def fn(c: Any, a: Any, b: Any) -> None:
            if nb <= big_limit("all_gather", members):
                big_fn(c, a, b)  # the big slots' one-step all_gather (algorithms.select picks allgather_big)
            else:
                algo(c, a, b)  # the limit was lowered since the plan was built: select's choice
    elif ar is not None:
        xc = ar.exchange_copy

        def fn(c: Any, a: Any, b: Any) -> None:
            if not xc(a, b, -1, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline):
                algo(c, a, b)  # nothing was published: the general arena path

    elif algo is alg.all_gather and (rd := _reads(g, "all_gather", n * _itemsize(dt), dt, READ_GATHER)) is not None:
        nb, arena = n * _itemsize(dt), g.arena()

        def fn(c: Any, a: Any, b: Any) -> None:
            if onecopy_for(arena, "all_gather", nb):  # select's choice (its limits are compared per call)
                ck = c.check_word() ^ SALT_ALLGATHER
                done = rd(a, b, ck, ck ^ END_SALT, -1, c.deadline)  # onecopy.allgather_direct in one C call
                if done:
                    return
                if done is False:  # a member cannot read the others: select's next choice, on every member alike
                    all_gather_unread(c, a, b)
                    return
            algo(c, a, b)

    else:

        def fn(c: Any, a: Any, b: Any) -> None:
            algo(c, a, b)

    plan = Plan(g, "all_gather_into_tensor", ("all_gather", dname, n), fn)
    return plan.split(g, "all_gather", n * _itemsize(dt)) if fast is not None else plan


def _big_slots(g: ProcessGroup, collective: str, nbytes: int, dt: Any) -> Any:
    """The group's big slots where algorithms.select takes them for ``collective`` of ``nbytes`` (above the
    arena's slot, within BIG_LIMIT) and ``dt`` is a numpy dtype; else None."""
    big = big_slots_for(g.arena(), collective, nbytes)
    return None if isinstance(dt, str) else big


def _allgather_big(g: ProcessGroup, nbytes: int, dt: Any) -> Any:
    """bigarena.bind_allgather for a part of ``nbytes`` a member, where algorithms.select takes the big slots for
    it; else None."""
    big = _big_slots(g, "all_gather", nbytes, dt)
    return None if big is None else bind_allgather(big, nbytes, dt)


def _reads(g: ProcessGroup, collective: str, nbytes: int, dt: Any, mode: int) -> Any:
    """The group's compiled one-copy reads (``Arena.bind_read`` of ``mode``) where algorithms.select reads
    ``collective`` of ``nbytes`` straight out of the owners' memory (``onecopy_for``) and ``dt`` is a numpy dtype;
    else None."""
    a = g.arena()
    if isinstance(dt, str) or not onecopy_for(a, collective, nbytes):
        return None
    return a.bind_read(mode)


def _bound_big(g: ProcessGroup, collective: str, nbytes: int, dt: Any, root: int, kern: Any = None) -> Any:
    """``fn(comm, buf)``: bigarena.bind_bcast (``collective`` "broadcast") or bind_reduce ("all_reduce" with
    ``root`` -1, "reduce"), where algorithms.select takes the big slots for it and the binding applies; else
    None."""
    big = _big_slots(g, collective, nbytes, dt)
    if big is None:
        return None
    if collective == "broadcast":
        return bind_bcast(big, nbytes, np.dtype(dt), root, g.rank())
    return bind_reduce(big, nbytes, np.dtype(dt), g.size(), g.rank(), root, kern)


def _spanning(g: ProcessGroup, n: int, dt: Any, kern: Any) -> Any:
    """``fn(comm, buf)``: the hierarchical or multi-leader all_reduce that algorithms.select takes for this size on a
    group spanning hosts, bound once (algorithms.hierbind), where it binds; it runs select's choice instead once any
    threshold differs from when it was bound (``select.tunables()``, compared per call).  Else None."""
    if isinstance(dt, str) or n == 0 or g.size() < 3:
        return None
    probe = _probe(g)
    if probe.host_arena is None:
        return None
    nb, dtn = n * _itemsize(dt), np.dtype(dt)
    algo = choose_all_reduce(probe, nb, n)
    if algo is allreduce_hierarchical:
        bound = bind_hierarchical(probe, nb, n, dtn, kern)
    elif algo is allreduce_multileader:
        bound = bind_multileader(probe, nb, n, dtn, kern)
    else:
        return None
    if bound is None:
        return None
    knobs = tunables()

    def fn(c: Any, a: Any) -> None:
        if tunables() == knobs:
            bound(c, a)
        else:  # a threshold or the stage choices changed since: select's choice now
            alg.all_reduce(c, a, kern)

    return fn


def reduce_scatter(g: ProcessGroup, dt: Any, n: int, op: ReduceOp, dname: str, kern: Any, fast: Any) -> Plan:
    """The plan of ``reduce_scatter_tensor`` into ``n`` elements of ``dt`` per rank (``a`` in, ``b`` out).

    The algorithm is chosen per call (``algorithms.reduce_scatter``: by thresholds) unless the engine has one."""
    avg = op is ReduceOp.AVG
    p, isz = g.size(), _itemsize(dt)
    ar = _compiled(g) if fast is None and not avg and _arena_fits(g, p * n * isz) else None
    codes = _fused_codes(kern, dt) if ar is not None else None
    fn: Fn
    if ar is not None and codes is not None:
        # one member's whole input fits its slot: the arena's reduce_scatter (as algorithms.select picks), compiled
        xb, rop, rty, off = ar.exchange_reduce_block, codes[0], codes[1], g.rank() * n * isz

        def fn(c: Any, a: Any, b: Any) -> None:
            if not xb(a, b, rop, rty, off, (c.tag >> _CW_SHIFT) & _CW_MASK, c.deadline):
                alg.reduce_scatter(c, a, b, kern)  # not aligned: nothing was published, the general path

    elif (
        fast is None
        and not avg
        and (big := _big_slots(g, "reduce_scatter", p * n * isz, dt)) is not None  # above the arena's slot
        and (bfn := bind_reduce_scatter(big, n, np.dtype(dt), p, g.rank(), kern)) is not None
    ):
        nb = p * n * isz

        def fn(c: Any, a: Any, b: Any) -> None:
            if nb <= BIG_LIMIT["reduce_scatter"]:
                bfn(c, a, b)  # the big slots' one-step reduce_scatter: copy in, sync, one compiled reduction
            else:
                alg.reduce_scatter(c, a, b, kern)  # the limit was lowered since the plan was built

    else:

        def fn(c: Any, a: Any, b: Any) -> None:
            if fast is None:
                alg.reduce_scatter(c, a, b, kern)
            else:
                fast(c, a, b)
            if avg:
                finalize(op, b, c.size, dt)

    return Plan(g, "reduce_scatter_tensor", ("reduce_scatter", dname, n, op.name), fn)


def all_to_all(g: ProcessGroup, dname: str, sc: list, rc: list, fast: Any, itemsize: int = 0) -> Plan:
    """The plan of ``all_to_all_single`` with element counts ``sc`` sent and ``rc`` received per rank.

    With an arena (``itemsize`` given), the shared-memory all_to_all with its layout prepared once; the
    streams' limit (``select.big_limit``: ``BIG_LIMIT``, ``BIG_LIMIT_PAIR`` for two) is read per call."""
    a2a = fast or alg.all_to_all
    if fast is None and itemsize and g.size() > 1 and shm_applies(probe := _probe(g)):
        prep = prepare(probe.size, probe.rank, sc, rc, itemsize)
        members = probe.size
        ar = _compiled(g)
        xa = ar.bind_a2a(prep.spec, prep.header, ar.big) if ar is not None else None
        if xa is not None:  # the compiled call straight (alltoall_shm's first step, without its checks)

            def fn_nat(c: Any, a: Any, b: Any) -> None:
                lim = big_limit("all_to_all", members)
                f = xa(a, b, ((c.tag >> _CW_SHIFT) & _CW_MASK) ^ SALT, c.deadline, one_window(lim), lim)
                if f:
                    if f < 0:  # nothing was published: the general path
                        alltoall_shm(c, a, sc, b, rc, prep, lim)
                    else:
                        native_done(c, f, a, b, prep, lim)

            return Plan(g, "all_to_all_single", ("all_to_all", dname), fn_nat)

        def fn_shm(c: Any, a: Any, b: Any) -> None:
            alltoall_shm(c, a, sc, b, rc, prep, big_limit("all_to_all", members))

        return Plan(g, "all_to_all_single", ("all_to_all", dname), fn_shm)

    def fn(c: Any, a: Any, b: Any) -> None:
        a2a(c, a, sc, b, rc)

    return Plan(g, "all_to_all_single", ("all_to_all", dname), fn)


def all_to_all_list(g: ProcessGroup, dname: str, sc: list, rc: list, itemsize: int, general: Any, after: Any) -> Any:
    """The plan of the list form of ``all_to_all`` (``sc[j]`` elements in input j, ``rc[i]`` in output i), where the
    group runs the compiled arena: one call reads the inputs and writes the outputs in place (no scratch
    copies).  None elsewhere (the general path each time).  ``general(c, ins, outs)``: the general path's work,
    where the compiled call took nothing; ``after(c, f, ins, outs, prep, lim)``: what it left (its flags ``f``).
    The streams' limit is ``BIG_LIMIT`` for every group size (``select.all_to_all``'s ``lists``): a list offers no
    one send buffer to read, so a pair's reads (``BIG_LIMIT_PAIR``) would run in Python, behind the big slots'
    one call."""
    if g.size() < 2 or not itemsize or not shm_applies(probe := _probe(g)):
        return None
    ar = _compiled(g)
    if ar is None:
        return None
    prep = prepare(probe.size, probe.rank, sc, rc, itemsize)
    xa = ar.bind_a2a(prep.list_spec(), prep.header, ar.big)
    if xa is None:
        return None
    limits = BIG_LIMIT

    def fn(c: Any, ins: Any, outs: Any) -> None:
        lim = limits["all_to_all"]
        f = xa(ins, outs, ((c.tag >> _CW_SHIFT) & _CW_MASK) ^ SALT, c.deadline, one_window(lim), lim)
        if f:
            if f < 0:  # nothing was published
                general(c, ins, outs)
            else:
                after(c, f, ins, outs, prep, lim)

    return Plan(g, "all_to_all", ("all_to_all", dname), fn)


def _itemsize(dt: Any) -> int:
    return 2 if isinstance(dt, str) else int(dt.itemsize)  # "bfloat16" travels as uint16
