"""Worker programs for tests/integration/test_torch_backend.py: ``python torch_backend_workers.py SCENARIO INIT``.

Each rank reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (set by the test), forms
torch's default group with backend "procgroup" through the init method INIT (env, tcp, file:PATH, store),
runs SCENARIO with closed-form expected values and exits 0, or raises (exit 1) naming what differed.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import procgroup.torch as pgt
from procgroup.torch.backend import Options, ProcgroupBackend

RANK = int(os.environ["RANK"])
WS = int(os.environ["WORLD_SIZE"])
S = WS * (WS + 1) // 2  # sum over ranks of (rank + 1)
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.float16]


def check(cond: bool, what: str) -> None:
    """Raise naming the rank and the failed expectation."""
    if not cond:
        raise AssertionError(f"rank {RANK}/{WS}: {what}")


def eq(t: torch.Tensor, value: Any, what: str) -> None:
    """Every element of ``t`` equals ``value``."""
    check(bool((t.double() == float(value)).all()), f"{what}: expected all {value}, got {t.tolist()}")


def init(how: str, timeout: float = 60.0, backend: str = "procgroup", store: Any = None, **kw: Any) -> Any:
    """The default group over ``backend`` (naming "procgroup") through init method ``how``; returns the store.

    ``store``: for ``how == "store"``, a store to reuse (a second init over the same store).
    """
    tmo = timedelta(seconds=timeout)
    port = int(os.environ["MASTER_PORT"])
    if how == "env":
        dist.init_process_group(backend, timeout=tmo, **kw)
    elif how == "tcp":
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=WS, timeout=tmo, **kw
        )
    elif how.startswith("file:"):
        dist.init_process_group(backend, init_method="file://" + how[5:], rank=RANK, world_size=WS, timeout=tmo, **kw)
    elif how == "store":
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, WS, RANK == 0, timeout=tmo)
        dist.init_process_group(backend, store=store, rank=RANK, world_size=WS, timeout=tmo, **kw)
    else:
        raise ValueError(f"unknown init method {how!r}")
    check(dist.get_backend() == backend, f"get_backend() is {dist.get_backend()!r}")
    check(isinstance(default_pg(), ProcgroupBackend), f"default group is {type(default_pg()).__name__}")
    return store


def default_pg() -> Any:
    """torch's default ProcessGroup object (our backend itself)."""
    return dist.distributed_c10d._get_default_group()


# -- scenarios -------------------------------------------------------------------------------------
def basic() -> None:
    """A few ops, enough to show an init method works."""
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t)
    eq(t, S, "all_reduce")
    b = torch.arange(4.0) if RANK == 0 else torch.zeros(4)
    dist.broadcast(b, 0)
    check(torch.equal(b, torch.arange(4.0)), f"broadcast {b}")
    dist.barrier()
    objs: List[Any] = [None] * WS
    dist.all_gather_object(objs, {"rank": RANK, "pad": "x" * RANK * 100})
    check(objs == [{"rank": r, "pad": "x" * r * 100} for r in range(WS)], f"all_gather_object {objs}")
    lst: List[Any] = [{"from": 0}, "two"] if RANK == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    check(lst == [{"from": 0}, "two"], f"broadcast_object_list {lst}")
    got: Any = [None] * WS if RANK == 0 else None
    dist.gather_object(("r", RANK), got, dst=0)
    check(RANK != 0 or got == [("r", r) for r in range(WS)], f"gather_object {got}")
    out: List[Any] = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(WS)] if RANK == 0 else None, src=0)
    check(out == [f"to {RANK}"], f"scatter_object_list {out}")


def _noncontig(dt: torch.dtype, fill: float) -> torch.Tensor:
    base = torch.zeros(4, 6, dtype=dt)
    v = base[:, ::2]
    v.fill_(fill)
    check(not v.is_contiguous(), "the test view should be non-contiguous")
    return v


