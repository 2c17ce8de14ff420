"""The floor of procgroup's mpi backend at 4 B: raw mpi4py blocking, raw nonblocking + Test, procgroup, one job.

    mpirun --allow-run-as-root --oversubscribe -np 2 python benchmarks/mpi_floor.py [--rounds 3] [--ops ...]

(``-np 4`` for N=4; rank 0 prints; ``--help`` for the options.)  procgroup's mpi backend never makes a blocking
MPI call (one cannot be interrupted, so a dead or absent peer would hang it): every collective posts MPI's
nonblocking form and polls it with ``Test`` under the call's deadline.  So for each op this prints three
columns, all in the same job and alternating within each round, and what procgroup adds over each:

* ``block``: raw mpi4py's blocking call (``comm.Allreduce``, ``Bcast``, ``Reduce``, ``Allgather``, ``Barrier``);
* ``nonbl``: raw mpi4py's nonblocking call polled by ``while not req.Test(): pass`` (``Iallreduce``, ...):
  the floor of any never-hang implementation over MPI's collectives;
* ``pg``: ``procgroup`` (``dist.all_reduce(x)``, ...) on backend="mpi", warm (every call shape on its own
  communicator, planned calls);
* ``+block`` = pg - block (the issue's target: at most 3 us), ``+nonbl`` = pg - nonbl (procgroup's own cost).

4 B = one float32 (all_gather: one per rank); reductions SUM, root 0.  The raw calls run on a duplicate of
COMM_WORLD (so they never meet procgroup's communicators).  For a shared machine: each number is the minimum
over ``--runs`` runs of ``--calls`` back-to-back calls (other users' load only ever adds time; ``--stat median``
for the typical run instead), wall clock, every rank in the loop (the slowest decides), a barrier before each
run; the median over ``--rounds`` rounds.
``procgroup bench --backend mpi --compare mpi`` compares procgroup with raw mpi4py's blocking calls too, but in
separate jobs and without the nonblocking floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import procgroup as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _cputime
from _cputime import per_call_us  # noqa: E402

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "barrier")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mpirun --allow-run-as-root --oversubscribe -np N python benchmarks/mpi_floor.py",
        description="raw mpi4py blocking vs nonblocking + Test vs procgroup backend='mpi', 4 B, in one MPI job",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds (each op's three columns alternate per round)")
    p.add_argument("--calls", type=int, default=500, help="back-to-back calls per timed run")
    p.add_argument("--runs", type=int, default=40, help="timed runs per number (their minimum is taken)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--stat", choices=("min", "median"), default="min", help="which run of --runs gives the number")
    return p.parse_args()


def _poll(req: object) -> None:
    while not req.Test():  # type: ignore[attr-defined]
        pass


def main() -> None:
    ns = _args()
    dist.init_process_group("mpi", timeout=60)
    from mpi4py import MPI

    w = MPI.COMM_WORLD.Dup()
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.zeros(1, np.float32)
    y = np.zeros(n, np.float32)
    ip, fsum = MPI.IN_PLACE, MPI.SUM
    root = r == 0
    table = {
        "all_reduce": (
            lambda: w.Allreduce(ip, x, fsum),
            lambda: _poll(w.Iallreduce(ip, x, fsum)),
            lambda: dist.all_reduce(x),
        ),
        "broadcast": (lambda: w.Bcast(x, 0), lambda: _poll(w.Ibcast(x, 0)), lambda: dist.broadcast(x, 0)),
        "reduce": (
            (lambda: w.Reduce(ip, x, fsum, 0)) if root else (lambda: w.Reduce(x, None, fsum, 0)),
            (lambda: _poll(w.Ireduce(ip, x, fsum, 0))) if root else (lambda: _poll(w.Ireduce(x, None, fsum, 0))),
            lambda: dist.reduce(x, 0),
        ),
        "all_gather": (
            lambda: w.Allgather(x, y),
            lambda: _poll(w.Iallgather(x, y)),
            lambda: dist.all_gather_into_tensor(y, x),
        ),
        "barrier": (lambda: w.Barrier(), lambda: _poll(w.Ibarrier()), lambda: dist.barrier()),
    }
    ops = [o for o in ns.ops.split(",") if o]
    for _ in range(10):  # warm: every shape on its own communicator, every plan made
        for op in ops:
            for f in table[op]:
                f()
    got = {op: ([], [], []) for op in ops}
    pick = min if ns.stat == "min" else statistics.median
    for _ in range(ns.rounds):
        for op in ops:
            for k, f in enumerate(table[op]):
                us = per_call_us(f, calls=ns.calls, runs=ns.runs, clock=time.perf_counter, pick=pick, before=w.Barrier)
                got[op][k].append(us)
    if r == 0:
        med = statistics.median
        print(f"N={n}, {MPI.Get_library_version().splitlines()[0]}, mpi4py {_version()}")
        print(f"us per call, {ns.stat} over {ns.runs} runs of {ns.calls} calls, median of {ns.rounds} rounds")
        print(f"{'op':11s} {'block':>7s} {'nonbl':>7s} {'pg':>7s} {'+block':>7s} {'+nonbl':>7s}   +block per round")
        for op, (blk, nb, pg) in got.items():
            added = [p - q for p, q in zip(pg, blk)]
            over_nb = [p - q for p, q in zip(pg, nb)]
            per_round = " ".join(f"{a:+.2f}" for a in added)
            print(
                f"{op:11s} {med(blk):7.2f} {med(nb):7.2f} {med(pg):7.2f} {med(added):+7.2f} {med(over_nb):+7.2f}   "
                f"{per_round}"
            )
    w.Free()
    dist.destroy_process_group()


def _version() -> str:
    import mpi4py

    return str(mpi4py.__version__)


if __name__ == "__main__":
    main()
