"""Collectives with torch.distributed's signatures and semantics.

Ranks passed as ``src``/``dst``/``peer`` are *global* ranks (as torch); the
``group_src``/``group_dst``/``group_peer`` keywords take ranks within the
group.  Outputs are written in place; inputs are never modified (except
where torch defines the op as in place: broadcast, all_reduce, reduce).
Point-to-point (send/recv, isend/irecv, P2POp, batch_isend_irecv) lives in
:mod:`procgroup.p2p` and is re-exported here.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from . import algorithms as alg
from . import plans
from .algorithms.alltoall_shm import native_done
from .algorithms.select import FORCE as _FORCE
from .arguments import API_SLOT_A, API_SLOT_B, device_ops
from .arguments import member_group as _group
from .arguments import root_rank as _root
from .data import Flat, after, as_flat, tensor_view
from .errors import ConfigError, DeviceTensorError
from .ops import ReduceOp, finalize, reducer
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .process_group import SLOW, ProcessGroup, Work
from .state import _state

__all__ = [
    "ReduceOp",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
]


def _same(op: str, a: Flat, b: Flat, what_a: str, what_b: str, factor: int = 1) -> None:
    if a.dtype != b.dtype:
        raise ConfigError(f"{op}: {what_a} has dtype {a.dtype} but {what_b} has dtype {b.dtype}; they must match")
    if a.numel * factor != b.numel:
        raise ConfigError(
            f"{op}: {what_b} has {b.numel} elements but must have {a.numel * factor} "
            f"({'%d x ' % factor if factor != 1 else ''}{what_a}'s {a.numel})"
        )


_DNAMES: dict = {}


def _dname(dt: Any) -> str:
    """``str(dt)``, memoised (numpy's dtype __str__ costs several microseconds)."""
    name = _DNAMES.get(dt)
    if name is None:
        name = str(dt)
        if len(_DNAMES) < 256:
            _DNAMES[dt] = name
    return name


_ndarray = np.ndarray
#: _PLANNED: a planned front runs its cached plan on ``tensor`` itself when it is a numpy array, on a numpy view of
#: it when it is a plain CPU torch tensor (:func:`~procgroup.data.tensor_view`), else takes the general path; the
#: fronts spell this out inline (a function call costs ~0.05 us of a 4 B call's ~2.5)
_BARRIER = (plans.BA,)
#: the plan keys' first items (module constants: one global read, not a global and an attribute)
_AR, _BC, _RD, _AG = plans.AR, plans.BC, plans.RD, plans.AG


def _two_array_key(kind: int, out: Any, inp: Any, op: Any, group: Any, async_op: bool, timeout: Any) -> Any:
    """The plan key of a call with an output and an input array (by shape: splits follow it), or None."""
    if type(out) is not _ndarray or type(inp) is not _ndarray or async_op or timeout is not None or _FORCE:
        return None
    if op is not None and type(op) is not ReduceOp:
        return None
    return (kind, None if op is None else op._value_, out.dtype, out.shape, inp.dtype, inp.shape)


def _run_two(key: Any, out: Any, inp: Any, group: Any) -> bool:
    """Run the planned call of ``key`` on ``out`` and ``inp``; False when there is none or it needs the general
    path (then nothing has happened)."""
    pg = _state.default if group is None else group
    if type(pg) is not ProcessGroup or pg._rank < 0:
        return False
    plan = pg.plans.get(key)
    if plan is None or not ((fl := out.flags).c_contiguous and fl.writeable and inp.flags.c_contiguous):
        return False
    return pg.run_plan(plan, inp.reshape(-1), out.reshape(-1)) is not SLOW


def _avg_or_none(op: Any) -> ReduceOp:
    if type(op) is ReduceOp:
        return op
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp[str(op).split(".")[-1].upper()]
        except KeyError:
            try:  # a torch ReduceOp instance (options objects carry one)
                return ReduceOp.coerce(op)
            except ConfigError:
                pass
            raise ConfigError(f"op={op!r} is not a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR)") from None
    return op


# -- collectives ----------------------------------------------------------------------------
def broadcast(
    tensor: Any,
    src: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
    timeout: Any = None,
) -> Optional[Work]:
    """Copy ``tensor`` from ``src`` (global rank) to every member, in place; a Work when ``async_op``."""
    key = a = None
    if not (async_op or timeout is not None or group_src is not None or _FORCE):
        a = tensor if type(tensor) is _ndarray else tensor_view(tensor)  # see _PLANNED
    if a is not None:
        pg = _state.default if group is None else group
        if type(pg) is ProcessGroup and pg._rank >= 0:
            key = (_BC, src, a.dtype, a.size)
            plan = pg.plans.get(key)
            if plan is not None and a.flags.carray:  # C-contiguous, aligned and writeable
                if pg.run_plan(plan, a if a.ndim == 1 else a.reshape(-1)) is not SLOW:
                    return None
    g = _group(group, "broadcast")
    if g is None:
        return None
    root = _root(g, "broadcast", src, group_src, "src")
    try:
        f = as_flat(tensor, "broadcast tensor")
    except DeviceTensorError as e:
        return device_ops(g, e).broadcast(g, tensor, root, async_op, timeout)
    eng = g.world.engine
    fast = eng.broadcast(g, f.dtype) if eng is not None else None
    bcast = fast or alg.broadcast
    if key is not None and f.back is None:
        plans.remember(g, key, plans.broadcast(g, f.dtype, f.numel, root, _dname(f.dtype), fast))
    return g.run(
        "broadcast",
        after(lambda c: bcast(c, f.array, root), (f,)),
        async_op=async_op,
        timeout=timeout,
        signature=("broadcast", _dname(f.dtype), f.numel, f"root={root}"),
    )


#: (dtype, op) -> (dtype name, op name, kernel, needs finalize): what all_reduce derives per call, memoised
_AR_PLAN: dict = {}


def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, timeout: Any = None
) -> Optional[Work]:
    """Reduce ``tensor`` over the group with ``op``, in place on every member; a Work when ``async_op``."""
    key = a = None
    if type(op) is ReduceOp and not (async_op or timeout is not None or _FORCE):
        a = tensor if type(tensor) is _ndarray else tensor_view(tensor)  # see _PLANNED
    if a is not None:
        pg = _state.default if group is None else group
        if type(pg) is ProcessGroup and pg._rank >= 0:
            key = (_AR, op._value_, a.dtype, a.size)
            plan = pg.plans.get(key)
            if plan is not None and a.flags.carray:  # C-contiguous, aligned and writeable
                if pg.run_plan(plan, a if a.ndim == 1 else a.reshape(-1)) is not SLOW:
                    return None
    g = _group(group, "all_reduce")
    if g is None:
        return None
    op = _avg_or_none(op)
    try:
        f = as_flat(tensor, "all_reduce tensor")
    except DeviceTensorError as e:
        return device_ops(g, e).all_reduce(g, tensor, op, async_op, timeout)
    arr, dt = f.array, f.dtype
    try:
        plan = _AR_PLAN.get((dt, op))
    except TypeError:  # an unhashable dtype key
        plan = None
    if plan is None:
        plan = (_dname(dt), op.name, reducer(op, dt), op is ReduceOp.AVG)
        if len(_AR_PLAN) < 256:
            _AR_PLAN[(dt, op)] = plan
    dname, opname, kern, avg = plan
    eng = g.world.engine
    fast = eng.all_reduce(g, dt, op) if eng is not None else None
    if key is not None and f.back is None:
        plans.remember(g, key, plans.all_reduce(g, dt, arr.size, op, dname, kern, fast))

    def run(c: Any) -> None:
        if fast is None:
            alg.all_reduce(c, arr, kern)
        else:
            fast(c, arr)
        if avg:
            finalize(op, arr, c.size, dt)

    return g.run(
        "all_reduce",
        run if f.back is None else after(run, (f,)),
        async_op=async_op,
        timeout=timeout,
        signature=("all_reduce", dname, arr.size, opname),
    )


