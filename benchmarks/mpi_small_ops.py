"""procgroup's mpi backend against raw mpi4py at 4 B, five ops, one job (run under mpirun; rank 0 prints).

    mpirun --allow-run-as-root --oversubscribe -np 2 python benchmarks/mpi_small_ops.py [ROUNDS]

For a shared machine: each line is the minimum over 40 runs of 500 back-to-back calls (other users' load
only ever adds time, so the minimum is the run they left alone), per round, and the rounds' median.  Raw
and procgroup alternate within each round, so "added" (procgroup minus raw) compares like with like; all_gather
moves one float32 per rank.  Wall clock, every rank in the loop (the time of the slowest decides).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

import procgroup as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _cputime
from _cputime import per_call_us  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dist.init_process_group("mpi", timeout=60)
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.zeros(1, np.float32)
    y = np.zeros(n, np.float32)
    ip, fsum = MPI.IN_PLACE, MPI.SUM
    raw_reduce = (lambda: w.Reduce(ip, x, fsum, 0)) if r == 0 else (lambda: w.Reduce(x, None, fsum, 0))
    ops = [
        ("all_reduce", lambda: w.Allreduce(ip, x, fsum), lambda: dist.all_reduce(x)),
        ("broadcast", lambda: w.Bcast(x, 0), lambda: dist.broadcast(x, 0)),
        ("reduce", raw_reduce, lambda: dist.reduce(x, 0)),
        ("all_gather", lambda: w.Allgather(x, y), lambda: dist.all_gather_into_tensor(y, x)),
        ("barrier", lambda: w.Barrier(), lambda: dist.barrier()),
    ]
    for _ in range(10):  # warm: every shape on its own communicator
        for _name, raw, pg in ops:
            raw()
            pg()
    got: dict = {name: ([], []) for name, _, _ in ops}
    for _ in range(rounds):
        for name, raw, pg in ops:
            for k, f in enumerate((raw, pg)):
                us = per_call_us(f, calls=500, runs=40, clock=time.perf_counter, pick=min, before=w.Barrier)
                got[name][k].append(us)
    if r == 0:
        print(f"N={n}, {MPI.Get_library_version().splitlines()[0]}; min over 40 runs of 500 calls, per round")
        print(f"{'op':11s} {'raw us':>7s} {'pg us':>7s} {'added':>7s}   added per round")
        for name, (raw_us, pg_us) in got.items():
            added = [p - q for p, q in zip(pg_us, raw_us)]
            med = statistics.median
            rounds_text = " ".join(f"{a:+.2f}" for a in added)
            print(f"{name:11s} {med(raw_us):7.2f} {med(pg_us):7.2f} {med(added):+7.2f}   {rounds_text}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
