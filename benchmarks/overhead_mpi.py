"""The Python cost per layer of a 4 B all_reduce on backend="mpi", in one rank (no peer to wait for).

    mpirun --allow-run-as-root -np 1 python benchmarks/overhead_mpi.py

As benchmarks/results/mpi/layers.py, but in a world of one rank and timed in CPU time of this thread
(best of 7 runs of 20000 calls), so that the numbers do not move with other users' load: each line is what
its layer adds in Python over the one above, on top of what MPI's own calls cost in this process.
"""

from __future__ import annotations

import numpy as np
from _cputime import print_layers  # benchmarks/_cputime.py (this script's directory is on sys.path)

import procgroup as dist
from procgroup.algorithms.comm import Comm
from procgroup.backends.mpi import engine
from procgroup.deadline import Deadline
from procgroup.state import _state


def main() -> None:
    dist.init_process_group("mpi", timeout=60)
    from mpi4py import MPI

    g = _state.default
    eng = g.world.engine
    x = np.ones(1, np.float32)
    comm = eng._comms[0]
    plan = eng.all_reduce(g, x.dtype, dist.ReduceOp.SUM)
    c = Comm(g.world.transport, g.ranks, g.rank(), 0, Deadline.after(600))

    def polled() -> None:
        r = comm.Iallreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)
        while not r.Test():
            pass

    def checked() -> None:  # every call as a shape's first calls: the check beside it, no own communicator
        eng.check_calls = True
        engine.DEDICATE_AFTER = 1 << 62
        plan(c, x)

    def unchecked() -> None:
        eng.check_calls = False
        plan(c, x)

    def own() -> None:  # a warm shape: its own communicator, no check
        eng.check_calls = True
        engine.DEDICATE_AFTER = dedicate_after
        if fresh:
            eng._seen.clear()  # counted past DEDICATE_AFTER by the layer above
            fresh.clear()
        plan(c, x)

    dedicate_after = engine.DEDICATE_AFTER
    fresh = [True]
    eng.own(0).clear()
    layers = [
        ("raw MPI_Allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)),
        ("raw MPI_Iallreduce + Test", polled),
        ("engine plan, no call check", unchecked),
        ("engine plan, checked", checked),
        ("engine plan, own comm", own),
        ("dist.all_reduce", lambda: dist.all_reduce(x)),
        ("dist.barrier", lambda: dist.barrier()),
        ("dist.broadcast", lambda: dist.broadcast(x, 0)),
    ]
    print_layers(layers)
    eng.check_calls = True
    engine.DEDICATE_AFTER = dedicate_after
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