def collectives() -> None:
    """Every collective, every root, every dtype, non-contiguous tensors."""
    for dt in DTYPES:
        name = str(dt)
        floating = dt.is_floating_point
        ops = {
            dist.ReduceOp.SUM: S,
            dist.ReduceOp.MAX: WS,
            dist.ReduceOp.MIN: 1,
            dist.ReduceOp.PRODUCT: math.factorial(WS),
        }
        if floating:
            ops[dist.ReduceOp.AVG] = (WS + 1) / 2
        for op, want in ops.items():
            t = torch.full((5,), RANK + 1, dtype=dt)
            dist.all_reduce(t, op=op)
            eq(t, want, f"all_reduce {op} {name}")
        v = _noncontig(dt, RANK + 1)
        dist.all_reduce(v)
        eq(v, S, f"non-contiguous all_reduce {name}")
        eq(v._base[:, 1::2], 0, f"non-contiguous all_reduce {name} touched the gaps")
        for root in range(WS):
            t = torch.full((3,), root * 5 + 2 if RANK == root else -1, dtype=dt)
            dist.broadcast(t, root)
            eq(t, root * 5 + 2, f"broadcast root {root} {name}")
            nv = _noncontig(dt, root * 5 + 2 if RANK == root else -1)
            dist.broadcast(nv, root)
            eq(nv, root * 5 + 2, f"non-contiguous broadcast root {root} {name}")
            t = torch.full((3,), RANK + 1, dtype=dt)
            dist.reduce(t, root)
            if RANK == root:
                eq(t, S, f"reduce root {root} {name}")
            src = torch.full((2,), RANK + 1, dtype=dt)
            gl = [torch.zeros(2, dtype=dt) for _ in range(WS)] if RANK == root else None
            dist.gather(src, gl, dst=root)
            if gl is not None:
                for i, g in enumerate(gl):
                    eq(g, i + 1, f"gather root {root} {name} slot {i}")
            sl = [torch.full((2,), i * 3 + root, dtype=dt) for i in range(WS)] if RANK == root else None
            out = torch.zeros(2, dtype=dt)
            dist.scatter(out, sl, src=root)
            eq(out, RANK * 3 + root, f"scatter root {root} {name}")
        outs = [torch.zeros(2, dtype=dt) for _ in range(WS)]
        dist.all_gather(outs, torch.full((2,), RANK + 1, dtype=dt))
        for i, o in enumerate(outs):
            eq(o, i + 1, f"all_gather {name} slot {i}")
        grid = torch.zeros(2, WS, dtype=dt)
        nc_outs = [grid[:, i] for i in range(WS)]
        dist.all_gather(nc_outs, torch.full((2,), RANK + 1, dtype=dt))
        check(torch.equal(grid, torch.arange(1, WS + 1, dtype=dt).repeat(2, 1)), f"non-contiguous all_gather {grid}")
        big = torch.zeros(WS * 2, dtype=dt)
        dist.all_gather_into_tensor(big, torch.full((2,), RANK + 1, dtype=dt))
        check(torch.equal(big, torch.arange(1, WS + 1, dtype=dt).repeat_interleave(2)), f"into_tensor {big}")
        ins = [torch.full((2,), RANK + 1 + i, dtype=dt) for i in range(WS)]
        out = torch.zeros(2, dtype=dt)
        dist.reduce_scatter(out, ins)
        eq(out, S + WS * RANK, f"reduce_scatter {name}")
        flat = torch.cat(ins)
        out = torch.zeros(2, dtype=dt)
        dist.reduce_scatter_tensor(out, flat)
        eq(out, S + WS * RANK, f"reduce_scatter_tensor {name}")
        outs = [torch.zeros(2, dtype=dt) for _ in range(WS)]
        dist.all_to_all(outs, [torch.full((2,), RANK * 4 + i, dtype=dt) for i in range(WS)])
        for i, o in enumerate(outs):
            eq(o, i * 4 + RANK, f"all_to_all {name} from {i}")
        _all_to_all_single(dt)
    dist.barrier()
    _coalesced()


