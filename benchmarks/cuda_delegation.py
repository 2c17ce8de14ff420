"""What procgroup's torch backend adds to a CUDA collective it hands to torch's NCCL (needs a GPU).

One process (world size 1: NCCL needs one GPU per rank, and the GPU machines here have one), five groups in
turn: torch's own ``nccl``, ``procgroup`` (CUDA tensors routed to the NCCL it builds underneath),
``cpu:procgroup,cuda:nccl``, torch's nccl with a ``torch.cuda.synchronize()`` after each call, and procgroup's
own API with ``backend="nccl"`` (whose blocking calls return once complete on the device).  For each,
``--iters`` blocking all_reduce calls per size, timed with a ``torch.cuda.synchronize()`` at the end, median of
``--repeat`` rounds; prints µs per call and the ratio to torch's nccl.
Run: ``python benchmarks/cuda_delegation.py --repeat 5``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import procgroup.torch  # noqa: E402,F401 - registers "procgroup"
from procgroup.netutil import free_port  # noqa: E402


def one(backend: str, sizes: list, iters: int, repeat: int) -> dict:
    """µs per blocking all_reduce at each size (median over ``repeat`` rounds) under ``backend``
    (``own-api``: procgroup's own ``init_process_group("nccl")`` and ``procgroup.all_reduce``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    if backend == "own-api":
        import procgroup as api

        api.init_process_group("nccl", timeout=60)
        all_reduce, destroy = api.all_reduce, api.destroy_process_group
    elif backend == "nccl+sync":  # torch's nccl, each call waited for on the device as procgroup's own API does

        def all_reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t)
            torch.cuda.synchronize()

        dist.init_process_group("nccl", timeout=timedelta(seconds=60))
        destroy = dist.destroy_process_group
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=60))
        all_reduce, destroy = dist.all_reduce, dist.destroy_process_group
    out = {}
    for n in sizes:
        t = torch.ones(max(1, n // 4), device="cuda")
        for _ in range(20):
            all_reduce(t)
        torch.cuda.synchronize()
        rounds = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(iters):
                all_reduce(t)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / iters * 1e6)
        out[n] = statistics.median(rounds)
    destroy()
    return out


def main() -> None:
    """Parse the flags, run the three backends, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4,65536,16777216", help="bytes per call, comma-separated")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    torch.cuda.set_device(0)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    names = ("nccl", "procgroup", "cpu:procgroup,cuda:nccl", "nccl+sync", "own-api")
    res = {b: one(b, sizes, a.iters, a.repeat) for b in names}
    print(
        "µs per call (ratio to torch's nccl); nccl+sync: each call followed by torch.cuda.synchronize(); "
        "own-api: procgroup.all_reduce with backend='nccl' (returns once complete on the device)"
    )
    print(f"{'bytes':>10} " + " ".join(f"{b:>26}" for b in names))
    for n in sizes:
        base = res["nccl"][n]
        print(f"{n:>10} " + " ".join(f"{res[b][n]:>18.2f} ({res[b][n] / base:4.2f})" for b in names))


if __name__ == "__main__":
    main()
