"""Same-process A/B of all_to_all's one-copy reads with and without the header's offer (item 3 of README.md).

``old``: the offer is ignored (``_offered_reads`` declines), so the addresses go through an arena exchange first;
``new``: the reads start right after the header exchange.  The big slots' limit is 0, so every stream is read
directly.  Per piece size: slowest rank per call, median over alternating calls.

    SIZES=65536,262144,1048576,4194304 procgroup run --standalone --nproc-per-node 4 a2a_offer_ab.py
"""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import alltoall_shm as A
from procgroup.algorithms import select


def main() -> None:
    dist.init_process_group()
    r, p = dist.get_rank(), dist.get_world_size()
    select.BIG_LIMIT["all_to_all"] = 0
    real = A._offered_reads
    for n in [int(x) for x in os.environ.get("SIZES", "262144,1048576").split(",")]:
        s = np.full(p * n // 4, r, np.float32)
        o = np.empty_like(s)
        t = {"old": [], "new": []}
        for i in range(max(20, min(200, int(4e8 // (n * p))))):
            for m in ("old", "new") if i % 2 else ("new", "old"):
                A._offered_reads = real if m == "new" else (lambda *a: False)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(o, s)
                t[m].append(time.perf_counter() - t0)
        assert all((o[k * (n // 4) : (k + 1) * (n // 4)] == k).all() for k in range(p))
        arr = np.array([t["old"], t["new"]])
        dist.all_reduce(arr, op=dist.ReduceOp.MAX)
        if r == 0:
            old, new = np.median(arr[0]) * 1e6, np.median(arr[1]) * 1e6
            print(f"N={p} piece {n}: old {old:.0f} new {new:.0f} new/old {new / old:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
