"""100 back-to-back all_gathers (or broadcasts, ``OP=broadcast``) of ``N`` bytes a rank; rank 0 prints the slowest
rank's time per call, median of each 10, and every rank its page faults and CPU per call.  ``PIN=0011`` pins rank
r to CPU ``PIN[r]``; ``GAP=1`` reads /proc/self/stat between calls (a pause of a few us) and prints the CPUs used.

    OP=broadcast N=4194304 PIN=0011 procgroup run --standalone --nproc-per-node 4 modes.py
"""

import os
import resource
import time

import numpy as np

import procgroup as dist


def _cpu() -> int:
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])


def main() -> None:
    dist.init_process_group()
    if os.environ.get("PIN"):
        os.sched_setaffinity(0, {int(os.environ["PIN"][dist.get_rank()])})
    r, p = dist.get_rank(), dist.get_world_size()
    n = int(os.environ.get("N", 8 << 20))
    op = os.environ.get("OP", "all_gather")
    gap = os.environ.get("GAP") == "1"
    a = np.full(n // 4, r, np.float32)
    o = np.empty(p * (n // 4), np.float32)

    def call() -> None:
        if op == "all_gather":
            dist.all_gather_into_tensor(o, a)
        else:
            dist.broadcast(a, src=0)

    for _ in range(5):
        call()
    dist.barrier()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    ts, cpus = [], []
    t = time.perf_counter()
    for _ in range(100):
        call()
        t2 = time.perf_counter()
        ts.append(t2 - t)
        t = t2
        if gap:
            cpus.append(_cpu())
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    flt = (ru1.ru_minflt - ru0.ru_minflt) / 100
    sys_us, usr_us = (ru1.ru_stime - ru0.ru_stime) * 1e4, (ru1.ru_utime - ru0.ru_utime) * 1e4
    print(f"rank {r} minflt/call {flt:.0f} sys/call {sys_us:.0f}us user/call {usr_us:.0f}us", flush=True)
    if gap:
        print(f"rank {r} cpus", "".join(map(str, cpus[:60])), flush=True)
    arr = np.array(ts)
    dist.all_reduce(arr, op=dist.ReduceOp.MAX)
    if r == 0:
        print("per-10 medians us:", " ".join(f"{np.median(b) * 1e6:.0f}" for b in arr.reshape(10, 10)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
