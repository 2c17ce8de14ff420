"""Where a 4 B all_reduce's time goes on backend="mpi", layer by layer (run under mpirun, rank 0 prints).

    mpirun --allow-run-as-root --oversubscribe -np 2 python benchmarks/results/mpi/layers.py [--no-check]

Each line adds one layer to the one above: raw blocking MPI_Allreduce; MPI_Iallreduce polled with Test
(what never-hang costs); the engine's plan (a warm call shape: on its own communicator, unchecked; with
--no-check no shape gets one and no call is checked); ProcessGroup.run
(sequence number, fingerprint chain, flight record, deadline); the public dist.all_reduce (arguments,
as_flat, plan lookups).  Median of 7 runs of 3000 calls each.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

import procgroup as dist
from procgroup.algorithms.comm import Comm
from procgroup.deadline import Deadline
from procgroup.state import _state

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for _cputime
from _cputime import print_layers  # noqa: E402


def main() -> None:
    dist.init_process_group("mpi", timeout=60)
    from mpi4py import MPI

    g = _state.default
    eng = g.world.engine
    if "--no-check" in sys.argv:
        eng.check_calls = False
    x = np.ones(1, np.float32)
    comm = eng._comms[0]
    plan = eng.all_reduce(g, x.dtype, dist.ReduceOp.SUM)
    c = Comm(g.world.transport, g.ranks, g.rank(), 0, Deadline.after(600))

    def polled() -> None:
        r = comm.Iallreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)
        while not r.Test():
            pass

    layers = [
        ("raw MPI_Allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)),
        ("raw MPI_Iallreduce + Test", polled),
        ("engine plan", lambda: plan(c, x)),
        (
            "ProcessGroup.run(plan)",
            lambda: g.run("all_reduce", lambda cc: plan(cc, x), signature=("all_reduce", "float32", 1, "SUM")),
        ),
        ("dist.all_reduce", lambda: dist.all_reduce(x)),
    ]
    timing = dict(calls=3000, runs=7, clock=time.perf_counter, pick=statistics.median, before=comm.Barrier)
    print_layers(layers, show=dist.get_rank() == 0, **timing)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
