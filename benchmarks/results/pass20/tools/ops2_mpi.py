"""ops2.py's calls through Open MPI (pass 20).

mpirun --allow-run-as-root -n 4 --oversubscribe --mca btl vader,self python ops2_mpi.py
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


b = np.ones(64 << 10, np.float32)
run("bc256K", lambda: c.Bcast(b, 0))
b2 = np.ones(1 << 18, np.float32)
run("bc1M", lambda: c.Bcast(b2, 0))
g_in = np.ones(1 << 16, np.float32)
g_out = np.empty(1 << 18, np.float32)
run("ag1M", lambda: c.Allgather(g_in, g_out))
z = np.zeros(1 << 18, np.float32)
run("ar1M", lambda: c.Allreduce(MPI.IN_PLACE, z))
T = c.gather([ts for _, ts in res], 0)
if r == 0:
    print(
        "MPIRES "
        + " ".join(
            f"{name} {np.median(np.array([T[q][k] for q in range(p)]).max(0)) * 1e6:.0f}"
            for k, (name, _) in enumerate(res)
        )
    )