def edges() -> None:
    """Scalars, empty tensors, bool and bitwise reductions, large messages, more non-contiguous buffers."""
    t = torch.tensor(float(RANK + 1))
    dist.all_reduce(t)
    eq(t, S, "0-dim all_reduce")
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.broadcast(e, 0)
    dist.all_gather_into_tensor(torch.empty(0), torch.empty(0))
    b = torch.tensor([RANK == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    check(b.tolist() == [True, True, False], f"bool MAX {b}")
    b = torch.tensor([RANK == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    check(b.tolist() == [WS == 1, True, False], f"bool MIN {b}")
    for dt in (torch.int32, torch.uint8, torch.int8, torch.int16):
        x = torch.full((3,), 1 << RANK, dtype=dt)
        dist.all_reduce(x, op=dist.ReduceOp.BOR)
        eq(x, (1 << WS) - 1, f"BOR {dt}")
        x = torch.full((3,), 1 << RANK, dtype=dt)
        dist.all_reduce(x, op=dist.ReduceOp.BXOR)
        eq(x, (1 << WS) - 1, f"BXOR {dt}")
        x = torch.full((3,), 7 - RANK, dtype=dt)
        dist.all_reduce(x, op=dist.ReduceOp.BAND)
        want = 7
        for r in range(WS):
            want &= 7 - r
        eq(x, want, f"BAND {dt}")
    n = 1 << 21
    big = torch.full((n,), float(RANK + 1))
    dist.all_reduce(big)
    eq(big[::4096], S, "large all_reduce")
    out = torch.empty(n * WS)
    dist.all_gather_single(out, torch.full((n,), float(RANK)))  # torch 2.13's name for all_gather_into_tensor
    check(torch.equal(out.view(WS, n)[:, -1], torch.arange(float(WS))), "large all_gather_single")
    o = torch.empty(n)
    dist.reduce_scatter_single(o, torch.full((n * WS,), float(RANK + 1)))  # reduce_scatter_tensor's new name
    eq(o[::4096], S, "large reduce_scatter_single")
    grid = torch.zeros(3, WS)
    dist.scatter(grid[:, 0], [torch.full((3,), float(i + 10)) for i in range(WS)] if RANK == 0 else None, src=0)
    eq(grid[:, 0], RANK + 10, "non-contiguous scatter output")
    g2 = torch.zeros(2, WS)
    dist.all_to_all([g2[:, i] for i in range(WS)], [torch.full((2,), float(RANK * 10 + i)) for i in range(WS)])
    check(torch.equal(g2[0], torch.tensor([float(i * 10 + RANK) for i in range(WS)])), f"non-contiguous a2a {g2}")
    g3 = torch.zeros(2, 3)
    dist.reduce_scatter(g3[:, 0], [torch.full((2,), 1.0) for _ in range(WS)])
    eq(g3[:, 0], WS, "non-contiguous reduce_scatter output")
    gg = torch.zeros(2, WS)
    dist.gather(torch.full((2,), float(RANK)), [gg[:, i] for i in range(WS)] if RANK == 0 else None, dst=0)
    check(RANK != 0 or torch.equal(gg[0], torch.arange(float(WS))), f"non-contiguous gather list {gg}")
    whole = torch.zeros(WS * 3)
    mine = whole[RANK * 3 : (RANK + 1) * 3]
    mine.fill_(RANK + 1)
    dist.all_gather_into_tensor(whole, mine)  # the input is the output's own chunk, as FSDP does
    check(torch.equal(whole, torch.arange(1.0, WS + 1).repeat_interleave(3)), f"aliased all_gather {whole}")


def _all_to_all_single(dt: torch.dtype) -> None:
    """Rank r sends i+1 rows (value r*4+i) to rank i; receives r+1 rows from each rank."""
    inp = torch.cat([torch.full((i + 1, 2), RANK * 4 + i, dtype=dt) for i in range(WS)])
    out = torch.zeros((RANK + 1) * WS, 2, dtype=dt)
    dist.all_to_all_single(out, inp, output_split_sizes=[RANK + 1] * WS, input_split_sizes=[i + 1 for i in range(WS)])
    want = torch.cat([torch.full((RANK + 1, 2), i * 4 + RANK, dtype=dt) for i in range(WS)])
    check(torch.equal(out, want), f"all_to_all_single splits {dt}: {out.tolist()}")
    inp = torch.cat([torch.full((1,), RANK * 4 + i, dtype=dt) for i in range(WS)])
    out = torch.zeros(WS, dtype=dt)
    dist.all_to_all_single(out, inp)
    check(torch.equal(out, torch.tensor([i * 4 + RANK for i in range(WS)], dtype=dt)), f"all_to_all_single {out}")


def _coalesced() -> None:
    """The coalesced forms, called on the group object as torch's internals do."""
    pg = default_pg()
    a, b = torch.full((3,), float(RANK + 1)), torch.full((2, 2), float(RANK + 1), dtype=torch.float64)
    pg.allreduce_coalesced([a, b]).wait()
    eq(a, S, "allreduce_coalesced (mixed dtypes) a")
    eq(b, S, "allreduce_coalesced (mixed dtypes) b")
    xs = [torch.full((4,), float(RANK + 1)), torch.full((1,), float(RANK + 1))]
    pg.allreduce_coalesced(xs).wait()
    for x in xs:
        eq(x, S, "allreduce_coalesced")
    outs = [torch.zeros(WS * 2), torch.zeros(WS)]
    ins = [torch.full((2,), float(RANK + 1)), torch.full((1,), float(RANK + 1))]
    pg.allgather_into_tensor_coalesced(outs, ins).wait()
    check(torch.equal(outs[1], torch.arange(1.0, WS + 1)), f"allgather_into_tensor_coalesced {outs}")
    rs_in = [torch.ones(WS * 2) * (RANK + 1), torch.ones(WS) * (RANK + 1)]
    rs_out = [torch.zeros(2), torch.zeros(1)]
    pg.reduce_scatter_tensor_coalesced(rs_out, rs_in).wait()
    for o in rs_out:
        eq(o, S, "reduce_scatter_tensor_coalesced")
    # torch's layout: output_lists[r][j] receives rank r's input j (the public API's, as torch's own tests use it)
    ins2 = [torch.full((1,), float(RANK)), torch.full((2,), float(10 * RANK))]
    lists = [[torch.zeros_like(t) for t in ins2] for _ in range(WS)]
    pg.allgather_coalesced(lists, ins2).wait()
    for r in range(WS):
        check(float(lists[r][0]) == r and lists[r][1].tolist() == [10.0 * r] * 2, f"allgather_coalesced {lists}")
    lists = [[torch.zeros_like(t) for t in ins2] for _ in range(WS)]
    dist.all_gather_coalesced(lists, ins2)
    for r in range(WS):
        check(float(lists[r][0]) == r and lists[r][1].tolist() == [10.0 * r] * 2, f"all_gather_coalesced {lists}")


def hot_path() -> None:
    """The blocking one-tensor all_reduce's cached views and reused Works (procgroup.torch._fast).

    The same tensor object again and again, then changed under the cache (resized, re-pointed with set_(),
    given another dtype through .data, transposed in place), tensors dying and new ones taking their ids,
    every dtype the cache serves and every op, sizes 0, 1, odd and large, 0-dim, a per-call timeout, and
    Works the caller keeps (their futures must keep their own tensors).
    """
    pg = default_pg()
    native = [torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64]
    native += [torch.uint8]
    for dt in native:
        ops = {dist.ReduceOp.SUM: S, dist.ReduceOp.MAX: WS, dist.ReduceOp.MIN: 1, dist.ReduceOp.PRODUCT: 0}
        if dt.is_floating_point:
            ops[dist.ReduceOp.AVG] = (WS + 1) / 2
        else:
            ops.update({dist.ReduceOp.BAND: 0, dist.ReduceOp.BOR: 0, dist.ReduceOp.BXOR: 0})
        for n in (0, 1, 7, 300_001):
            t = torch.zeros(n, dtype=dt)
            for op, want in ops.items():
                for _ in range(2):  # the second call finds the view cached
                    t.fill_(RANK + 1)
                    dist.all_reduce(t, op=op)
                    if op == dist.ReduceOp.PRODUCT:
                        want = math.prod(range(1, WS + 1)) if dt not in (torch.int8, torch.uint8) or WS < 5 else 0
                    elif op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
                        vals = list(range(1, WS + 1))
                        want = vals[0]
                        for v in vals[1:]:
                            want = {
                                dist.ReduceOp.BAND: want & v,
                                dist.ReduceOp.BOR: want | v,
                                dist.ReduceOp.BXOR: want ^ v,
                            }[op]
                    eq(t, want, f"hot all_reduce {op} {dt} n={n}")
    b = torch.tensor([RANK + 1], dtype=torch.bool) if RANK else torch.tensor([False])
    for _ in range(2):
        b.fill_(RANK > 0)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        check(bool(b) == (WS > 1), f"hot bool all_reduce {b}")
    s0 = torch.tensor(float(RANK + 1))
    for _ in range(2):
        s0.fill_(RANK + 1)
        dist.all_reduce(s0)
        eq(s0, S, "hot 0-dim all_reduce")
    # the same tensor object, changed under the cache
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    eq(t, S, "hot before resize")
    t.resize_(1000).fill_(RANK + 1)  # a new, larger storage
    dist.all_reduce(t)
    eq(t, S, "hot after resize_")
    other = torch.full((6,), float(RANK + 2))
    t.set_(other)  # t now views other's storage
    dist.all_reduce(t)
    eq(other, S + WS, "hot after set_ (the new storage holds the result)")
    t.data = torch.full((3,), RANK + 1, dtype=torch.int64)  # same object, another dtype and storage
    dist.all_reduce(t)
    check(t.dtype == torch.int64, f"hot .data dtype {t.dtype}")
    eq(t, S, "hot after .data =")
    m = torch.zeros(3, 5)
    dist.all_reduce(m)
    m.t_()  # transposed in place: same data pointer, not contiguous any more
    base = m.clone()
    m.copy_(torch.arange(15.0).reshape(5, 3) * (RANK + 1))
    dist.all_reduce(m)
    check(torch.equal(m, torch.arange(15.0).reshape(5, 3) * S), f"hot after t_() {m} (was {base.shape})")
    # tensors that die, and new ones that may take their ids (and data pointers): other dtypes and shapes
    for i in range(200):
        dt = (torch.float32, torch.int32, torch.float64, torch.bfloat16)[i % 4]
        x = torch.full((1 + i % 5,), RANK + 1, dtype=dt)
        dist.all_reduce(x)
        eq(x, S, f"hot fresh tensor {i} {dt}")
        del x
    leaf = torch.full((2,), float(RANK + 1), requires_grad=True)
    dist.all_reduce(leaf)
    eq(leaf.detach(), S, "hot leaf that requires grad")
    # the other blocking ops with a hot path: broadcast, reduce, all_gather, all_gather_into_tensor, every root
    for dt in (torch.float32, torch.int64, torch.uint8, torch.float16):
        for n in (1, 5, 70_001):
            x = torch.zeros(n, dtype=dt)
            outs = [torch.zeros(n, dtype=dt) for _ in range(WS)]
            big = torch.zeros(n * WS, dtype=dt)
            for _ in range(2):  # the second round finds every view cached
                for root in range(WS):
                    x.fill_(root + 3 if RANK == root else 0)
                    dist.broadcast(x, root)
                    eq(x, root + 3, f"hot broadcast root {root} {dt} n={n}")
                    x.fill_(RANK + 1)
                    dist.reduce(x, root)
                    eq(x, S if RANK == root else RANK + 1, f"hot reduce root {root} {dt} n={n}")
                x.fill_(RANK + 1)
                dist.all_gather(outs, x)
                for i, o in enumerate(outs):
                    eq(o, i + 1, f"hot all_gather {dt} n={n} slot {i}")
                dist.all_gather_into_tensor(big, x)
                want = torch.arange(1, WS + 1, dtype=dt).repeat_interleave(n)
                check(torch.equal(big, want), f"hot all_gather_into_tensor {dt} n={n}")
                big.fill_(RANK + 1)
                for op, want in ((dist.ReduceOp.SUM, S), (dist.ReduceOp.MAX, WS), (dist.ReduceOp.MIN, 1)):
                    x.fill_(-1)
                    dist.reduce_scatter_tensor(x, big, op=op)
                    eq(x, want, f"hot reduce_scatter_tensor {op} {dt} n={n}")
    # a per-call timeout in the options, and Works the caller keeps
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.SUM
    o.asyncOp = False
    o.timeout = timedelta(seconds=30)
    kept = []
    for i in range(3):
        u = torch.full((2,), float(RANK + i))
        w = pg.allreduce([u], o)
        kept.append((w, u, S - WS + WS * i))
    for w, u, want in kept:
        check(w.is_completed() and w.wait(), "a blocking call's Work is complete")
        got = w.get_future().value()
        check(len(got) == 1 and got[0] is u, "a kept Work's future carries its own call's tensor")
        eq(got[0], want, "a kept Work's future value")


def own_api_views() -> None:
    """procgroup's own API on torch tensors (procgroup.data's cached views): the same tensor again and again,
    then changed under the cache (resize_, set_, .data = with another dtype, t_(), as_strided_, a negative-bit
    view), in-place value changes, dying tensors whose ids new ones take, async ops on temporaries."""
    import procgroup

    own = default_pg().procgroup
    t = torch.zeros(5)
    for i in range(3):  # cached after the first call; in-place value changes need no new view
        t.fill_(RANK + 1).mul_(i + 1)
        procgroup.all_reduce(t, group=own)
        eq(t, S * (i + 1), f"own all_reduce {i}")
    t.resize_(100_000).fill_(RANK + 1)  # a new, larger storage
    procgroup.all_reduce(t, group=own)
    eq(t, S, "own all_reduce after resize_")
    t.resize_(3)  # smaller: same data pointer, another shape
    t.fill_(RANK + 1)
    procgroup.all_reduce(t, group=own)
    check(t.shape == (3,), f"shape {t.shape}")
    eq(t, S, "own all_reduce after shrinking resize_")
    other = torch.full((6,), float(RANK + 2))
    t.set_(other)
    procgroup.all_reduce(t, group=own)
    eq(other, S + WS, "own all_reduce after set_ (the new storage holds the result)")
    t.data = torch.full((3,), RANK + 1, dtype=torch.int64)
    procgroup.all_reduce(t, group=own)
    check(t.dtype == torch.int64, f"own .data dtype {t.dtype}")
    eq(t, S, "own all_reduce after .data =")
    t.data = torch.full((3,), RANK + 1, dtype=torch.bfloat16)
    procgroup.all_reduce(t, group=own)
    eq(t, S, "own all_reduce after .data = bfloat16")
    m = torch.zeros(3, 5)
    procgroup.all_reduce(m, group=own)
    m.t_()  # same data pointer, transposed: no longer contiguous
    m.copy_(torch.arange(15.0).reshape(5, 3) * (RANK + 1))
    procgroup.all_reduce(m, group=own)
    check(torch.equal(m, torch.arange(15.0).reshape(5, 3) * S), f"own all_reduce after t_() {m}")
    v = torch.zeros(8)
    procgroup.all_reduce(v, group=own)
    v.as_strided_((4,), (2,))  # same data pointer and numel 4: every other element
    base = v.clone()
    v.fill_(RANK + 1)
    procgroup.all_reduce(v, group=own)
    eq(v, S, f"own all_reduce after as_strided_ (was {base.tolist()})")
    check(v.untyped_storage().nbytes() == 32, "as_strided_ kept the storage")
    n = torch.full((4,), float(RANK + 1))
    procgroup.all_reduce(n, group=own)
    eq(n, S, "own all_reduce before the negative view")
    neg = torch._neg_view(n)  # a negative-bit view of the same memory: never the cached plain view
    try:
        procgroup.all_reduce(neg, group=own)
        check(False, "a negative-bit tensor should be refused, as before")
    except Exception as e:  # noqa: BLE001 - the exact type is numpy's/torch's
        check("negative" in str(e).lower(), f"negative-bit tensor: {e}")
    # tensors that die, and new ones taking their ids and data pointers, with other dtypes and shapes
    for i in range(300):
        dt = (torch.float32, torch.int32, torch.float64, torch.bfloat16, torch.uint8)[i % 5]
        x = torch.full((1 + i % 7,), RANK + 1, dtype=dt)
        procgroup.all_reduce(x, group=own)
        eq(x, S, f"own fresh tensor {i} {dt}")
        del x
    # async ops on tensors the caller does not keep, then on kept ones
    works = [procgroup.all_reduce(torch.full((1000,), float(RANK + 1)), group=own, async_op=True) for _ in range(4)]
    for w in works:
        w.wait()
    kept = [torch.full((1000,), float(RANK + i)) for i in range(4)]
    works = [procgroup.all_reduce(k, group=own, async_op=True) for k in kept]
    for i, (w, k) in enumerate(zip(works, kept)):
        w.wait()
        eq(k, S - WS + WS * i, f"own async all_reduce {i}")
    # the other collectives on cached tensors, every root
    for dt in (torch.float32, torch.int64, torch.bfloat16):
        x = torch.zeros(5, dtype=dt)
        outs = [torch.zeros(5, dtype=dt) for _ in range(WS)]
        big = torch.zeros(5 * WS, dtype=dt)
        part = torch.zeros(5, dtype=dt)
        for _ in range(2):
            for root in range(WS):
                x.fill_(root + 3 if RANK == root else 0)
                procgroup.broadcast(x, root, group=own)
                eq(x, root + 3, f"own broadcast root {root} {dt}")
                x.fill_(RANK + 1)
                procgroup.reduce(x, root, group=own)
                eq(x, S if RANK == root else RANK + 1, f"own reduce root {root} {dt}")
            x.fill_(RANK + 1)
            procgroup.all_gather(outs, x, group=own)
            for i, o in enumerate(outs):
                eq(o, i + 1, f"own all_gather {dt} slot {i}")
            procgroup.all_gather_into_tensor(big, x, group=own)
            check(torch.equal(big, torch.arange(1, WS + 1, dtype=dt).repeat_interleave(5)), f"own ag {dt} {big}")
            big.fill_(RANK + 1)
            procgroup.reduce_scatter_tensor(part, big, group=own)
            eq(part, S, f"own reduce_scatter_tensor {dt}")


def async_ops() -> None:
    """async_op=True: Works with wait(timeout), is_completed() and futures that carry the result."""
    works, ts = [], []
    for i in range(6):
        t = torch.full((1000,), float(RANK + i))
        ts.append(t)
        works.append(dist.all_reduce(t, async_op=True))
    futs = [w.get_future() for w in works]
    chained = futs[-1].then(lambda f: f.value()[0] * 2)
    for i, w in enumerate(works):
        check(w.wait(timeout=timedelta(seconds=30)), "wait() should return True")
        check(w.is_completed() and w.is_success(), "is_completed after wait")
        eq(ts[i], S - WS + WS * i, f"async all_reduce {i}")
        eq(futs[i].wait()[0], S - WS + WS * i, f"future value {i}")
        check(futs[i].value()[0] is ts[i], "the future carries the caller's tensor")
    eq(chained.wait(), 2 * (S - WS + WS * 5), "chained future")
    b = torch.zeros(3) if RANK else torch.full((3,), 9.0)
    w = dist.broadcast(b, 0, async_op=True)
    eq(w.get_future().wait()[0], 9, "async broadcast future")
    out = torch.zeros(WS)
    w = dist.all_gather_into_tensor(out, torch.full((1,), float(RANK)), async_op=True)
    w.wait()
    check(torch.equal(out, torch.arange(float(WS))), f"async all_gather_into_tensor {out}")
    w = dist.barrier(async_op=True)
    w.wait()
    t = torch.full((2,), float(RANK + 1))
    w = dist.all_reduce(t, async_op=True)
    dist.all_reduce(t)  # a blocking op after an async one keeps program order
    w.wait()
    eq(t, S * WS, "blocking after async")


def p2p() -> None:
    """send/recv, isend/irecv, recv from any source, batch_isend_irecv, tags, non-contiguous buffers."""
    nxt, prv = (RANK + 1) % WS, (RANK - 1) % WS
    for dt in DTYPES:
        out = torch.full((4,), RANK * 2 + 1, dtype=dt)
        inp = torch.zeros(4, dtype=dt)
        reqs = [dist.isend(out, nxt), dist.irecv(inp, prv)]
        for r in reqs:
            r.wait()
        eq(inp, prv * 2 + 1, f"isend/irecv ring {dt}")
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, inp, prv)]
        inp.zero_()
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        eq(inp, prv * 2 + 1, f"batch_isend_irecv {dt}")
    if RANK == 0:
        for r in range(1, WS):
            dist.send(torch.full((3,), float(r * 10)), r)
        got = set()
        for _ in range(1, WS):
            t = torch.zeros(2)
            src = dist.recv(t)
            eq(t, src * 7, f"recv from any source (from {src})")
            got.add(src)
        check(got == set(range(1, WS)), f"recv from any source: senders {got}")
        a, b = torch.zeros(2), torch.zeros(2)
        if WS > 1:
            w2 = dist.irecv(b, 1, tag=2)
            w1 = dist.irecv(a, 1, tag=1)
            w2.wait()
            w1.wait()
            eq(a, 1, "tag 1")
            eq(b, 2, "tag 2")
            nc = _noncontig(torch.float32, 0)
            dist.recv(nc, 1, tag=3)
            eq(nc, 5, "non-contiguous recv")
            eq(nc._base[:, 1::2], 0, "non-contiguous recv touched the gaps")
            fut = dist.irecv(torch.zeros(1), 1, tag=4).get_future()
            eq(fut.wait()[0], 11, "recv future")
    else:
        t = torch.zeros(3)
        dist.recv(t, 0)
        eq(t, RANK * 10, "send/recv")
        dist.send(torch.full((2,), float(RANK * 7)), 0)
        if RANK == 1:
            dist.send(torch.full((2,), 1.0), 0, tag=1)
            dist.send(torch.full((2,), 2.0), 0, tag=2)
            dist.send(_noncontig(torch.float32, 5), 0, tag=3)  # tags other than 0: the any-source recvs use 0
            dist.send(torch.full((1,), 11.0), 0, tag=4)
    dist.barrier()


def subgroups() -> None:
    """new_group(backend="procgroup"), subgroups inheriting the backend, roots as global ranks."""
    g = dist.new_group([0, WS - 1], backend="procgroup")
    if RANK in (0, WS - 1):
        check(dist.get_backend(g) == "procgroup", f"subgroup backend {dist.get_backend(g)}")
        t = torch.full((2,), float(RANK + 1))
        dist.all_reduce(t, group=g)
        eq(t, 1 + WS, "subgroup all_reduce")
        b = torch.full((2,), 4.0 if RANK == WS - 1 else 0.0)
        dist.broadcast(b, src=WS - 1, group=g)
        eq(b, 4, "subgroup broadcast from its last global rank")
        outs = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(outs, torch.full((1,), float(RANK)), group=g)
        check([float(o) for o in outs] == [0.0, float(WS - 1)], f"subgroup all_gather {outs}")
    else:
        check(g == dist.GroupMember.NON_GROUP_MEMBER, "a non-member gets NON_GROUP_MEMBER")
    blocks = [[r] for r in range(WS)] if WS < 2 else [[0, 1], list(range(2, WS))] if WS > 2 else [[0], [1]]
    mine, _ = dist.new_subgroups_by_enumeration(blocks)
    me = next(b for b in blocks if RANK in b)
    t = torch.full((1,), float(RANK + 1))
    dist.all_reduce(t, group=mine)
    eq(t, sum(r + 1 for r in me), f"new_subgroups_by_enumeration {blocks}")
    p2 = dist.new_group(list(reversed(range(WS))))  # inherits "procgroup"; group rank order follows torch
    t = torch.full((1,), float(RANK + 1))
    dist.all_reduce(t, group=p2)
    eq(t, S, "new_group without a backend inherits procgroup")
    dist.barrier()


def fallthrough() -> None:
    """What procgroup does not serve goes to gloo underneath: answered correctly, logged once per op."""
    records: List[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("procgroup.torch").addHandler(Keep())
    pg = default_pg()
    try:  # before anything built gloo underneath: a point-to-point op cannot build it alone
        dist.send(torch.zeros(2, dtype=torch.uint16), (RANK + 1) % WS)
    except ValueError as e:
        check("every rank of the group must build together" in str(e), f"p2p fallthrough error: {e}")
    else:
        raise AssertionError("a uint16 send before the fallback exists should raise, not hang")
    for _ in range(2):
        pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)  # served natively: no fallthrough
        idx = torch.tensor([[0, 2]])
        s = torch.sparse_coo_tensor(idx, torch.full((2,), float(RANK + 1)), (4,))
        dist.all_reduce(s)
        check(torch.equal(s.to_dense(), torch.tensor([S, 0.0, S, 0.0])), f"sparse all_reduce {s.to_dense()}")
    check(pg.fallthrough_counts == {"allreduce": 2}, f"counts {pg.fallthrough_counts}")
    msgs = [r.getMessage() for r in records if "falls through" in r.getMessage()]
    check(len(msgs) == 1 and "sparse" in msgs[0], f"logged once per op: {msgs}")
    t = torch.full((2,), float(RANK + 1))
    dist.all_reduce(t)  # native ops still native
    eq(t, S, "native all_reduce after fallthrough")
    check(pg.fallthrough_counts["allreduce"] == 2, "a native op is not counted as fallen through")
    try:
        pg._get_backend(torch.device("cpu"))
    except RuntimeError as e:
        check("serves cpu tensors itself" in str(e), f"_get_backend(cpu): {e}")
    else:
        raise AssertionError("_get_backend(cpu) should raise: procgroup has no torch Backend for CPU")


def delegate() -> None:
    """pg_options=Options(device_backends={"cpu": "gloo"}): the device-delegation path (CUDA's, on CPU)."""
    pg = default_pg()
    t = torch.full((3,), float(RANK + 1))
    dist.all_reduce(t)
    eq(t, S, "delegated all_reduce")
    b = torch.full((2,), 3.0 if RANK == 0 else 0.0)
    dist.broadcast(b, 0)
    eq(b, 3, "delegated broadcast")
    nc = torch.full((8, 6), float(RANK + 1))[:, ::2]  # not contiguous: run on a copy, written back
    dist.all_reduce(nc)
    eq(nc, S, "delegated all_reduce of a non-contiguous tensor")
    big = torch.zeros(WS)
    dist.all_gather_into_tensor(big, torch.full((1,), float(RANK)))
    check(torch.equal(big, torch.arange(float(WS))), f"delegated all_gather_into_tensor {big}")
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.ones(WS) * (RANK + 1))
    eq(out, S, "delegated reduce_scatter_tensor")
    w = dist.all_reduce(t, async_op=True)
    w.get_future().wait()
    eq(t, S * WS, "delegated async all_reduce")
    if RANK == 0:
        dist.send(torch.full((2,), 4.0), 1)
    elif RANK == 1:
        r = torch.zeros(2)
        dist.recv(r, 0)
        eq(r, 4, "delegated send/recv")
    dist.barrier()
    check("gloo" in pg._others and not pg.fallthrough_counts, f"delegation: {pg._others} {pg.fallthrough_counts}")
    check(pg._get_backend(torch.device("cpu")) is pg._others["gloo"], "_get_backend names the delegate")


def dead_peer() -> None:
    """Rank 1 dies; rank 0's all_reduce raises an error naming the op and the dead peer."""
    dist.barrier()
    if RANK == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1000))
    except Exception as e:  # noqa: BLE001 - the point of the test
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        os._exit(0)
    raise AssertionError("all_reduce with a dead peer returned")


