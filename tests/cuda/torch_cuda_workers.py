"""Worker programs for tests/cuda/test_torch_cuda.py: ``python torch_cuda_workers.py SCENARIO``.

Each rank forms torch's default group with backend "procgroup" (or "cpu:procgroup,cuda:nccl") over env://,
runs SCENARIO on CUDA tensors with closed-form expected values, prints OK and exits 0, or raises naming
what differed.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import procgroup.torch  # noqa: F401 - registers "procgroup"
from procgroup.torch.backend import ProcgroupBackend

RANK = int(os.environ["RANK"])
WS = int(os.environ["WORLD_SIZE"])
S = WS * (WS + 1) // 2  # sum over ranks of (rank + 1)


def check(cond: bool, what: str) -> None:
    """Raise naming the rank and the failed expectation."""
    if not cond:
        raise AssertionError(f"rank {RANK}/{WS}: {what}")


def eq(t: torch.Tensor, value: Any, what: str) -> None:
    """Every element of ``t`` equals ``value``."""
    check(bool((t.double().cpu() == float(value)).all()), f"{what}: expected all {value}, got {t.tolist()}")


def collectives() -> None:
    """Every collective torch routes, on CUDA tensors, each dtype NCCL reduces; a CPU op in the same group."""
    dev = torch.device("cuda", torch.cuda.current_device())
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        t = torch.full((1001,), RANK + 1, dtype=dt, device=dev)
        dist.all_reduce(t)
        eq(t, S, f"all_reduce {dt}")
        m = torch.full((7,), RANK + 1, dtype=dt, device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        eq(m, WS, f"all_reduce MAX {dt}")
    nc = torch.full((8, 6), float(RANK + 1), device=dev)[:, ::2]  # not contiguous
    dist.all_reduce(nc)
    eq(nc, S, "all_reduce of a non-contiguous CUDA tensor")
    for root in range(WS):
        b = torch.full((5,), float(root + 10) if RANK == root else -1.0, device=dev)
        dist.broadcast(b, root)
        eq(b, root + 10, f"broadcast root {root}")
        r = torch.full((5,), float(RANK + 1), device=dev)
        dist.reduce(r, root)
        if RANK == root:
            eq(r, S, f"reduce root {root}")
    outs = [torch.zeros(3, device=dev) for _ in range(WS)]
    dist.all_gather(outs, torch.full((3,), float(RANK), device=dev))
    for i, o in enumerate(outs):
        eq(o, i, f"all_gather piece {i}")
    big = torch.zeros(WS * 2, device=dev)
    dist.all_gather_into_tensor(big, torch.full((2,), float(RANK), device=dev))
    check(torch.equal(big.cpu(), torch.arange(float(WS)).repeat_interleave(2)), f"all_gather_into_tensor {big}")
    out = torch.zeros(4, device=dev)
    dist.reduce_scatter_tensor(out, torch.full((WS * 4,), float(RANK + 1), device=dev))
    eq(out, S, "reduce_scatter_tensor")
    a2a_out = torch.zeros(WS, device=dev)
    dist.all_to_all_single(a2a_out, torch.full((WS,), float(RANK), device=dev))
    check(torch.equal(a2a_out.cpu(), torch.arange(float(WS))), f"all_to_all_single {a2a_out}")
    w = dist.all_reduce(torch.ones(3, device=dev), async_op=True)
    w.wait()
    fut = dist.all_reduce(torch.ones(2, device=dev), async_op=True).get_future()
    eq(fut.wait()[0], WS, "async all_reduce future value")
    dist.barrier(device_ids=[dev.index])
    c = torch.full((4,), float(RANK + 1))
    dist.all_reduce(c)
    eq(c, S, "CPU all_reduce in the same group (procgroup's own)")
    pg = dist.distributed_c10d._get_default_group()
    check(isinstance(pg, ProcgroupBackend), f"default group is {type(pg).__name__}")
    check("nccl" in pg._others and not pg.fallthrough_counts, f"cuda went to {pg._others} {pg.fallthrough_counts}")
    check(type(pg._get_backend(dev)).__name__ == "ProcessGroupNCCL", f"_get_backend(cuda) {pg._get_backend(dev)}")
    print("collectives on", torch.cuda.get_device_name(dev), "torch", torch.__version__, flush=True)


def ddp() -> None:
    """DDP on a CUDA model over "procgroup": parameters bit for bit those of the same steps without DDP (ws 1)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(dev),
        device_ids=[dev.index],
        bucket_cap_mb=0.05,  # several buckets
    )
    model.module.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _step in range(3):
        x = torch.randn(32, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (32,), generator=g).to(dev)
        for m, o in zip((ref, model), opts):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    if WS == 1:
        for (n, a), b in zip(ref.named_parameters(), model.module.parameters()):
            check(torch.equal(a, b), f"DDP parameter {n} differs from the same steps without DDP")
    print("ddp ok", flush=True)


def shared_gpu() -> None:
    """Two ranks on one GPU: procgroup's ConfigError names both ranks and the fix, on every rank, no hang."""
    torch.cuda.set_device(0)
    t = torch.ones(4, device="cuda:0")
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        msg = str(e)
        check(type(e).__name__ == "ConfigError", f"raised {type(e).__name__}: {msg}")
        check("both use the same GPU" in msg and "ranks 0 and 1" in msg and "set_device" in msg, f"message: {msg}")
        print("raised:", msg, flush=True)
        return
    raise AssertionError(f"rank {RANK}: two ranks on one GPU did not raise")


SCENARIOS = {"collectives": collectives, "ddp": ddp, "shared_gpu": shared_gpu}


def main() -> None:
    """``SCENARIO [BACKEND]``."""
    name = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "procgroup"
    if name != "shared_gpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    SCENARIOS[name]()
    dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