def reduce(
    tensor: Any,
    dst: Optional[int] = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
    timeout: Any = None,
) -> Optional[Work]:
    """Reduce ``tensor`` over the group into ``dst``'s tensor, in place there; others' tensors may change."""
    key = None
    planned = type(op) is ReduceOp and not async_op and timeout is None and group_dst is None and not _FORCE
    a = (tensor if type(tensor) is _ndarray else tensor_view(tensor)) if planned else None  # see _PLANNED
    if a is not None:
        pg = _state.default if group is None else group
        if type(pg) is ProcessGroup and pg._rank >= 0:
            key = (_RD, dst, op._value_, a.dtype, a.size)
            plan = pg.plans.get(key)
            if plan is not None and a.flags.carray:  # C-contiguous, aligned and writeable
                if pg.run_plan(plan, a if a.ndim == 1 else a.reshape(-1)) is not SLOW:
                    return None
    g = _group(group, "reduce")
    if g is None:
        return None
    root = _root(g, "reduce", dst, group_dst, "dst")
    op = _avg_or_none(op)
    try:
        f = as_flat(tensor, "reduce tensor")
    except DeviceTensorError as e:
        return device_ops(g, e).reduce(g, tensor, root, op, async_op, timeout)
    kern = reducer(op, f.dtype)
    eng = g.world.engine
    fast = eng.reduce(g, f.dtype, op) if eng is not None else None
    if key is not None and f.back is None:
        plans.remember(g, key, plans.reduce(g, f.dtype, f.numel, op, root, _dname(f.dtype), kern, fast))

    def run(c: Any) -> None:
        if fast is None:
            alg.reduce(c, f.array, kern, root)
        else:
            fast(c, f.array, root)
        if c.rank == root:
            finalize(op, f.array, c.size, f.dtype)

    return g.run(
        "reduce",
        after(run, (f,)),
        async_op=async_op,
        timeout=timeout,
        signature=("reduce", _dname(f.dtype), f.numel, op.name, f"root={root}"),
    )