def dead_peer_async() -> None:
    """Rank 1 dies; rank 0's async all_reduce fails through its future and its Work, naming the peer."""
    dist.barrier()
    if RANK == 1:
        os._exit(3)
    t0 = time.monotonic()
    w = dist.all_reduce(torch.ones(1000), async_op=True)
    fut = w.get_future()
    try:
        fut.wait()
    except Exception as e:  # noqa: BLE001 - the point of the test
        check(w.is_completed() and not w.is_success(), "the Work reports the failure")
        try:
            w.wait()
        except Exception as e2:  # noqa: BLE001 - the same error through wait()
            check("rank 1" in str(e2), f"Work.wait error {e2}")
        else:
            raise AssertionError("Work.wait() after a failed op returned") from None
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        os._exit(0)
    raise AssertionError("the future of an all_reduce with a dead peer completed")


def deadline() -> None:
    """Rank 1 never calls; rank 0's all_reduce raises at its deadline, naming the op."""
    dist.barrier()
    if RANK == 1:
        _leave_after_rank_0("deadline")  # alive until rank 0 has its error (it slept 12 s before)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
    except Exception as e:  # noqa: BLE001 - the point of the test
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        _leave_after_rank_0("deadline")
    raise AssertionError("all_reduce past its deadline returned")


