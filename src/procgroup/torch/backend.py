"""``ProcgroupBackend``: a ``torch.distributed.ProcessGroup`` whose collectives run over procgroup.

torch builds one per process group (``init_process_group("procgroup")``, ``new_group(backend="procgroup")``)
through :func:`create_backend`, handing it the group's store (a ``PrefixStore`` over the job's one store), its
rank, size and timeout.  The backend forms one procgroup world over that store (no second port) and serves
torch's operations with procgroup's collectives, in place on the caller's tensors:

* CPU tensors of the common dtypes run natively (shared memory within a host, TCP across);
* tensors on another device go to that device's torch backend, built lazily over the same store
  (``cuda`` -> ``nccl`` by default; :class:`Options` ``device_backends`` changes the map);
* anything else (sparse tensors, dtypes procgroup does not reduce, ``PREMUL_SUM``...)
  falls through to a gloo backend built lazily on the same store; each kind of op is logged once.

A deadline or a dead peer raises procgroup's error (naming the op, rank and peer) instead of hanging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions as _AllgatherOptions

from . import _core
from ._delegate import NATIVE_DTYPES as NATIVE_DTYPES  # noqa: PLC0414 - its old home
from ._delegate import Delegation
from ._fast import DoneWork, DoneWorks, GatherScratch, ViewCache, op_of, reduce_op
from ._store import TorchStoreAdapter
from ._work import Executor, P2PWork, Work, seconds

__all__ = ["BACKEND_NAME", "Options", "ProcgroupBackend", "create_backend"]

logger = logging.getLogger("procgroup.torch")

#: the name torch knows this backend by
BACKEND_NAME = "procgroup"

#: an options object's timeout at or below this is "unset" (torch uses -1 ms)
_NO_TIMEOUT = timedelta(0)

_C = _core.collectives


@dataclass
class Options:
    """procgroup's process-group options (``init_process_group(..., pg_options=Options(...))``).

    ``device_backends``: torch backend that carries tensors of each non-CPU device type (default
    ``{"cuda": "nccl"}``); mapping ``"cpu"`` too sends CPU tensors there instead of procgroup.
    ``fallback``: torch backend for what procgroup does not serve natively (``"gloo"``).
    """

    device_backends: Dict[str, str] = field(default_factory=lambda: {"cuda": "nccl"})
    fallback: str = "gloo"


def _contiguous(tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], Callable[[], None]]:
    """Contiguous stand-ins for ``tensors`` and a function copying them back (gloo's behaviour)."""
    bufs: List[torch.Tensor] = []
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for t in tensors:
        if t.is_contiguous():
            bufs.append(t)
        else:
            c = t.contiguous()
            bufs.append(c)
            pairs.append((t, c))

    def back() -> None:
        for t, c in pairs:
            t.copy_(c)

    return bufs, back


def _flat(seq: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    for x in seq:
        if isinstance(x, (list, tuple)):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out


class ProcgroupBackend(Delegation, dist.ProcessGroup):
    """A torch process group served by procgroup (see the module docstring).

    ``store``: torch's store for this group; ``rank``/``size``: this rank and the group size; ``timeout``:
    the default deadline of every op (timedelta or seconds).  Construction is collective: it returns when
    all ``size`` members have formed the procgroup world, or raises procgroup's rendezvous timeout error.
    Every op method takes torch's arguments (lists of tensors, an options object) and returns a Work.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: Any = None,
        *,
        options: Optional[Options] = None,
        name: str = "",
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the store form is not subclassable in torch 2.13)
        self._store = store
        self._rank = int(rank)
        self._size = int(size)
        self._timeout = seconds(timeout) or 1800.0
        self._options = options if isinstance(options, Options) else Options()
        self._cpu_native = "cpu" not in self._options.device_backends
        self._group_name = name
        self._group_desc = ""
        # a generation per formation: a later group over the same store (destroy, then init again) never
        # reads the keys of an earlier one
        base = dist.PrefixStore("procgroup/", store)
        self._gen = gen = base.add(f"generation/{self._rank}", 1)
        adapter = TorchStoreAdapter(dist.PrefixStore(f"{gen}/", base), self._timeout)
        self._pg = _core.create_group(
            name or "torch", store=adapter, rank=self._rank, world_size=self._size, timeout=self._timeout
        )
        self._exec = Executor(name or "torch")
        self._views = ViewCache()  # numpy views of the tensors of blocking one-tensor calls
        self._gather = GatherScratch()  # the list-form all_gather's buffer
        self._done = DoneWorks("blocking op")  # the completed Work those calls return, reused when unreferenced
        self._others: Dict[str, Any] = {}  # backend name -> torch Backend built underneath
        #: op name -> how many calls fell through to the fallback backend (for tests and diagnostics)
        self.fallthrough_counts: Dict[str, int] = {}
        self._closed = False

    # -- identity ----------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"procgroup"``."""
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        """The group name torch assigned."""
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Called by torch once the group is registered."""
        self._group_name = name
        _core.rename_group(self._pg, f"torch group {name}")

    def getGroupDesc(self) -> str:  # noqa: N802
        """The group description torch assigned."""
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Called by torch once the group is registered."""
        self._group_desc = desc

    @property
    def procgroup(self) -> Any:
        """procgroup's own ProcessGroup under this torch group (usable with ``procgroup``'s API)."""
        return self._pg

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default deadline of later ops."""
        t = seconds(timeout)
        if t is not None:
            self._timeout = t
            _core.set_group_timeout(self._pg, t)

    def __repr__(self) -> str:
        return f"ProcgroupBackend(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    def _blocking(self, opts: Any, tensors: Sequence[torch.Tensor]) -> Optional[List[Any]]:
        """The hot path of a blocking op (see _fast): numpy views of ``tensors``, or None for the general path."""
        if opts.asyncOp or not self._cpu_native or self._closed:
            return None
        views = []
        for t in tensors:
            v = self._views.view(t)
            if v is None:
                return None
            views.append(v)
        if self._exec.busy():
            self._exec.drain()
        return views

    def _op_timeout(self, opts: Any) -> Optional[float]:
        """The options object's timeout in seconds, or None when unset (the group's default applies)."""
        t = opts.timeout.total_seconds()
        return t if t > 0 else None

    def _run(
        self,
        op: str,
        result: List[Any],
        fn: Callable[[], Any],
        opts: Any,
        after: Optional[Callable[[], None]] = None,
        tmo: Optional[float] = None,
    ) -> Work:
        """Run ``fn`` (then ``after``) now, or on the executor when ``opts.asyncOp``; returns the Work.

        ``tmo``: the op's own deadline when it has one longer than the group's (bounds ``Work.wait()``).
        """
        if self._closed:
            raise _core.ProcGroupError(f"{op}: procgroup process group {self._group_name!r} was shut down")
        if not opts.asyncOp:
            ex = self._exec
            if ex.busy():
                ex.drain()
            fn()
            if after is not None:
                after()
            return DoneWork(op, result)
        work = Work(
            f"{op} (procgroup, rank {self._rank} of group {self._group_name!r})",
            result,
            max(tmo or 0.0, self._timeout) + 30.0,
        )

        def job() -> None:
            fn()
            if after is not None:
                after()

        return self._exec.submit(work, job)

    # -- collectives -------------------------------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # stubs differ
        """All-reduce each tensor in place (torch's ``dist.all_reduce``)."""
        opts = dist.AllreduceOptions() if opts is None else opts
        op = op_of(opts)
        if op is not None and not opts.asyncOp and len(tensors) == 1 and self._cpu_native and not self._closed:
            # the hot path: one CPU tensor, blocking (dist.all_reduce without async_op); see _fast
            arr = self._views.view(tensors[0])
            if arr is not None:
                if self._exec.busy():
                    self._exec.drain()
                to = opts.timeout
                _C.all_reduce(arr, op, self._pg, False, to.total_seconds() if to > _NO_TIMEOUT else None)
                return self._done.get(tensors)
        if op is None:
            op = reduce_op(opts.reduceOp)
        why = self._route(tensors) or (None if op is not None else "PREMUL_SUM")
        if why is not None or len(tensors) != 1:
            return self._other("allreduce", why or "a list of several tensors", tensors, opts)
        (buf,), back = _contiguous(tensors)
        tmo = self._op_timeout(opts)
        return self._run(
            "allreduce", tensors, lambda: _C.all_reduce(buf, op=op, group=self._pg, timeout=tmo), opts, back
        )

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """All-reduce several tensors in place as one message when they share a dtype."""
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        op = reduce_op(opts.reduceOp)
        why = self._route(tensors) or (None if op is not None else "PREMUL_SUM")
        if why is not None:
            return self._other("allreduce_coalesced", why, tensors, opts)
        tmo = self._op_timeout(opts)

        def fn() -> None:
            if len({t.dtype for t in tensors}) == 1 and tensors:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                _C.all_reduce(flat, op=op, group=self._pg, timeout=tmo)
                pos = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[pos : pos + n].view_as(t))
                    pos += n
                return
            for t in tensors:
                (b,), back = _contiguous([t])
                _C.all_reduce(b, op=op, group=self._pg, timeout=tmo)
                back()

        return self._run("allreduce_coalesced", tensors, fn, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # stubs differ
        """Broadcast the root's tensor into every rank's tensor, in place."""
        opts = dist.BroadcastOptions() if opts is None else opts
        vs = self._blocking(opts, tensors) if len(tensors) == 1 else None
        if vs is not None:
            _C.broadcast(vs[0], src=opts.rootRank, group=self._pg, timeout=self._op_timeout(opts))
            return self._done.get(tensors)
        why = self._route(tensors)
        if why is not None or len(tensors) != 1:
            return self._other("broadcast", why or "a list of several tensors", tensors, opts)
        (buf,), back = _contiguous(tensors)
        root, tmo = int(opts.rootRank), self._op_timeout(opts)
        return self._run(
            "broadcast", tensors, lambda: _C.broadcast(buf, src=root, group=self._pg, timeout=tmo), opts, back
        )

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]  # stubs differ
        """Reduce every rank's tensor into the root's tensor, in place."""
        opts = dist.ReduceOptions() if opts is None else opts
        op = op_of(opts)
        vs = self._blocking(opts, tensors) if len(tensors) == 1 and op is not None else None
        if vs is not None:
            _C.reduce(vs[0], dst=opts.rootRank, op=op, group=self._pg, timeout=self._op_timeout(opts))
            return self._done.get(tensors)
        op = op if op is not None else reduce_op(opts.reduceOp)
        why = self._route(tensors) or (None if op is not None else "PREMUL_SUM")
        if why is not None or len(tensors) != 1:
            return self._other("reduce", why or "a list of several tensors", tensors, opts)
        (buf,), back = _contiguous(tensors)
        root, tmo = int(opts.rootRank), self._op_timeout(opts)
        return self._run(
            "reduce", tensors, lambda: _C.reduce(buf, dst=root, op=op, group=self._pg, timeout=tmo), opts, back
        )

    def allgather(  # type: ignore[override]  # stubs differ
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """Gather every rank's input into ``output_tensors[0]`` (one tensor per rank) on every rank."""
        opts = _AllgatherOptions() if opts is None else opts
        if len(input_tensors) == 1 and len(output_tensors) == 1:
            vs = self._blocking(opts, [input_tensors[0], *output_tensors[0]])
            if vs is not None:
                tmo = self._op_timeout(opts)
                if not self._gather.all_gather(vs[1:], vs[0], self._pg, tmo):
                    _C.all_gather(vs[1:], vs[0], group=self._pg, timeout=tmo)
                return self._done.get(output_tensors)
        why = self._route(_flat(output_tensors) + list(input_tensors))
        if why is not None or len(input_tensors) != 1 or len(output_tensors) != 1:
            return self._other("allgather", why or "lists of several tensors", output_tensors, input_tensors, opts)
        outs, back = _contiguous(output_tensors[0])
        src, tmo = input_tensors[0], self._op_timeout(opts)
        return self._run(
            "allgather", output_tensors, lambda: _C.all_gather(outs, src, group=self._pg, timeout=tmo), opts, back
        )

    def allgather_coalesced(
        self, output_lists: List[List[torch.Tensor]], input_list: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """One all-gather per input tensor: ``output_lists[r][j]`` receives rank r's ``input_list[j]`` (torch's
        layout: the outer list is indexed by rank, the inner one by input tensor)."""
        opts = _AllgatherOptions() if opts is None else opts
        why = self._route(_flat(output_lists) + list(input_list))
        if why is not None:
            return self._other("allgather_coalesced", why, output_lists, input_list, opts)
        tmo = self._op_timeout(opts)

        def fn() -> None:
            for j, src in enumerate(input_list):
                bufs, back = _contiguous([per_rank[j] for per_rank in output_lists])
                _C.all_gather(bufs, src, group=self._pg, timeout=tmo)
                back()

        return self._run("allgather_coalesced", output_lists, fn, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """All-gather into one tensor: rank r's input lands in chunk r of ``output`` (all_gather_into_tensor)."""
        opts = _AllgatherOptions() if opts is None else opts
        vs = self._blocking(opts, (output, input))
        if vs is not None:
            _C.all_gather_into_tensor(vs[0], vs[1], group=self._pg, timeout=self._op_timeout(opts))
            return self._done.get([output])
        why = self._route([output, input])
        if why is not None:
            return self._other("all_gather_single", why, output, input, opts)
        (buf,), back = _contiguous([output])
        tmo = self._op_timeout(opts)
        return self._run(
            "all_gather_single",
            [output],
            lambda: _C.all_gather_into_tensor(buf, input, group=self._pg, timeout=tmo),
            opts,
            back,
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """torch's older name of :meth:`all_gather_single`."""
        return self.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """:meth:`all_gather_single` for each (output, input) pair, as one Work."""
        opts = _AllgatherOptions() if opts is None else opts
        return self._pairs("all_gather_single", outputs, inputs, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """torch's older name of :meth:`all_gather_single_coalesced`."""
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def _pairs(self, single: str, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any) -> Any:
        """Run the single-tensor op ``single`` on each pair; natively as one Work when procgroup serves all."""
        if self._route(list(outputs) + list(inputs)) is not None:
            works = [getattr(self, single)(o, i, opts) for o, i in zip(outputs, inputs)]
            for w in works:
                w.wait()
            done = Work(single + "_coalesced", list(outputs), 1.0)
            done.complete()
            return done
        tmo = self._op_timeout(opts)
        op = reduce_op(opts.reduceOp) if hasattr(opts, "reduceOp") else None

        def fn() -> None:
            for o, i in zip(outputs, inputs):
                (b,), back = _contiguous([o])
                if single == "all_gather_single":
                    _C.all_gather_into_tensor(b, i, group=self._pg, timeout=tmo)
                else:
                    _C.reduce_scatter_tensor(b, i, op=op, group=self._pg, timeout=tmo)
                back()

        return self._run(single + "_coalesced", list(outputs), fn, opts)

    def gather(  # type: ignore[override]  # stubs differ
        self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """Gather every rank's input into the root's ``output_tensors[0]``."""
        opts = dist.GatherOptions() if opts is None else opts
        why = self._route(_flat(output_tensors) + list(input_tensors))
        if why is not None or len(input_tensors) != 1:
            return self._other("gather", why or "lists of several tensors", output_tensors, input_tensors, opts)
        root, tmo = int(opts.rootRank), self._op_timeout(opts)
        outs, back = _contiguous(output_tensors[0] if self._rank == root and output_tensors else [])
        return self._run(
            "gather",
            output_tensors,
            lambda: _C.gather(
                input_tensors[0], outs if self._rank == root else None, dst=root, group=self._pg, timeout=tmo
            ),
            opts,
            back,
        )

    def scatter(  # type: ignore[override]  # stubs differ
        self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        """Scatter the root's ``input_tensors[0]`` (one tensor per rank) into each rank's output."""
        opts = dist.ScatterOptions() if opts is None else opts
        why = self._route(list(output_tensors) + _flat(input_tensors))
        if why is not None or len(output_tensors) != 1:
            return self._other("scatter", why or "lists of several tensors", output_tensors, input_tensors, opts)
        root, tmo = int(opts.rootRank), self._op_timeout(opts)
        (buf,), back = _contiguous(output_tensors)
        ins = list(input_tensors[0]) if self._rank == root and input_tensors else None
        return self._run(
            "scatter", output_tensors, lambda: _C.scatter(buf, ins, src=root, group=self._pg, timeout=tmo), opts, back
        )

    def reduce_scatter(  # type: ignore[override]  # stubs differ
        self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any = None
    ) -> Any:
        """Reduce the inputs (one list per rank) and leave chunk r of the result in rank r's output."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        op = reduce_op(opts.reduceOp)
        why = self._route(list(output_tensors) + _flat(input_tensors)) or (None if op is not None else "PREMUL_SUM")
        if why is not None or len(output_tensors) != 1:
            return self._other("reduce_scatter", why or "lists of several tensors", output_tensors, input_tensors, opts)
        (buf,), back = _contiguous(output_tensors)
        ins, tmo = list(input_tensors[0]), self._op_timeout(opts)
        return self._run(
            "reduce_scatter",
            output_tensors,
            lambda: _C.reduce_scatter(buf, ins, op=op, group=self._pg, timeout=tmo),
            opts,
            back,
        )

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """Reduce ``input`` across ranks; rank r keeps chunk r in ``output`` (reduce_scatter_tensor)."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        op = op_of(opts)
        vs = self._blocking(opts, (output, input)) if op is not None else None
        if vs is not None:
            _C.reduce_scatter_tensor(vs[0], vs[1], op=op, group=self._pg, timeout=self._op_timeout(opts))
            return self._done.get([output])
        op = op if op is not None else reduce_op(opts.reduceOp)
        why = self._route([output, input]) or (None if op is not None else "PREMUL_SUM")
        if why is not None:
            return self._other("reduce_scatter_single", why, output, input, opts)
        (buf,), back = _contiguous([output])
        tmo = self._op_timeout(opts)
        return self._run(
            "reduce_scatter_single",
            [output],
            lambda: _C.reduce_scatter_tensor(buf, input, op=op, group=self._pg, timeout=tmo),
            opts,
            back,
        )

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        """torch's older name of :meth:`reduce_scatter_single`."""
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """:meth:`reduce_scatter_single` for each (output, input) pair, as one Work."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        if reduce_op(opts.reduceOp) is None:
            return self._other("reduce_scatter_tensor_coalesced", "PREMUL_SUM", outputs, inputs, opts)
        return self._pairs("reduce_scatter_single", outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None
    ) -> Any:
        """torch's older name of :meth:`reduce_scatter_single_coalesced`."""
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """Send ``input_tensors[r]`` to rank r; receive rank r's into ``output_tensors[r]``."""
        opts = dist.AllToAllOptions() if opts is None else opts
        why = self._route(list(output_tensors) + list(input_tensors))
        if why is not None:
            return self._other("alltoall", why, output_tensors, input_tensors, opts)
        outs, back = _contiguous(output_tensors)
        tmo = self._op_timeout(opts)
        return self._run(
            "alltoall",
            output_tensors,
            lambda: _C.all_to_all(outs, list(input_tensors), group=self._pg, timeout=tmo),
            opts,
            back,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: Optional[List[int]] = None,
        input_split_sizes: Optional[List[int]] = None,
        opts: Any = None,
    ) -> Any:
        """All-to-all over dim 0 of one tensor, with optional split sizes (empty or None: equal splits)."""
        opts = dist.AllToAllOptions() if opts is None else opts
        why = self._route([output, input])
        if why is not None:
            return self._other(
                "all_to_all_single",
                why,
                output,
                input,
                list(output_split_sizes or []),
                list(input_split_sizes or []),
                opts,
            )
        (buf,), back = _contiguous([output])
        osz = list(output_split_sizes) if output_split_sizes else None
        isz = list(input_split_sizes) if input_split_sizes else None
        tmo = self._op_timeout(opts)
        return self._run(
            "all_to_all_single",
            [output],
            lambda: _C.all_to_all_single(
                buf, input, output_split_sizes=osz, input_split_sizes=isz, group=self._pg, timeout=tmo
            ),
            opts,
            back,
        )

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: Optional[List[int]] = None,
        input_split_sizes: Optional[List[int]] = None,
        opts: Any = None,
    ) -> Any:
        """torch's older name of :meth:`all_to_all_single`."""
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any = None) -> Any:
        """Return once every member has entered the barrier."""
        opts = dist.BarrierOptions() if opts is None else opts
        dev = getattr(getattr(opts, "device", None), "type", "cpu") or "cpu"
        if dev in self._options.device_backends:
            return self._other("barrier", "device:" + dev, opts)
        tmo = self._op_timeout(opts)
        return self._run("barrier", [], lambda: _C.barrier(group=self._pg, timeout=tmo), opts, tmo=tmo)

    # -- coalescing (torch's _coalescing_manager with a device) ---------------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        """Nothing to set up: procgroup runs the ops of the block as they come, in order."""

    def _end_coalescing(self, device: Any = None) -> Work:
        """A Work completed once every op issued so far on this group has finished."""
        work = Work(f"coalesced block (procgroup, group {self._group_name!r})", [], self._timeout + 30.0)
        return self._exec.submit(work, lambda: None)

    def start_coalescing(self, device: Any = None) -> None:
        """torch's newer name of :meth:`_start_coalescing`."""
        self._start_coalescing(device)

    def end_coalescing(self, device: Any = None) -> Work:
        """torch's newer name of :meth:`_end_coalescing`."""
        return self._end_coalescing(device)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """torch's monitored barrier, served by procgroup (:func:`procgroup.monitored_barrier`, torch's wording).

        Rank 0 raises ``Rank N failed to pass monitoredBarrier ...`` naming the first rank that did not arrive
        within ``timeout`` (every one with ``wait_all_ranks``); the ranks that arrived raise ``... received errors
        while waiting for send/recv from rank 0``.  ``torch.distributed.monitored_barrier`` reaches it too
        (:mod:`procgroup.torch._monitored` lets procgroup groups past torch's check for the name "gloo").
        """
        from .. import debug

        self._exec.drain()
        t = self._timeout if timeout is None else timeout  # timedelta(0) is a zero timeout here, as in gloo
        debug.monitored_barrier(self._pg, t.total_seconds() if isinstance(t, timedelta) else t, wait_all_ranks)

    # -- point-to-point ----------------------------------------------------------------------------
    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803 - torch's names
        """Send ``tensors[0]`` to rank ``dstRank`` (returns at once; the Work completes when delivered)."""
        why = self._route(tensors)
        if why is not None or len(tensors) != 1:
            return self._other_p2p("send", why or "a list of several tensors", tensors, dstRank, tag)
        inner = _C.isend(tensors[0], dst=int(dstRank), group=self._pg, tag=int(tag))
        return P2PWork(f"send to rank {dstRank} (procgroup)", list(tensors), inner, self._timeout + 30.0)

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        """Receive into ``tensors[0]`` from rank ``srcRank``."""
        return self._recv(tensors, int(srcRank), tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        """Receive into ``tensors[0]`` from whichever rank sends first; the Work's source_rank() names it."""
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: List[torch.Tensor], src: Optional[int], tag: int) -> Any:
        why = self._route(tensors)
        if why is not None or len(tensors) != 1:
            if src is None:
                return self._other_p2p("recv_anysource", why or "a list of several tensors", tensors, tag)
            return self._other_p2p("recv", why or "a list of several tensors", tensors, src, tag)
        (buf,), back = _contiguous(tensors)
        inner = _C.irecv(buf, src=src, group=self._pg, tag=int(tag))
        what = "any rank" if src is None else f"rank {src}"
        return P2PWork(f"recv from {what} (procgroup)", list(tensors), inner, self._timeout + 30.0, back)

    # -- lifetime ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the procgroup world (transports, shared memory) and any backend built underneath."""
        if self._closed:
            return
        self._closed = True
        self._exec.close()
        for b in self._others.values():
            try:
                b.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down; report and go on
                logger.info("procgroup.torch: shutting down %s: %s", type(b).__name__, e)
        self._others.clear()
        _core.close_group(self._pg)

    def abort(self) -> None:
        """Like :meth:`shutdown` (procgroup's transports abort pending operations when closed)."""
        self.shutdown()


def create_backend(
    store_or_opts: Any, rank_or_options: Any = None, world_size: Optional[int] = None, timeout: Any = None
) -> ProcgroupBackend:
    """The factory torch calls for every group using this backend.

    Two forms: torch's extended API ``create_backend(dist_backend_options, pg_options)`` (the backend
    registers this one: it also gets the group name), or ``create_backend(store, rank, world_size, timeout)``.
    Collective over the group's members; see :class:`ProcgroupBackend`.
    """
    if world_size is None:
        o = store_or_opts
        opts = rank_or_options if isinstance(rank_or_options, Options) else None
        return ProcgroupBackend(
            o.store, o.group_rank, o.group_size, o.timeout, options=opts, name=str(getattr(o, "group_id", "") or "")
        )
    return ProcgroupBackend(store_or_opts, int(rank_or_options), int(world_size), timeout)