def all_gather(
    tensor_list: List[Any], tensor: Any, group: Any = None, async_op: bool = False, timeout: Any = None
) -> Optional[Work]:
    """Every member's ``tensor`` into ``tensor_list[i]`` (one entry per group rank) on every member."""
    g = _group(group, "all_gather")
    if g is None:
        return None
    if len(tensor_list) != g.size():
        raise ConfigError(f"all_gather: tensor_list has {len(tensor_list)} entries but the group has {g.size()} ranks")
    try:
        src = as_flat(tensor, "all_gather input", writable=False)
    except DeviceTensorError as e:
        return device_ops(g, e).all_gather(g, tensor_list, tensor, async_op, timeout)
    outs = [as_flat(t, f"all_gather tensor_list[{i}]") for i, t in enumerate(tensor_list)]
    for i, o in enumerate(outs):
        _same("all_gather", src, o, "the input", f"tensor_list[{i}]")
    eng = g.world.engine
    gather_all = (eng.all_gather(g, src.dtype) if eng is not None else None) or alg.all_gather

    def run(c: Any) -> None:
        n = src.numel
        buf = c.scratch(n * c.size * src.array.itemsize, slot=API_SLOT_A).view(src.array.dtype)
        gather_all(c, src.array, buf)
        for i, o in enumerate(outs):
            o.array[...] = buf[i * n : (i + 1) * n]

    return g.run(
        "all_gather",
        after(run, outs),
        async_op=async_op,
        timeout=timeout,
        signature=("all_gather", _dname(src.dtype), src.numel),
    )


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False, timeout: Any = None
) -> Optional[Work]:
    """Every member's input concatenated in group-rank order into ``output_tensor``."""
    key = None
    if (
        type(output_tensor) is _ndarray
        and type(input_tensor) is _ndarray
        and not async_op
        and timeout is None
        and not _FORCE
    ):
        pg = _state.default if group is None else group
        if type(pg) is ProcessGroup and pg._rank >= 0:
            key = (_AG, input_tensor.dtype, input_tensor.size, output_tensor.dtype, output_tensor.size)
            plan = pg.plans.get(key)
            if (
                plan is not None
                and (fl := output_tensor.flags).c_contiguous
                and fl.writeable
                and input_tensor.flags.c_contiguous
            ):
                a = input_tensor if input_tensor.ndim == 1 else input_tensor.reshape(-1)
                b = output_tensor if output_tensor.ndim == 1 else output_tensor.reshape(-1)
                if pg.run_plan(plan, a, b) is not SLOW:
                    return None
    g = _group(group, "all_gather_into_tensor")
    if g is None:
        return None
    try:
        src = as_flat(input_tensor, "all_gather_into_tensor input", writable=False)
    except DeviceTensorError as e:
        return device_ops(g, e).all_gather_into_tensor(g, output_tensor, input_tensor, async_op, timeout)
    out = as_flat(output_tensor, "all_gather_into_tensor output")
    _same("all_gather_into_tensor", src, out, "the input", "the output", g.size())
    eng = g.world.engine
    fast = eng.all_gather(g, src.dtype) if eng is not None else None
    gather_all = fast or alg.all_gather
    if key is not None and out.back is None and src.back is None:
        plans.remember(g, key, plans.all_gather(g, src.dtype, src.numel, _dname(src.dtype), fast))
    return g.run(
        "all_gather_into_tensor",
        after(lambda c: gather_all(c, src.array, out.array), (out,)),
        async_op=async_op,
        timeout=timeout,
        signature=("all_gather", _dname(src.dtype), src.numel),
    )