def _leave_after_rank_0(what: str) -> None:
    """Exit at once, in the order a 2-rank failure test needs: rank 0 (which hosts the store) once rank 1 has read
    that rank 0 is done, rank 1 once it has (before: fixed sleeps, 12 s in ``deadline``, 3 s in ``mismatch``)."""
    store = dist.distributed_c10d._get_default_store()
    wait = timedelta(seconds=30)  # the group's own timeout is 3 s in ``deadline``
    if RANK == 0:
        store.set(f"test/{what}/done", "1")
        store.wait([f"test/{what}/seen"], wait)
    else:
        store.wait([f"test/{what}/done"], wait)
        try:
            store.set(f"test/{what}/seen", "1")
        except RuntimeError:
            pass  # rank 0 exited as soon as it read the key, before the reply came: the end waited for
    os._exit(0)


def cuda() -> None:
    """ "cpu:procgroup,cuda:nccl": CUDA tensors go through torch's NCCL built underneath, CPU ones through procgroup."""
    torch.cuda.set_device(RANK)
    dev = torch.device("cuda", RANK)
    t = torch.full((1000,), float(RANK + 1), device=dev)
    dist.all_reduce(t)
    eq(t.cpu(), S, "cuda all_reduce")
    b = torch.full((3,), 5.0 if RANK == 0 else 0.0, device=dev)
    dist.broadcast(b, 0)
    eq(b.cpu(), 5, "cuda broadcast")
    big = torch.zeros(WS, device=dev)
    dist.all_gather_into_tensor(big, torch.full((1,), float(RANK), device=dev))
    check(torch.equal(big.cpu(), torch.arange(float(WS))), f"cuda all_gather_into_tensor {big}")
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    eq(t.cpu(), S * WS, "cuda async all_reduce")
    c = torch.full((4,), float(RANK + 1))
    dist.all_reduce(c)
    eq(c, S, "cpu all_reduce in the same group")
    pg = default_pg()
    check("nccl" in pg._others and not pg.fallthrough_counts, f"cuda went to {pg._others} {pg.fallthrough_counts}")


