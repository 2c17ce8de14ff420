"""The API's collectives and point-to-point ops for device tensors: what ``World.engine.device_ops`` runs.

:mod:`procgroup.collectives` and :mod:`procgroup.p2p` hand a call here when its tensor is on the engine's
device (``arguments.device_ops``).  Each call runs inside :meth:`ProcessGroup.run` like a CPU call (sequence
number, flight record, deadline, error context, ``async_op`` Work), with a signature that carries the device
("device=cuda"): members passing CPU data to a call that others pass device tensors to never pair, and the
watchdog reports the mismatch on every member.  Data movement (broadcast, gathers, scatter, all-to-all,
p2p) is carried as bytes, so every dtype works; reductions take the tensor's dtype: SUM, PRODUCT, MIN, MAX
and AVG (a SUM divided here, as the cpu backend does; integer AVG is a ConfigError there too).  NCCL has no
bitwise reductions: BAND, BOR and BXOR raise ConfigError.  Non-contiguous tensors run on a contiguous copy
that is copied back, as on the CPU.  Sync calls return once the result is complete on the device.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ...errors import ConfigError
from ...ops import ReduceOp
from ...transport.base import ANY_SOURCE
from ._works import TorchRequest, pollable

__all__ = ["DeviceOps"]

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # divided afterwards
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}
#: bool reductions as uint8 ones (SUM of bools is a logical or, PRODUCT a logical and, as on the cpu backend)
_BOOL_OPS = {
    ReduceOp.SUM: dist.ReduceOp.MAX,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.MIN,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


def _dname(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _noop() -> None:
    return None


class DeviceOps:
    """The collectives of :mod:`procgroup.collectives` for tensors on ``engine``'s device (see the module)."""

    def __init__(self, engine: Any) -> None:
        self.eng = engine
        self.dev = engine.device_type
        self.sig = f"device={engine.device_type}"

    # -- arguments --------------------------------------------------------------------------------
    def _tensor(self, t: Any, name: str, op: str, device: Any = None) -> Any:
        """``t`` checked: a strided torch tensor on this engine's device (``device``: that very one)."""
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"{op}: {name} is a {type(t).__name__}; with {self.dev} tensors every tensor of the "
                f"call must be a torch tensor on {self.dev}"
            )
        if t.device.type != self.dev or (device is not None and t.device != device):
            want = device if device is not None else self.dev
            raise ConfigError(
                f"{op}: {name} is on {t.device} but the call's first tensor is on {want}: every "
                "tensor of one call must be on the same device (move it with .to(device))"
            )
        if t.layout is not torch.strided:
            raise ConfigError(f"{op}: {name} is a {t.layout} tensor; {self.eng.kind} takes dense tensors (.to_dense())")
        return t

    @staticmethod
    def _flat(t: Any, writable: bool = True) -> tuple:
        """(a 1-D contiguous tensor sharing ``t``'s memory or a copy of it, the copy back or a no-op)."""
        d = t.detach()
        if d.is_contiguous() and not d.is_conj() and not d.is_neg():
            return d.view(-1), _noop
        c = d.resolve_conj().resolve_neg().contiguous().view(-1)
        if not writable:
            return c, _noop

        def back() -> None:
            with torch.no_grad():
                t.copy_(c.view(t.shape))

        return c, back

    @staticmethod
    def _bytes(x: Any) -> Any:
        """A 1-D contiguous tensor's memory as uint8 (data movement works for every dtype)."""
        return x.view(torch.uint8) if x.dtype is not torch.uint8 and x.numel() else x.view(-1)

    def _reduce_op(self, op: ReduceOp, t: Any, name: str) -> Any:
        """torch's reduce op for ``op`` on ``t``'s dtype, and the view of the buffer it takes."""
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            raise ConfigError(
                f"{name}: ReduceOp.{op.name} on {self.dev} tensors: NCCL has no bitwise reductions; reduce a CPU "
                f"copy (tensor.cpu()) with procgroup's cpu path, or use another op"
            )
        if t.dtype is torch.bool:
            if op is ReduceOp.AVG:
                raise ConfigError(f"{name}: ReduceOp.AVG of bool tensors is undefined; convert to a float dtype")
            return _BOOL_OPS[op]
        if op is ReduceOp.AVG and not (t.dtype.is_floating_point or t.dtype.is_complex):
            raise ConfigError(
                f"{name}: ReduceOp.AVG of {_dname(t)} tensors: integer AVG is undefined (as on the cpu backend); "
                "use SUM and divide, or a float dtype"
            )
        return _TORCH_OPS[op]

    @staticmethod
    def _as_reduced(x: Any) -> Any:
        return x.view(torch.uint8) if x.dtype is torch.bool else x

    def _what(self, op: str, g: Any, t: Any) -> Callable[[], str]:
        return lambda: f"{op} of {_dname(t)}[{t.numel()}] on {t.device} in group {g.name}"

    def _run(self, g: Any, op: str, fn: Callable[[Any], None], async_op: bool, timeout: Any, sig: tuple) -> Any:
        return g.run(op, fn, async_op=async_op, timeout=timeout, signature=sig + (self.sig,))

    def _finish(
        self,
        g: Any,
        c: Any,
        device: Any,
        what: Callable[[], str],
        backs: Sequence[Callable[[], None]],
        queued: bool = True,
    ) -> None:
        """Copy results back into the caller's tensors, then wait until those copies have run on the device.

        ``queued``: the caller queued device work after the operation (a division, copies into outputs); when it
        did not and there is nothing to copy back, the operation's own completion was the last thing to wait for.
        """
        for b in backs:
            b()
        if queued or any(b is not _noop for b in backs):
            self.eng.settle(g, device, c.deadline, what)

    # -- collectives ------------------------------------------------------------------------------
    def broadcast(self, g: Any, tensor: Any, root: int, async_op: bool, timeout: Any) -> Any:
        """broadcast of a device tensor (``root``: group rank)."""
        t = self._tensor(tensor, "tensor", "broadcast")

        def run(c: Any) -> None:
            if not t.numel():
                return
            x, back = self._flat(t)
            what = self._what("broadcast", g, t)
            b = self.eng.backend(g, c, t.device, "broadcast")
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            self.eng.wait(g, b.broadcast([self._bytes(x)], opts), c.deadline, what)
            self._finish(g, c, t.device, what, (back,), queued=False)

        return self._run(g, "broadcast", run, async_op, timeout, ("broadcast", _dname(t), t.numel(), f"root={root}"))

    def all_reduce(self, g: Any, tensor: Any, op: ReduceOp, async_op: bool, timeout: Any) -> Any:
        """all_reduce of a device tensor."""
        t = self._tensor(tensor, "tensor", "all_reduce")
        red = self._reduce_op(op, t, "all_reduce")

        def run(c: Any) -> None:
            if not t.numel():
                return
            x, back = self._flat(t)
            what = self._what("all_reduce", g, t)
            b = self.eng.backend(g, c, t.device, "all_reduce")
            opts = dist.AllreduceOptions()
            opts.reduceOp = red
            self.eng.wait(g, b.allreduce([self._as_reduced(x)], opts), c.deadline, what)
            if op is ReduceOp.AVG:
                x.div_(c.size)
            self._finish(g, c, t.device, what, (back,), queued=op is ReduceOp.AVG)

        return self._run(g, "all_reduce", run, async_op, timeout, ("all_reduce", _dname(t), t.numel(), op.name))

    def reduce(self, g: Any, tensor: Any, root: int, op: ReduceOp, async_op: bool, timeout: Any) -> Any:
        """reduce of a device tensor into group rank ``root``'s."""
        t = self._tensor(tensor, "tensor", "reduce")
        red = self._reduce_op(op, t, "reduce")

        def run(c: Any) -> None:
            if not t.numel():
                return
            x, back = self._flat(t)
            what = self._what("reduce", g, t)
            b = self.eng.backend(g, c, t.device, "reduce")
            opts = dist.ReduceOptions()
            opts.reduceOp, opts.rootRank, opts.rootTensor = red, root, 0
            self.eng.wait(g, b.reduce([self._as_reduced(x)], opts), c.deadline, what)
            avg = op is ReduceOp.AVG and c.rank == root
            if avg:
                x.div_(c.size)
            self._finish(g, c, t.device, what, (back,), queued=avg)

        sig = ("reduce", _dname(t), t.numel(), op.name, f"root={root}")
        return self._run(g, "reduce", run, async_op, timeout, sig)

    def _same(self, op: str, a: Any, b: Any, what_b: str, factor: int = 1) -> None:
        self._tensor(b, what_b, op, a.device)
        if a.dtype != b.dtype:
            raise ConfigError(f"{op}: the input has dtype {_dname(a)} but {what_b} has {_dname(b)}; they must match")
        if a.numel() * factor != b.numel():
            raise ConfigError(f"{op}: {what_b} has {b.numel()} elements but must have {a.numel() * factor}")

    def all_gather(self, g: Any, tensor_list: List[Any], tensor: Any, async_op: bool, timeout: Any) -> Any:
        """all_gather of device tensors into ``tensor_list``."""
        t = self._tensor(tensor, "the input", "all_gather")
        n = g.size()
        if len(tensor_list) != n:
            raise ConfigError(f"all_gather: tensor_list has {len(tensor_list)} entries but the group has {n} ranks")
        for i, o in enumerate(tensor_list):
            self._same("all_gather", t, o, f"tensor_list[{i}]")

        def run(c: Any) -> None:
            k = t.numel()
            if not k:
                return
            x, _ = self._flat(t, writable=False)
            what = self._what("all_gather", g, t)
            buf = torch.empty(n * k, dtype=t.dtype, device=t.device)
            b = self.eng.backend(g, c, t.device, "all_gather")
            self.eng.wait(
                g, b._allgather_base(self._bytes(buf), self._bytes(x), c10d.AllgatherOptions()), c.deadline, what
            )
            with torch.no_grad():
                for i, o in enumerate(tensor_list):
                    o.copy_(buf[i * k : (i + 1) * k].view(o.shape))
            self._finish(g, c, t.device, what, ())

        return self._run(g, "all_gather", run, async_op, timeout, ("all_gather", _dname(t), t.numel()))

    def all_gather_into_tensor(self, g: Any, out: Any, inp: Any, async_op: bool, timeout: Any) -> Any:
        """all_gather_into_tensor of device tensors."""
        t = self._tensor(inp, "the input", "all_gather_into_tensor")
        self._same("all_gather_into_tensor", t, out, "the output", g.size())

        def run(c: Any) -> None:
            if not t.numel():
                return
            x, _ = self._flat(t, writable=False)
            y, back = self._flat(out)
            what = self._what("all_gather_into_tensor", g, t)
            b = self.eng.backend(g, c, t.device, "all_gather_into_tensor")
            w = b._allgather_base(self._bytes(y), self._bytes(x), c10d.AllgatherOptions())
            self.eng.wait(g, w, c.deadline, what)
            self._finish(g, c, t.device, what, (back,))

        return self._run(g, "all_gather_into_tensor", run, async_op, timeout, ("all_gather", _dname(t), t.numel()))

    def gather(
        self, g: Any, tensor: Any, gather_list: Optional[List[Any]], root: int, async_op: bool, timeout: Any
    ) -> Any:
        """gather of device tensors into ``gather_list`` on group rank ``root``."""
        t = self._tensor(tensor, "the input", "gather")
        n, me = g.size(), g.rank()
        outs = list(gather_list or [])
        if me == root:
            if len(outs) != n:
                raise ConfigError(
                    f"gather: the destination rank needs gather_list with {n} tensors, got "
                    f"{None if gather_list is None else len(outs)}"
                )
            for i, o in enumerate(outs):
                self._same("gather", t, o, f"gather_list[{i}]")
        elif outs:
            raise ConfigError("gather: gather_list must be None or empty on ranks other than dst")

        def run(c: Any) -> None:
            if not t.numel():
                return
            x, _ = self._flat(t, writable=False)
            flats = [self._flat(o) for o in outs]
            what = self._what("gather", g, t)
            b = self.eng.backend(g, c, t.device, "gather")
            opts = dist.GatherOptions()
            opts.rootRank = root
            ys = [[self._bytes(y) for y, _ in flats]] if me == root else []
            self.eng.wait(g, b.gather(ys, [self._bytes(x)], opts), c.deadline, what)
            self._finish(g, c, t.device, what, [bk for _, bk in flats])

        return self._run(g, "gather", run, async_op, timeout, ("gather", _dname(t), t.numel(), f"root={root}"))

    def scatter(
        self, g: Any, tensor: Any, scatter_list: Optional[List[Any]], root: int, async_op: bool, timeout: Any
    ) -> Any:
        """scatter of ``scatter_list`` on group rank ``root`` into every member's device tensor."""
        t = self._tensor(tensor, "the output", "scatter")
        n, me = g.size(), g.rank()
        ins = list(scatter_list or [])
        if me == root:
            if len(ins) != n:
                raise ConfigError(
                    f"scatter: the source rank needs scatter_list with {n} tensors, got "
                    f"{None if scatter_list is None else len(ins)}"
                )
            for i, x in enumerate(ins):
                self._same("scatter", t, x, f"scatter_list[{i}]")
        elif ins:
            raise ConfigError("scatter: scatter_list must be None or empty on ranks other than src")

        def run(c: Any) -> None:
            if not t.numel():
                return
            y, back = self._flat(t)
            xs = [self._bytes(self._flat(x, writable=False)[0]) for x in ins]
            what = self._what("scatter", g, t)
            b = self.eng.backend(g, c, t.device, "scatter")
            opts = dist.ScatterOptions()
            opts.rootRank = root
            self.eng.wait(g, b.scatter([self._bytes(y)], [xs] if me == root else [], opts), c.deadline, what)
            self._finish(g, c, t.device, what, (back,))

        return self._run(g, "scatter", run, async_op, timeout, ("scatter", _dname(t), t.numel(), f"root={root}"))

    def _reduce_scatter(
        self, g: Any, op_name: str, out: Any, src: Callable[[], Any], op: ReduceOp, async_op: bool, timeout: Any
    ) -> Any:
        red = self._reduce_op(op, out, op_name)

        def run(c: Any) -> None:
            if not out.numel():
                return
            y, back = self._flat(out)
            x = src()
            what = self._what(op_name, g, out)
            b = self.eng.backend(g, c, out.device, op_name)
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = red
            # gloo's completes only inside wait(): pollable() waits for it in a thread (NCCL's polls as it is)
            w = pollable(self.eng.kind, b._reduce_scatter_base(self._as_reduced(y), self._as_reduced(x), opts))
            self.eng.wait(g, w, c.deadline, what)
            if op is ReduceOp.AVG:
                y.div_(c.size)
            self._finish(g, c, out.device, what, (back,))

        sig = ("reduce_scatter", _dname(out), out.numel(), op.name)
        return self._run(g, op_name, run, async_op, timeout, sig)

    def reduce_scatter(
        self, g: Any, output: Any, input_list: List[Any], op: ReduceOp, async_op: bool, timeout: Any
    ) -> Any:
        """reduce_scatter of ``input_list`` (one device tensor per member) into ``output``."""
        out = self._tensor(output, "the output", "reduce_scatter")
        if len(input_list) != g.size():
            raise ConfigError(
                f"reduce_scatter: input_list has {len(input_list)} tensors but the group has {g.size()} ranks"
            )
        for i, x in enumerate(input_list):
            self._same("reduce_scatter", out, x, f"input_list[{i}]")
        return self._reduce_scatter(
            g,
            "reduce_scatter",
            out,
            lambda: torch.cat([x.detach().reshape(-1) for x in input_list]),
            op,
            async_op,
            timeout,
        )

    def reduce_scatter_tensor(
        self,
        g: Any,
        output: Any,
        input: Any,
        op: ReduceOp,
        async_op: bool,  # noqa: A002
        timeout: Any,
    ) -> Any:
        """reduce_scatter_tensor of device tensors."""
        out = self._tensor(output, "the output", "reduce_scatter_tensor")
        self._same("reduce_scatter_tensor", out, input, "the input", g.size())
        return self._reduce_scatter(
            g, "reduce_scatter_tensor", out, lambda: self._flat(input, writable=False)[0], op, async_op, timeout
        )

    def _alltoall(self, g: Any, op: str, x: Any, sc: List[int], y: Any, rc: List[int], c: Any, what: Any) -> None:
        """torch's alltoall_base of 1-D ``x`` into 1-D ``y`` with element counts per member, as bytes."""
        size = x.element_size()
        b = self.eng.backend(g, c, x.device, op)
        w = b.alltoall_base(
            self._bytes(y), self._bytes(x), [k * size for k in rc], [k * size for k in sc], dist.AllToAllOptions()
        )
        self.eng.wait(g, w, c.deadline, what)

    def all_to_all(self, g: Any, outs: List[Any], ins: List[Any], async_op: bool, timeout: Any) -> Any:
        """all_to_all of lists of device tensors."""
        n = g.size()
        if len(outs) != n or len(ins) != n:
            raise ConfigError(
                f"all_to_all: both lists need {n} tensors (one per rank), got {len(outs)} outputs and {len(ins)} inputs"
            )
        first = self._tensor(ins[0], "input_tensor_list[0]", "all_to_all")
        for i, t in enumerate(list(ins) + list(outs)):
            self._tensor(t, f"tensor {i}", "all_to_all", first.device)
            if t.dtype != first.dtype:
                raise ConfigError(
                    f"all_to_all: every tensor must have dtype {_dname(first)}; tensor {i} has {_dname(t)}"
                )

        def run(c: Any) -> None:
            sc = [t.numel() for t in ins]
            rc = [t.numel() for t in outs]
            x = torch.cat([t.detach().reshape(-1) for t in ins]) if sum(sc) else first.new_empty(0)
            y = torch.empty(sum(rc), dtype=first.dtype, device=first.device)
            what = self._what("all_to_all", g, first)
            self._alltoall(g, "all_to_all", x, sc, y, rc, c, what)
            pos = 0
            with torch.no_grad():
                for o in outs:
                    o.copy_(y[pos : pos + o.numel()].view(o.shape))
                    pos += o.numel()
            self._finish(g, c, first.device, what, ())

        return self._run(g, "all_to_all", run, async_op, timeout, ("all_to_all", _dname(first)))

    @staticmethod
    def _splits(t: Any, sizes: Optional[Sequence[int]], n: int, what: str) -> List[int]:
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if sizes is None:
            if rows % n:
                raise ConfigError(
                    f"all_to_all_single: {what} has {rows} rows (dim 0), not divisible by the group "
                    f"size {n}; pass {what}_split_sizes"
                )
            return [rows // n * row] * n
        sizes = [int(s) for s in sizes]
        if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
            raise ConfigError(
                f"all_to_all_single: {what}_split_sizes={sizes} must have {n} non-negative entries "
                f"summing to dim 0 of the {what} ({rows})"
            )
        return [s * row for s in sizes]

    def all_to_all_single(
        self,
        g: Any,
        output: Any,
        input: Any,
        out_splits: Any,
        in_splits: Any,  # noqa: A002
        async_op: bool,
        timeout: Any,
    ) -> Any:
        """all_to_all_single of device tensors (equal parts or the given split sizes along dim 0)."""
        out = self._tensor(output, "the output", "all_to_all_single")
        self._tensor(input, "the input", "all_to_all_single", out.device)
        if out.dtype != input.dtype:
            raise ConfigError(f"all_to_all_single: output dtype {_dname(out)} differs from input dtype {_dname(input)}")
        sc = self._splits(input, in_splits, g.size(), "input")
        rc = self._splits(out, out_splits, g.size(), "output")

        def run(c: Any) -> None:
            x, _ = self._flat(input, writable=False)
            y, back = self._flat(out)
            what = self._what("all_to_all_single", g, out)
            self._alltoall(g, "all_to_all_single", x, sc, y, rc, c, what)
            self._finish(g, c, out.device, what, (back,))

        return self._run(g, "all_to_all_single", run, async_op, timeout, ("all_to_all", _dname(out)))

    def barrier(self, g: Any, device_ids: Sequence[int], async_op: bool, timeout: Any) -> Any:
        """barrier(device_ids=[i]): an all_reduce of one element on device i (the CPU for the gloo stand-in)."""
        dev = torch.device(self.dev, int(device_ids[0])) if self.dev != "cpu" else torch.device("cpu")

        def run(c: Any) -> None:
            x = torch.zeros(1, device=dev)
            what = lambda: f"barrier on {dev} in group {g.name}"  # noqa: E731
            b = self.eng.backend(g, c, dev, "barrier")
            self.eng.wait(g, b.allreduce([x], dist.AllreduceOptions()), c.deadline, what)

        return self._run(g, "barrier", run, async_op, timeout, ("barrier",))

    # -- point-to-point ---------------------------------------------------------------------------
    def _tag(self, op: str, tag: int) -> int:
        if not 0 <= tag < 1 << 31:
            raise ConfigError(
                f"{op}: tag={tag} with {self.dev} tensors must be in [0, 2**31) (torch's {self.eng.kind})"
            )
        return int(tag)

    def isend(self, g: Any, peer: int, tag: int, tensor: Any) -> tuple:
        """Post a send of a device tensor to global rank ``peer``: (group, request, context maker)."""

        t = self._tensor(tensor, "send tensor", "send")
        x, _ = self._flat(t, writable=False)
        b = self.eng.pair_backend(g, (peer,), t.device, "send")
        what = f"send to rank {peer}, tag {tag}, {_dname(t)}{list(t.shape)} on {t.device}"
        w = pollable(self.eng.kind, b.send([self._bytes(x)], g.group_rank_of(peer), self._tag("send", tag)))
        req = TorchRequest(self.eng, g, w, peer, x.numel() * x.element_size(), what)
        req.keep = x
        return g, req, lambda: what

    def irecv(self, g: Any, peer: int, tag: int, tensor: Any) -> tuple:
        """Post a receive of a device tensor from global rank ``peer``: (group, request, finish, context, None)."""

        t = self._tensor(tensor, "recv tensor", "recv")
        if peer == ANY_SOURCE:
            raise ConfigError(
                f"recv: a receive of {self.dev} tensors needs src= (NCCL has no receive from any "
                "source); receive into a CPU tensor, or name the sender"
            )
        y, back = self._flat(t)
        b = self.eng.pair_backend(g, (peer,), t.device, "recv")
        what = f"recv from rank {peer}, tag {tag}, {_dname(t)}{list(t.shape)} on {t.device}"
        w = pollable(self.eng.kind, b.recv([self._bytes(y)], g.group_rank_of(peer), self._tag("recv", tag)))
        req = TorchRequest(self.eng, g, w, peer, y.numel() * y.element_size(), what)
        req.keep = y

        def done(st: Any) -> int:
            back()
            self.eng.settle(g, t.device, None, lambda: what)
            return st.source

        return g, req, done, lambda: what, None

    def batch_isend_irecv(self, g: Any, items: Sequence[tuple]) -> list:
        """Post ``items`` ((is_recv, tensor, global peer, tag) in the caller's order) with device tensors; their
        Works.  NCCL gets them as one coalesced group (torch's ``_start_coalescing``/``_end_coalescing``): two
        ranks that each receive before sending would otherwise wait for each other on the device."""

        if not items:
            return []
        first = self._tensor(items[0][1], "P2POp tensor 0", "batch_isend_irecv")
        prepared = []
        for i, (is_recv, tensor, peer, tag) in enumerate(items):
            t = self._tensor(tensor, f"P2POp tensor {i}", "batch_isend_irecv", first.device)
            if peer == ANY_SOURCE:
                raise ConfigError(
                    "batch_isend_irecv: a receive of device tensors needs a peer (NCCL has no receive from any source)"
                )
            x, back = self._flat(t, writable=is_recv)
            prepared.append((is_recv, t, peer, self._tag("batch_isend_irecv", tag), x, back))
        b = self.eng.pair_backend(g, [item[2] for item in prepared], first.device, "batch_isend_irecv")
        coalesce = self.eng.kind == "nccl"
        if coalesce:
            b._start_coalescing(first.device)
        posted: List[Any] = [None] * len(prepared)
        order = sorted(range(len(prepared)), key=lambda k: not prepared[k][0])  # receives first
        for k in order:
            is_recv, t, peer, tag, x, _ = prepared[k]
            fn = b.recv if is_recv else b.send
            posted[k] = pollable(self.eng.kind, fn([self._bytes(x)], g.group_rank_of(peer), tag))
        if coalesce:
            w = b._end_coalescing(first.device)
            posted = [w] * len(prepared)
        works = []
        for k, (is_recv, t, peer, tag, x, back) in enumerate(prepared):
            verb = "recv from" if is_recv else "send to"
            what = f"{verb} rank {peer}, tag {tag}, {_dname(t)}{list(t.shape)} on {t.device} (batch_isend_irecv)"
            req = TorchRequest(self.eng, g, posted[k], peer, x.numel() * x.element_size(), what)
            req.keep = x
            works.append(g.p2p("recv" if is_recv else "send", req, None, self._p2p_done(g, t, back, what), what))
        return works

    def _p2p_done(self, g: Any, t: Any, back: Callable[[], None], what: str) -> Callable[[Any], int]:
        def done(st: Any) -> int:
            back()
            self.eng.settle(g, t.device, None, lambda: what)
            return st.source

        return done
