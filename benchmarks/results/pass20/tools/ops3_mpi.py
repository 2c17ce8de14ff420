"""ops3.py's calls through Open MPI (pass 20).

mpirun --allow-run-as-root -n 4 --oversubscribe --mca btl vader,self python ops3_mpi.py
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


rb = np.zeros(64 << 8, np.float32)
ro = np.empty_like(rb)
run("red64K", lambda: c.Reduce(rb, ro, root=0))
a = np.ones(1 << 14, np.float32)
d = np.empty_like(a)
run("a2a64K", lambda: c.Alltoall(a, d))
b = np.ones(1 << 20, np.float32)
run("bc4M", lambda: c.Bcast(b, 0), it=100)
x = np.ones(1 << 14, np.float32)
y = np.empty(1 << 12, np.float32)
run("rs64K", lambda: c.Reduce_scatter_block(x, y))
T = c.gather([ts for _, ts in res], 0)
if r == 0:
    print(
        "MPIRES "
        + " ".join(
            f"{name} {np.median(np.array([T[q][k] for q in range(p)]).max(0)) * 1e6:.0f}"
            for k, (name, _) in enumerate(res)
        )
    )