def coalescing() -> None:
    """torch's _coalescing_manager, with and without a device, synchronous and async."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    for dev in (None, torch.device("cpu")):
        for async_ops in (False, True):
            a, b = torch.full((3,), float(RANK + 1)), torch.full((2,), float(RANK + 1))
            with _coalescing_manager(device=dev, async_ops=async_ops) as cm:
                dist.all_reduce(a)
                dist.all_reduce(b)
            if async_ops:
                cm.wait()
            eq(a, S, f"coalesced all_reduce a (device {dev}, async {async_ops})")
            eq(b, S, f"coalesced all_reduce b (device {dev}, async {async_ops})")
    outs = [torch.zeros(WS * 2), torch.zeros(WS)]
    with _coalescing_manager():
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(RANK)))
        dist.all_gather_into_tensor(outs[1], torch.full((1,), float(RANK)))
    check(torch.equal(outs[1], torch.arange(float(WS))), f"coalesced all_gather_into_tensor {outs}")
    out = torch.zeros(1)
    with _coalescing_manager():
        dist.reduce_scatter_tensor(out, torch.ones(WS) * (RANK + 1))
    eq(out, S, "coalesced reduce_scatter_tensor")


def mismatch() -> None:
    """Ranks call all_reduce with different sizes: procgroup's watchdog raises a mismatch error naming both."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4 if RANK == 0 else 8))
    except Exception as e:  # noqa: BLE001 - the point of the test
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        _leave_after_rank_0("mismatch")  # rank 0 hosts the store: the other rank reads the mismatch record first
    raise AssertionError("mismatched all_reduce returned")


