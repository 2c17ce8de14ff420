"""Open MPI's side of ``../pass11/loop.py``: IT back-to-back ``Allreduce`` calls of SZ bytes of float32 (pass 14).

Rank 0 prints the mean time per call (the job's throughput) and every rank's user and system CPU per call.  Run it
with the MCA settings of ``benchmarks/multihost.py --mpi-configs ring`` (see this folder's README).
"""

import os
import resource
import time

import numpy as np
from mpi4py import MPI

c = MPI.COMM_WORLD
n = int(os.environ.get("SZ", 4194304)) // 4
x = np.ones(n, np.float32)
y = np.empty_like(x)
for _ in range(10):
    c.Allreduce(x, y)
c.Barrier()
iters = int(os.environ.get("IT", 400))
r0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
for _ in range(iters):
    c.Allreduce(x, y)
dt = time.perf_counter() - t
r1 = resource.getrusage(resource.RUSAGE_SELF)
c.Barrier()
cpu = ((r1.ru_utime - r0.ru_utime) / iters * 1e6, (r1.ru_stime - r0.ru_stime) / iters * 1e6)
rows = c.gather(cpu, root=0)
if c.rank == 0:
    per_rank = " ".join(f"r{i} u{u:.0f} s{s:.0f}" for i, (u, s) in enumerate(rows))
    print(f"mpi {n * 4} B: mean per call {dt / iters * 1e6:.0f} us; CPU per call: {per_rank}", flush=True)
