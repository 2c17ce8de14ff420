"""Back-to-back A/B of a broadcast's or all_gather's paths, timed as ``procgroup bench`` times (each iteration's
time, the slowest rank's, median), in blocks of K calls per path, the order alternating per block.

Paths: ``big`` (the big slots), ``direct`` (the one-copy reads), ``msg`` (the message algorithms).

    OP=broadcast MODES=big,direct,msg SIZES=1048576,4194304 procgroup run --standalone --nproc-per-node 4 b2b.py
"""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import select


def setmode(op: str, m: str) -> None:
    """Pin ``op`` to path ``m`` (select.FORCE elsewhere keeps the calls off the plans)."""
    select.BIG_LIMIT[op] = 1 << 62 if m == "big" else 0
    select.ONECOPY_MIN[op] = 0 if m == "direct" else 1 << 62
    select._onecopy = (lambda c, k, nb: True) if m == "direct" else (lambda c, k, nb: False)


def main() -> None:
    dist.init_process_group()
    r, p = dist.get_rank(), dist.get_world_size()
    op = os.environ.get("OP", "broadcast")
    modes = os.environ.get("MODES", "big,direct").split(",")
    blk = int(os.environ.get("K", 10))
    select.FORCE["gather"] = "linear"  # no plans: the limits are read per call
    for n in [int(float(x)) for x in os.environ.get("SIZES", "4194304").split(",")]:
        a = np.full(n // 4, r, np.float32)
        o = np.empty(p * (n // 4), np.float32)

        def call(a: np.ndarray = a, o: np.ndarray = o) -> None:
            if op == "broadcast":
                dist.broadcast(a, src=0)
            else:
                dist.all_gather_into_tensor(o, a)

        t = {m: [] for m in modes}
        for b in range(max(4, min(30, int(2e9 // (n * p * blk))))):
            for m in modes if b % 2 == 0 else modes[::-1]:
                setmode(op, m)
                dist.barrier()
                call()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(blk):
                    call()
                    t1 = time.perf_counter()
                    t[m].append(t1 - t0)
                    t0 = t1
        arr = np.array([t[m] for m in modes])
        dist.all_reduce(arr, op=dist.ReduceOp.MAX)
        if r == 0:
            cols = " ".join(
                f"{m} {np.median(arr[i]) * 1e6:.0f}/p90 {np.percentile(arr[i], 90) * 1e6:.0f}"
                for i, m in enumerate(modes)
            )
            print(f"N={p} {op} {n}: {cols}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