def monitored() -> None:
    """torch's ``dist.monitored_barrier`` on procgroup groups (torch itself refuses every name but "gloo"): it
    passes when every rank arrives; when rank 1 stays away, rank 0 names it and rank 2 reports rank 0's errors, in
    torch's (gloo's) wording; rank 0 alone with a zero timeout says it timed out itself."""
    dist.monitored_barrier(timeout=timedelta(seconds=20))
    dist.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
    if WS < 3:
        return
    late = dist.new_group(backend="procgroup")
    alone = dist.new_group(backend="procgroup")
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if RANK == 1:  # stays away from the monitored barriers until the others failed (it slept 4 s before)
        store.wait(["test/monitored/0", "test/monitored/2"], timedelta(seconds=30))
        return
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(late, timeout=timedelta(seconds=1))
    except RuntimeError as e:
        took, msg = time.monotonic() - t0, str(e)
    else:
        raise AssertionError(f"rank {RANK}: monitored_barrier passed without rank 1")
    if RANK == 0:
        check("Rank 1 failed to pass monitoredBarrier in 1000 ms" in msg, f"rank 0's error: {msg}")
        check("rank [1] did not reach monitored_barrier" in msg, f"rank 0's error names rank 1: {msg}")
    else:
        want = "Rank 2 successfully reached monitoredBarrier, but received errors while waiting for send/recv "
        want += "from rank 0: "
        check(want + "rank [1] did not reach" in msg, f"rank 2's error: {msg}")
    check(took < 10.0, f"the error took {took:.1f}s")
    if RANK == 0:
        try:
            alone.monitored_barrier(timedelta(0))
        except RuntimeError as e:
            check("Rank 0 timed out in monitoredBarrier after" in str(e), f"zero timeout: {e}")
        else:
            raise AssertionError("a zero-timeout monitored_barrier with absent ranks passed")
    store.set(f"test/monitored/{RANK}", "1")
    time.sleep(0.5)


