"""The broadcast A/B of pass 10: MODE=pg (procgroup's broadcast) or MODE=cma (a prototype: every reader
process_vm_readv-s the root's buffer), SZ bytes, IT timed calls; slowest rank per call, median."""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.transport import _cma

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
size, iters = int(os.environ.get("SZ", 1 << 26)), int(os.environ.get("IT", 10))
mode = os.environ.get("MODE", "pg")
buf = np.ones(size // 4, np.float32) * (7 if r == 0 else 0)
hdr = np.zeros(2 * w, np.int64)
me = np.array([os.getpid(), buf.ctypes.data], np.int64)


def bc_cma():
    dist.all_gather_into_tensor(hdr, me)
    if r:
        _cma.read(int(hdr[0]), buf.ctypes.data, int(hdr[1]), size)
    dist.barrier()


def bc_pg():
    dist.broadcast(buf, 0)


f = bc_cma if mode == "cma" else bc_pg
for _ in range(3):
    f()
assert np.all(buf == 7)
ts = []
for _ in range(iters):
    dist.barrier()
    t0 = time.perf_counter()
    f()
    ts.append(time.perf_counter() - t0)
allt = [None] * w
dist.all_gather_object(allt, ts)
if r == 0:
    mx = np.max(np.array(allt), axis=0)
    print(f"bc-{mode} {size}: slowest median {np.median(mx) * 1e6:.0f} us p90 {np.percentile(mx, 90) * 1e6:.0f}")
dist.destroy_process_group()
