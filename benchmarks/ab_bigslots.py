"""Same-process A/B of the big shared-memory slots against the message algorithms (how select.BIG_LIMIT was set).

Run under the launcher, e.g.::

    OPS=all_reduce,broadcast SIZES=65536,1048576 procgroup run --standalone --nproc-per-node 2 benchmarks/ab_bigslots.py

Every iteration runs both paths, alternating which goes first; time = max over ranks; prints the medians and
big/old (< 1: the big slots are faster).
"""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import select


def _call(op: str, n: int, p: int):
    a = np.zeros(n // 4, np.float32)
    if op == "all_reduce":
        return lambda: dist.all_reduce(a)
    if op == "broadcast":
        return lambda: dist.broadcast(a, src=0)
    if op == "reduce":
        return lambda: dist.reduce(a, dst=0)
    if op == "all_gather":
        o = np.empty(p * (n // 4), np.float32)
        return lambda: dist.all_gather_into_tensor(o, a)
    if op == "reduce_scatter":
        s = np.zeros(p * (n // 4), np.float32)
        return lambda: dist.reduce_scatter_tensor(a, s)
    raise SystemExit(f"unknown op {op}")


def main() -> None:
    dist.init_process_group()
    r, p = dist.get_rank(), dist.get_world_size()
    ops = os.environ.get("OPS", "all_reduce").split(",")
    sizes = [int(float(x)) for x in os.environ.get("SIZES", "65536,262144,1048576,4194304").split(",")]
    for op in ops:
        for n in sizes:
            f = _call(op, n, p)
            iters = max(10, min(80, int(4e7 // n)))
            t = {"old": [], "big": []}
            for i in range(iters):
                for mode in ("old", "big") if i % 2 else ("big", "old"):
                    select.BIG_LIMIT[op] = 0 if mode == "old" else 1 << 62
                    dist.barrier()
                    t0 = time.perf_counter()
                    f()
                    t[mode].append(time.perf_counter() - t0)
            arr = np.array([t["old"], t["big"]], np.float64)
            dist.all_reduce(arr, op=dist.ReduceOp.MAX)
            mo, mb = np.median(arr[0]) * 1e6, np.median(arr[1]) * 1e6
            if r == 0:
                print(f"N={p} {op:15s} {n:>9d} old {mo:9.1f} big {mb:9.1f} big/old {mb / mo:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