SCENARIOS: Dict[str, Callable[[], None]] = {
    "basic": basic,
    "collectives": collectives,
    "async": async_ops,
    "hot_path": hot_path,
    "own_api_views": own_api_views,
    "p2p": p2p,
    "subgroups": subgroups,
    "fallthrough": fallthrough,
    "monitored": monitored,
    "delegate": delegate,
    "dead_peer": dead_peer,
    "deadline": deadline,
    "dead_peer_async": dead_peer_async,
    "cuda": cuda,
    "coalescing": coalescing,
    "mismatch": mismatch,
    "edges": edges,
}


def _sparse_fallthrough(what: str) -> None:
    """A sparse all_reduce: falls through to the gloo backend built under procgroup's group."""
    s = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.full((1,), float(RANK + 1)), (3,))
    dist.all_reduce(s)
    check(torch.equal(s.to_dense(), torch.tensor([0.0, S, 0.0])), f"{what}: sparse fallthrough {s.to_dense()}")


def main() -> None:
    """``SCENARIO INIT``; several scenarios joined by '+' run in one group."""
    names, how = sys.argv[1].split("+"), sys.argv[2]
    check(pgt.is_registered(), "import procgroup.torch registers the backend")
    kw: Dict[str, Any] = {}
    timeout = 60.0
    if "delegate" in names:
        kw["pg_options"] = Options(device_backends={"cpu": "gloo"})
    if "deadline" in names:
        timeout = 3.0
    if "cuda" in names:
        kw["backend"] = "cpu:procgroup,cuda:nccl"
    store = init(how, timeout, **kw)
    for n in names:
        SCENARIOS[n]()
    again = how == "store" and WS > 1 and "cuda" not in names
    if again:
        _sparse_fallthrough("first group")  # builds gloo under procgroup over the store
    dist.destroy_process_group()
    if how == "store":  # a second group over the same store must not trip over the first one's keys
        init(how, timeout, store=store, **kw)
        basic()
        if again:  # gloo built underneath again: its own keys, not the first group's
            _sparse_fallthrough("second group over the same store")
        dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