def gather(
    tensor: Any,
    gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
    timeout: Any = None,
) -> Optional[Work]:
    """Every member's ``tensor`` into ``gather_list`` on ``dst`` (None or empty elsewhere)."""
    g = _group(group, "gather")
    if g is None:
        return None
    root = _root(g, "gather", dst, group_dst, "dst", default=0)
    try:
        src = as_flat(tensor, "gather input", writable=False)
    except DeviceTensorError as e:
        return device_ops(g, e).gather(g, tensor, gather_list, root, async_op, timeout)
    outs: List[Flat] = []
    if g.rank() == root:
        if gather_list is None or len(gather_list) != g.size():
            raise ConfigError(
                f"gather: the destination rank needs gather_list with {g.size()} tensors, "
                f"got {None if gather_list is None else len(gather_list)}"
            )
        outs = [as_flat(t, f"gather_list[{i}]") for i, t in enumerate(gather_list)]
        for i, o in enumerate(outs):
            _same("gather", src, o, "the input", f"gather_list[{i}]")
    elif gather_list:
        raise ConfigError("gather: gather_list must be None or empty on ranks other than dst")
    eng = g.world.engine
    gather_to = (eng.gather(g, src.dtype) if eng is not None else None) or alg.gather

    def run(c: Any) -> None:
        n = src.numel
        buf = (
            c.scratch(n * c.size * src.array.itemsize, slot=API_SLOT_A).view(src.array.dtype)
            if c.rank == root
            else None
        )
        gather_to(c, src.array, buf, root)
        if buf is not None:
            for i, o in enumerate(outs):
                o.array[...] = buf[i * n : (i + 1) * n]

    return g.run(
        "gather",
        after(run, outs),
        async_op=async_op,
        timeout=timeout,
        signature=("gather", _dname(src.dtype), src.numel, f"root={root}"),
    )


def scatter(
    tensor: Any,
    scatter_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
    timeout: Any = None,
) -> Optional[Work]:
    """``scatter_list[i]`` on ``src`` into group rank i's ``tensor``."""
    g = _group(group, "scatter")
    if g is None:
        return None
    root = _root(g, "scatter", src, group_src, "src", default=0)
    try:
        out = as_flat(tensor, "scatter output")
    except DeviceTensorError as e:
        return device_ops(g, e).scatter(g, tensor, scatter_list, root, async_op, timeout)
    ins: List[Flat] = []
    if g.rank() == root:
        if scatter_list is None or len(scatter_list) != g.size():
            raise ConfigError(
                f"scatter: the source rank needs scatter_list with {g.size()} tensors, "
                f"got {None if scatter_list is None else len(scatter_list)}"
            )
        ins = [as_flat(t, f"scatter_list[{i}]", writable=False) for i, t in enumerate(scatter_list)]
        for i, x in enumerate(ins):
            _same("scatter", out, x, "the output", f"scatter_list[{i}]")
    elif scatter_list:
        raise ConfigError("scatter: scatter_list must be None or empty on ranks other than src")
    eng = g.world.engine
    scatter_from = (eng.scatter(g, out.dtype) if eng is not None else None) or alg.scatter

    def run(c: Any) -> None:
        n = out.numel
        buf = None
        if c.rank == root:
            buf = c.scratch(n * c.size * out.array.itemsize, slot=API_SLOT_A).view(out.array.dtype)
            for i, x in enumerate(ins):
                buf[i * n : (i + 1) * n] = x.array
        scatter_from(c, buf, out.array, root)

    return g.run(
        "scatter",
        after(run, (out,)),
        async_op=async_op,
        timeout=timeout,
        signature=("scatter", _dname(out.dtype), out.numel, f"root={root}"),
    )


