"""The distribution of the multi-host all_reduce's per-iteration time, procgroup or Open MPI (pass 15).

IT back-to-back all_reduce calls of SZ bytes of float32 after 20 warm-up calls; each rank records every call's
duration (from the end of the previous call), and rank 0 prints percentiles 10/25/50/75/90/99 of the slowest rank
per iteration (the harness's measure, ``benchmarks/multihost.py``) and the mean per call.  ``MPI=1``: Open MPI
through mpi4py (``Allreduce`` into a second buffer, as ``../pass14/mpi_loop.py``); else procgroup.  ``NOGC=1``
disables Python's garbage collector (it made no difference).  ``WIN=1`` (pass 18) also prints the median of the
slowest rank per window of calls (0-60, 60-120, ...), as ``../pass11/loop.py``'s: both systems' slow first calls.
Run as ``../pass11/mh_loop.sh`` runs ``loop.py``, or under the mpirun line of ``../pass14/README.md`` with
``-x MPI=1``.
"""

import os
import time

import numpy as np

if os.environ.get("MPI"):
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    r = c.Get_rank()

    def ar(x, y):
        c.Allreduce(x, y)

    def gather(t):
        return c.gather(t, root=0)

    def barrier():
        c.Barrier()
else:
    import procgroup as dist

    dist.init_process_group("gloo")
    r = dist.get_rank()

    def ar(x, y):
        dist.all_reduce(x)

    def gather(t):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, t)
        return out

    def barrier():
        dist.barrier()


import gc

if os.environ.get("NOGC"):
    gc.disable()
n = int(os.environ.get("SZ", 1048576)) // 4
it = int(os.environ.get("IT", 300))
x = np.ones(n, np.float32)
y = np.empty_like(x)
for _ in range(20):
    ar(x, y)
barrier()
ts = np.zeros(it)
t = time.perf_counter()
for k in range(it):
    ar(x, y)
    t2 = time.perf_counter()
    ts[k] = t2 - t
    t = t2
rows = gather(ts)
if r == 0:
    m = np.max(np.array(rows), axis=0) * 1e6
    me = np.mean(np.array(rows), axis=1).mean() * 1e6
    q = np.percentile(m, [10, 25, 50, 75, 90, 99])
    print(
        ("MPI" if os.environ.get("MPI") else "PG "),
        os.environ.get("SZ"),
        "max-per-iter pcts 10/25/50/75/90/99:",
        " ".join(f"{v:.0f}" for v in q),
        f"mean {me:.0f}",
        flush=True,
    )
    if os.environ.get("WIN"):  # pass 18: the median per window of calls, as ../pass11/loop.py's WIN=1
        edges = [e for e in (0, 60, 120, 180, 240, 300, 360, 480, 960, 1500, 3000) if e < it] + [it]
        print("windows:", " ".join(f"{a}-{b}: {np.median(m[a:b]):.0f}" for a, b in zip(edges, edges[1:])), flush=True)
