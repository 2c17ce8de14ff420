"""One rank of a DDP / FSDP2 training case, run by ``procgroup run`` (see test_train.py).

usage: train_worker.py CASE BACKEND OUTDIR.  Each rank writes OUTDIR/rank<R>.pt (a dict of tensors) and prints
"OK <case> rank <r>".  The checks that need both ranks' results are made by the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import procgroup.torch  # noqa: F401  registers "procgroup" (the unmodified-script test relies on autoload instead)

STEPS = 3
BATCH = 8


def make_model() -> nn.Module:
    """A small MLP with several parameters, so a tiny bucket cap makes several buckets; same init on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-(step, rank) data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def reference(world: int, steps: int, micro: int = 1) -> list[torch.Tensor]:
    """Single-process SGD on every rank's data, averaging per-rank mean losses: what DDP must reproduce."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            for r in range(world):
                x, y = batch(s * micro + m, r)
                (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    case, backend, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, object] = {}
    if case == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for s in range(2):
            opt.zero_grad()
            x, y = batch(s, rank)
            loss = nn.functional.mse_loss(model(x), y)  # FSDP averages gradients over ranks itself
            loss.backward()
            opt.step()
            losses.append(loss.item())
        result["losses"] = torch.tensor(losses)
        result["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
        result["reference"] = reference(world, 2)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # bucket_cap_mb tiny: every parameter pair is its own bucket, so bucketing and ordering are exercised
        model = DDP(make_model(), bucket_cap_mb=0.005)
        if case == "fp16_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif case == "allreduce_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if case == "join":
            from torch.distributed.algorithms.join import Join

            n_batches = 3 if rank == 0 else 5  # uneven inputs
            with Join([model]):
                for s in range(n_batches):
                    opt.zero_grad()
                    x, y = batch(s, rank)
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
            result["n_batches"] = torch.tensor(n_batches)
        elif case == "no_sync":
            micro = 2
            for s in range(STEPS):
                opt.zero_grad()
                for m in range(micro):
                    x, y = batch(s * micro + m, rank)
                    loss = nn.functional.mse_loss(model(x), y)
                    if m < micro - 1:
                        with model.no_sync():  # accumulate locally, no allreduce
                            loss.backward()
                    else:
                        loss.backward()
                opt.step()
            result["reference"] = reference(world, STEPS, micro)
        else:  # bucketed / fp16_hook / allreduce_hook
            for s in range(STEPS):
                opt.zero_grad()
                x, y = batch(s, rank)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            result["reference"] = reference(world, STEPS)
        result["params"] = [p.detach().clone() for p in model.parameters()]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {case} rank {rank}", flush=True)


if __name__ == "__main__":
    main()
