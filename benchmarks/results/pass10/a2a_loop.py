"""The all_to_all A/B of pass 10: IT timed ``all_to_all_single`` calls of SZ bytes a rank (equal splits), each after
a barrier; rank 0 prints the slowest rank per call, median and p90.  ``BIGA2A=n`` sets
``select.BIG_LIMIT['all_to_all']`` (streams up to it through the big slots), ``RNDV=n`` the rings' rendezvous
size, ``A2ASMALL=n`` ``select.ALLTOALL_SMALL``."""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import select

dist.init_process_group("gloo")
if os.environ.get("BIGA2A"):
    select.BIG_LIMIT["all_to_all"] = int(os.environ["BIGA2A"])
if os.environ.get("RNDV"):
    from procgroup.transport.shm import p2pfast as _pf
    from procgroup.transport.shm import ring as _ring

    _ring.RNDV_MIN = _pf.RNDV_MIN = int(os.environ["RNDV"])
if os.environ.get("A2ASMALL"):
    select.ALLTOALL_SMALL = int(os.environ["A2ASMALL"])
r, w = dist.get_rank(), dist.get_world_size()
size, iters = int(os.environ.get("SZ", 1 << 22)), int(os.environ.get("IT", 50))
send = np.ones(size // 4, np.float32)
recv = np.zeros(size // 4, np.float32)
for _ in range(5):
    dist.all_to_all_single(recv, send)
ts = []
for _ in range(iters):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(recv, send)
    ts.append(time.perf_counter() - t0)
t = np.array(ts)
allt = [None] * w
dist.all_gather_object(allt, ts)
if r == 0:
    mx = np.max(np.array(allt), axis=0)
    print(f"a2a {size}: slowest median {np.median(mx) * 1e6:.0f} us p90 {np.percentile(mx, 90) * 1e6:.0f}")
dist.destroy_process_group()
