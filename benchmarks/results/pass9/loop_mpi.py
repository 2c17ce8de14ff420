"""loop.py's measure for Open MPI through mpi4py (Allreduce of SZ bytes of float32, IT calls back to back).

Started by ``mpirun`` with the MCA settings of ``benchmarks/multihost.py``'s ``mpi-ring`` (see README.md).
"""

import os
import resource
import time

import numpy as np
from mpi4py import MPI

c = MPI.COMM_WORLD
size, iters = int(os.environ.get("SZ", 65536)), int(os.environ.get("IT", 300))
a = np.zeros(size // 4, np.float32)
b = np.empty_like(a)
for _ in range(20):
    c.Allreduce(a, b)
c.Barrier()
ru0 = resource.getrusage(resource.RUSAGE_SELF)
ends = []
for _ in range(iters):
    c.Allreduce(a, b)
    ends.append(time.perf_counter())
ru1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / iters * 1e6
times, cpus = c.gather(ends, root=0), c.gather(cpu, root=0)
if c.rank == 0:
    per = np.diff(np.array(times), axis=1)
    slowest = per.max(axis=0)
    print(
        f"{size} B: slowest rank per call median {np.median(slowest) * 1e6:.1f} us, p90 "
        f"{np.percentile(slowest, 90) * 1e6:.1f}; mean per call {per.mean() * 1e6:.1f} us; "
        f"CPU per call by rank {[round(x) for x in cpus]} us"
    )
