"""Where a small collective's time goes on backend="cpu", layer by layer (rank 0 prints).

    procgroup run --nproc-per-node 2 benchmarks/layers_cpu.py

Each line adds one layer to the one above: the shm arena's exchange alone; the arena all_reduce
(exchange + reduction); the algorithm selection (``algorithms.all_reduce``); ``ProcessGroup.run`` (guards,
sequence number, fingerprint chain, flight record, deadline); the public ``dist.all_reduce``.  Then the
public barrier, broadcast and reduce.  Median of 7 runs of 3000 calls each.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import procgroup as dist
from procgroup import algorithms as alg
from procgroup.algorithms.arena import allreduce_arena
from procgroup.algorithms.comm import Comm
from procgroup.deadline import Deadline
from procgroup.ops import ReduceOp, reducer
from procgroup.state import _state


def main() -> None:
    dist.init_process_group("cpu", timeout=60)
    g = _state.default
    x = np.ones(1, np.float32)
    kern = reducer(ReduceOp.SUM, x.dtype)
    arena = g.arena()
    c = Comm(g.world.transport, g.ranks, g.rank(), 1, Deadline.after(600), g._hosts, None, arena)
    mv = memoryview(x).cast("B")
    dl = Deadline.after(600)
    layers = [
        ("arena.exchange", lambda: arena.exchange(mv, 7, dl)),
        ("allreduce_arena", lambda: allreduce_arena(c, x, kern)),
        ("algorithms.all_reduce", lambda: alg.all_reduce(c, x, kern)),
        (
            "ProcessGroup.run",
            lambda: g.run(
                "all_reduce", lambda cc: alg.all_reduce(cc, x, kern), signature=("all_reduce", "float32", 1, "SUM")
            ),
        ),
        ("dist.all_reduce", lambda: dist.all_reduce(x)),
        ("dist.barrier", lambda: dist.barrier()),
        ("dist.broadcast", lambda: dist.broadcast(x, 0)),
        ("dist.reduce", lambda: dist.reduce(x, 0)),
    ]
    for name, f in layers:
        runs = []
        for _ in range(7):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(3000):
                f()
            runs.append((time.perf_counter() - t) / 3000 * 1e6)
        if dist.get_rank() == 0:
            print(f"{name:24s} {statistics.median(runs):6.2f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
