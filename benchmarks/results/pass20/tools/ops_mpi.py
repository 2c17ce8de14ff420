"""ops.py's calls through Open MPI (pass 20).

mpirun --allow-run-as-root -n 4 --oversubscribe --mca btl vader,self python ops_mpi.py
"""

import time

import numpy as np
from mpi4py import MPI

c = MPI.COMM_WORLD
r, p = c.rank, c.size
res = []


def run(name, fn, it=300):
    for _ in range(30):
        fn()
    c.Barrier()
    ts = np.empty(it)
    t = time.perf_counter()
    for i in range(it):
        fn()
        t2 = time.perf_counter()
        ts[i] = t2 - t
        t = t2
    res.append((name, ts))


b = np.ones(64 << 8, np.float32)
run("bc64K", lambda: c.Bcast(b, 0))
x = np.ones(64 << 10, np.float32)
y = np.empty(16 << 10, np.float32)
run("rs256K", lambda: c.Reduce_scatter_block(x, y))
g_in = np.ones(4 << 10, np.float32)
g_out = np.empty(16 << 10, np.float32)
run("ag64K", lambda: c.Allgather(g_in, g_out))
a = np.ones(1 << 18, np.float32)
d = np.empty_like(a)
run("a2a1M", lambda: c.Alltoall(a, d))
T = c.gather([ts for _, ts in res], 0)
if r == 0:
    print(
        "MPIRES "
        + " ".join(
            f"{name} {np.median(np.array([T[q][k] for q in range(p)]).max(0)) * 1e6:.0f}"
            for k, (name, _) in enumerate(res)
        )
    )