def reduce_scatter(
    output: Any,
    input_list: List[Any],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    timeout: Any = None,
) -> Optional[Work]:
    """Reduce ``input_list[i]`` over the group into group rank i's ``output``."""
    g = _group(group, "reduce_scatter")
    if g is None:
        return None
    op = _avg_or_none(op)
    try:
        out = as_flat(output, "reduce_scatter output")
    except DeviceTensorError as e:
        return device_ops(g, e).reduce_scatter(g, output, input_list, op, async_op, timeout)
    if len(input_list) != g.size():
        raise ConfigError(
            f"reduce_scatter: input_list has {len(input_list)} tensors but the group has {g.size()} ranks"
        )
    ins = [as_flat(t, f"input_list[{i}]", writable=False) for i, t in enumerate(input_list)]
    for i, x in enumerate(ins):
        _same("reduce_scatter", out, x, "the output", f"input_list[{i}]")
    kern = reducer(op, out.dtype)
    eng = g.world.engine
    fast = eng.reduce_scatter(g, out.dtype, op) if eng is not None else None

    def run(c: Any) -> None:
        n = out.numel
        buf = c.scratch(n * c.size * out.array.itemsize, slot=API_SLOT_A).view(out.array.dtype)
        for i, x in enumerate(ins):
            buf[i * n : (i + 1) * n] = x.array
        if fast is None:
            alg.reduce_scatter(c, buf, out.array, kern)
        else:
            fast(c, buf, out.array)
        finalize(op, out.array, c.size, out.dtype)

    return g.run(
        "reduce_scatter",
        after(run, (out,)),
        async_op=async_op,
        timeout=timeout,
        signature=("reduce_scatter", _dname(out.dtype), out.numel, op.name),
    )


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, timeout: Any = None
) -> Optional[Work]:  # noqa: A002 - torch's name
    """Reduce ``input`` over the group; group rank i gets its i-th slice in ``output``."""
    key = _two_array_key(plans.RS, output, input, op, group, async_op, timeout)
    if key is not None:
        done = _run_two(key, output, input, group)
        if done:
            return None
    g = _group(group, "reduce_scatter_tensor")
    if g is None:
        return None
    op = _avg_or_none(op)
    try:
        out = as_flat(output, "reduce_scatter_tensor output")
    except DeviceTensorError as e:
        return device_ops(g, e).reduce_scatter_tensor(g, output, input, op, async_op, timeout)
    src = as_flat(input, "reduce_scatter_tensor input", writable=False)
    _same("reduce_scatter_tensor", out, src, "the output", "the input", g.size())
    kern = reducer(op, out.dtype)
    eng = g.world.engine
    fast = eng.reduce_scatter(g, out.dtype, op) if eng is not None else None
    if key is not None and out.back is None and src.back is None:
        plans.remember(g, key, plans.reduce_scatter(g, out.dtype, out.numel, op, _dname(out.dtype), kern, fast))

    def run(c: Any) -> None:
        if fast is None:
            alg.reduce_scatter(c, src.array, out.array, kern)
        else:
            fast(c, src.array, out.array)
        finalize(op, out.array, c.size, out.dtype)

    return g.run(
        "reduce_scatter_tensor",
        after(run, (out,)),
        async_op=async_op,
        timeout=timeout,
        signature=("reduce_scatter", _dname(out.dtype), out.numel, op.name),
    )


