"""DDP training of a small MLP on scikit-learn's handwritten digits, launched by ``procgroup run``.

    procgroup run --standalone --nproc-per-node 2 examples/torch_ddp_digits.py --backend procgroup
    procgroup run --standalone --nproc-per-node 2 examples/torch_ddp_digits.py --backend gloo

The digits (1797 8x8 images, 10 classes) ship inside the scikit-learn wheel: nothing is downloaded.  Each rank
reads its shard through DistributedSampler, DDP averages the gradients, and rank 0 prints the global mean loss of
every epoch (the ranks' summed losses, all-reduced) and the held-out accuracy.  With the same seed, the losses
printed with --backend procgroup are bitwise equal to those with --backend gloo at 2 ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    """Train for --epochs epochs; print ``epoch E loss L`` (L as float.hex too, for exact comparison)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="procgroup", help='"procgroup" or "gloo"')
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.backend == "procgroup":
        import procgroup.torch  # noqa: F401  registers the backend (automatic when procgroup is pip-installed)

    dist.init_process_group(backend=args.backend)  # env:// from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    x, y = x[perm], y[perm]
    n_test = 297
    train = TensorDataset(x[n_test:], y[n_test:])
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)  # summed loss, samples
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(xb), len(xb)], dtype=torch.float64)
        dist.all_reduce(total)
        with torch.no_grad():
            acc = (model(x[:n_test]).argmax(1) == y[:n_test]).float().mean().item()
        if rank == 0:
            mean = (total[0] / total[1]).item()
            print(f"epoch {epoch} loss {mean:.6f} ({mean.hex()}) test accuracy {acc:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
