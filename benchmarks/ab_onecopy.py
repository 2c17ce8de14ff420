"""Same-process A/B of the large-message paths of broadcast, all_gather and all_to_all within one host.

Modes (every iteration runs each, rotating which goes first; time = max over ranks; median):

* ``big``: the big shared-memory slots (``select.BIG_LIMIT[op]`` unlimited);
* ``direct``: the one-copy reads (``algorithms.onecopy``: big slots off, ``select._onecopy`` always true);
* ``msg``: the message algorithms (big slots and one-copy reads off);
* ``mpi``: mpi4py's same call, when started by ``mpirun`` with ``USE_MPI=1`` (procgroup then takes its identity
  from Open MPI's variables; MASTER_ADDR/MASTER_PORT must be exported).

Run under the launcher, e.g.::

    OP=all_gather MODES=big,direct,msg SIZES=4194304,16777216 procgroup run --standalone --nproc-per-node 2 \\
        benchmarks/ab_onecopy.py

``SIZES``: bytes of a rank's sendbuf (all_gather), of the buffer (broadcast), of one destination's piece
(all_to_all).  ``select.FORCE`` pins an unrelated collective, so no call runs from a plan.
"""

import os
import time
from typing import Any, Callable, Dict, Tuple

import numpy as np

import procgroup as dist
from procgroup.algorithms import select

USE_MPI = os.environ.get("USE_MPI") == "1"


#: op -> (its mpi4py call on ``comm``, procgroup's call), on the buffers ``a`` (one rank's), ``o`` and ``s``
_CALLS: Dict[str, Tuple[Callable[..., None], Callable[..., None]]] = {
    "all_gather": (lambda c, a, o, s: c.Allgather(a, o), lambda a, o, s: dist.all_gather_into_tensor(o, a)),
    "broadcast": (lambda c, a, o, s: c.Bcast(a, root=0), lambda a, o, s: dist.broadcast(a, src=0)),
    "all_to_all": (lambda c, a, o, s: c.Alltoall(s, o), lambda a, o, s: dist.all_to_all_single(o, s)),
}


def _run(mode: str, op: str, a: np.ndarray, o: np.ndarray, s: np.ndarray, comm: Any) -> None:
    """One call of ``op`` on ``mode``'s path (see the module docstring)."""
    mpi_call, pg_call = _CALLS[op]
    if mode == "mpi":
        assert comm is not None, "mode mpi needs USE_MPI=1 under mpirun"
        mpi_call(comm, a, o, s)
        return
    select.BIG_LIMIT[op] = 1 << 62 if mode == "big" else 0
    select._onecopy = (lambda c, k, nb: True) if mode == "direct" else (lambda c, k, nb: False)
    pg_call(a, o, s)


def main() -> None:
    dist.init_process_group()
    comm = None
    if USE_MPI:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    r, p = dist.get_rank(), dist.get_world_size()
    op = os.environ.get("OP", "all_gather")
    sizes = [int(float(x)) for x in os.environ.get("SIZES", "4194304").split(",")]
    modes = os.environ.get("MODES", "big,direct,msg").split(",")
    select.FORCE["gather"] = "linear"  # no plans: the limits are read per call
    for n in sizes:
        a = np.full(n // 4, r, np.float32)
        o = np.empty(p * (n // 4), np.float32)
        s = np.full(p * (n // 4), r, np.float32)

        iters = max(10, min(100, int(4e8 // (n * p))))
        t = {m: [] for m in modes}
        for i in range(iters):
            for m in modes[i % len(modes) :] + modes[: i % len(modes)]:
                if op == "broadcast":
                    a[:] = r
                comm.Barrier() if comm is not None else dist.barrier()
                t0 = time.perf_counter()
                _run(m, op, a, o, s, comm)
                t[m].append(time.perf_counter() - t0)
                if op == "broadcast":
                    assert (a == 0).all(), m
                elif i == 0:
                    assert all((o[k * (n // 4) : (k + 1) * (n // 4)] == k).all() for k in range(p)), m
        arr = np.array([t[m] for m in modes], np.float64)
        dist.all_reduce(arr, op=dist.ReduceOp.MAX)
        if r == 0:
            med = {m: float(np.median(arr[i])) * 1e6 for i, m in enumerate(modes)}
            ref = modes[-1]
            cols = " ".join(f"{m} {v:9.1f}" for m, v in med.items())
            ratios = " ".join(f"{m} {med[m] / med[ref]:.2f}" for m in modes[:-1])
            print(f"N={p} {op} {n:>9d} {cols}  vs {ref}: {ratios}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