def _lists_key(outs: Any, ins: Any, group: Any, async_op: bool, timeout: Any) -> Any:
    """The plan key of a list-form all_to_all of numpy arrays of one dtype (by their shapes), or None."""
    if async_op or timeout is not None or _FORCE or type(outs) is not list or type(ins) is not list or not ins:
        return None
    dt = ins[0].dtype if type(ins[0]) is _ndarray else None
    for x in ins + outs:
        if type(x) is not _ndarray or x.dtype != dt:
            return None
    return (plans.A2AL, dt, tuple([x.shape for x in outs]), tuple([x.shape for x in ins]))


def _run_lists(key: Any, outs: List[Any], ins: List[Any], group: Any) -> bool:
    """Run the planned list-form all_to_all of ``key``; False when there is none or the arrays need the general
    path (then nothing has happened)."""
    pg = _state.default if group is None else group
    if type(pg) is not ProcessGroup or pg._rank < 0:
        return False
    plan = pg.plans.get(key)
    if plan is None:
        return False
    for x in outs:
        if not ((fl := x.flags).c_contiguous and fl.writeable):
            return False
    for x in ins:
        if not x.flags.c_contiguous:
            return False
    return pg.run_plan(plan, tuple(ins), tuple(outs)) is not SLOW


def _via_buffers(c: Any, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], work: Any) -> None:
    """The list form through two scratch buffers: the inputs concatenated, ``work(c, sbuf, rbuf)``, the outputs
    cut out of ``rbuf``."""
    npdt = ins[0].dtype
    ns = sum(x.size for x in ins)
    sbuf = c.scratch(ns * npdt.itemsize, slot=API_SLOT_A).view(npdt)
    rbuf = c.scratch(sum(x.size for x in outs) * npdt.itemsize, slot=API_SLOT_B).view(npdt)
    pos = 0
    for x in ins:
        sbuf[pos : pos + x.size] = x.reshape(-1)
        pos += x.size
    work(c, sbuf, rbuf)
    pos = 0
    for x in outs:
        x.reshape(-1)[...] = rbuf[pos : pos + x.size]
        pos += x.size


def _lists_general(c: Any, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
    """A planned list-form call that the compiled path did not take: the general path's work."""
    sc, rc = [x.size for x in ins], [x.size for x in outs]
    _via_buffers(c, ins, outs, lambda c, s, r: alg.all_to_all(c, s, sc, r, rc, lists=True))


def _lists_after(c: Any, f: int, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], prep: Any, lim: int) -> None:
    """What the compiled list-form call left (its flags ``f``, see ``alltoall_shm.native_done``)."""
    if f & 4:  # finished in Python from the slots: through the buffers of the single form, same layout
        _via_buffers(c, ins, outs, lambda c, s, r: native_done(c, f, s, r, prep, lim))
    elif f & 2:
        c.arena.big.turn += 1


def all_to_all(
    output_tensor_list: List[Any],
    input_tensor_list: List[Any],
    group: Any = None,
    async_op: bool = False,
    timeout: Any = None,
) -> Optional[Work]:
    """``input_tensor_list[j]`` of rank i lands in ``output_tensor_list[i]`` of rank j."""
    key = _lists_key(output_tensor_list, input_tensor_list, group, async_op, timeout)
    if key is not None and _run_lists(key, output_tensor_list, input_tensor_list, group):
        return None
    g = _group(group, "all_to_all")
    if g is None:
        return None
    n = g.size()
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ConfigError(
            f"all_to_all: both lists need {n} tensors (one per rank), got {len(output_tensor_list)} outputs "
            f"and {len(input_tensor_list)} inputs"
        )
    try:
        ins = [as_flat(t, f"input_tensor_list[{i}]", writable=False) for i, t in enumerate(input_tensor_list)]
    except DeviceTensorError as e:
        return device_ops(g, e).all_to_all(g, output_tensor_list, input_tensor_list, async_op, timeout)
    outs = [as_flat(t, f"output_tensor_list[{i}]") for i, t in enumerate(output_tensor_list)]
    dt = ins[0].dtype
    for i, f in enumerate(ins + outs):
        if f.dtype != dt:
            raise ConfigError(f"all_to_all: every tensor must have dtype {dt}; tensor {i} has {f.dtype}")
    scounts = [f.numel for f in ins]
    rcounts = [f.numel for f in outs]
    eng = g.world.engine
    fast = eng.all_to_all(g, dt) if eng is not None else None
    a2a = fast or alg.all_to_all
    if key is not None and fast is None and all(f.back is None for f in ins + outs):
        plan = plans.all_to_all_list(
            g, _dname(dt), scounts, rcounts, ins[0].array.itemsize, _lists_general, _lists_after
        )
        if plan is not None:
            plans.remember(g, key, plan)

    def run(c: Any) -> None:
        # select's all_to_all with the list form's streams' limit (lists=True), as its plan's (all_to_all_list)
        kw = {} if fast else {"lists": True}
        _via_buffers(
            c, [f.array for f in ins], [f.array for f in outs], lambda c, s, r: a2a(c, s, scounts, r, rcounts, **kw)
        )

    return g.run(
        "all_to_all", after(run, outs), async_op=async_op, timeout=timeout, signature=("all_to_all", _dname(dt))
    )


def _splits(op: str, f: Flat, sizes: Optional[Sequence[int]], n: int, what: str) -> List[int]:
    rows = f.shape[0] if f.shape else 1
    row = f.numel // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise ConfigError(
                f"{op}: {what} has {rows} rows (dim 0), not divisible by the group size {n}; pass {what}_split_sizes"
            )
        return [rows // n * row] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ConfigError(
            f"{op}: {what}_split_sizes={sizes} must have {n} non-negative entries summing to dim 0 of the "
            f"{what} ({rows})"
        )
    return [s * row for s in sizes]


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: Any = None,
    async_op: bool = False,
    timeout: Any = None,
) -> Optional[Work]:  # noqa: A002
    """All-to-all of one tensor split along dim 0 (equal parts, or the given split sizes)."""
    key = None
    if output_split_sizes is None and input_split_sizes is None:  # equal parts: the shapes say it all
        key = _two_array_key(plans.A2A, output, input, None, group, async_op, timeout)
        if key is not None and _run_two(key, output, input, group):
            return None
    g = _group(group, "all_to_all_single")
    if g is None:
        return None
    try:
        out = as_flat(output, "all_to_all_single output")
    except DeviceTensorError as e:
        dev = device_ops(g, e)
        return dev.all_to_all_single(g, output, input, output_split_sizes, input_split_sizes, async_op, timeout)
    src = as_flat(input, "all_to_all_single input", writable=False)
    if out.dtype != src.dtype:
        raise ConfigError(f"all_to_all_single: output dtype {out.dtype} differs from input dtype {src.dtype}")
    sc = _splits("all_to_all_single", src, input_split_sizes, g.size(), "input")
    rc = _splits("all_to_all_single", out, output_split_sizes, g.size(), "output")
    eng = g.world.engine
    fast = eng.all_to_all(g, src.dtype) if eng is not None else None
    a2a = fast or alg.all_to_all
    if key is not None and out.back is None and src.back is None:
        plans.remember(g, key, plans.all_to_all(g, _dname(src.dtype), sc, rc, fast, src.array.itemsize))
    return g.run(
        "all_to_all_single",
        after(lambda c: a2a(c, src.array, sc, out.array, rc), (out,)),
        async_op=async_op,
        timeout=timeout,
        signature=("all_to_all", _dname(src.dtype)),
    )


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None) -> Optional[Work]:
    """Return once every member has entered the barrier (a Work when ``async_op``)."""
    planned = not async_op and timeout is None and not _FORCE
    if planned:
        pg = _state.default if group is None else group
        if type(pg) is ProcessGroup and pg._rank >= 0:
            plan = pg.plans.get(_BARRIER)
            if plan is not None and pg.run_plan(plan) is not SLOW:
                return None
    g = _group(group, "barrier")
    if g is None:
        return None
    eng = g.world.engine
    if device_ids and eng is not None and eng.device_types:  # torch's barrier(device_ids=[i]): on that device
        return eng.device_ops.barrier(g, device_ids, async_op, timeout)
    fast = eng.barrier(g) if eng is not None else None
    fn = fast or alg.barrier
    if planned:
        plans.remember(g, _BARRIER, plans.barrier(g, fast))
    return g.run("barrier", fn, async_op=async_op, timeout=timeout, signature=("barrier",))
