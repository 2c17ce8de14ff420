"""The all_gather A/B of pass 10: MODE=pg (procgroup's all_gather_into_tensor) or MODE=cma (a prototype:
every rank process_vm_readv-s the others' parts), SZ bytes a rank, IT timed calls; slowest rank per call, median."""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.transport import _cma

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
size, iters = int(os.environ.get("SZ", 1 << 22)), int(os.environ.get("IT", 30))
mode = os.environ.get("MODE", "pg")
send = np.ones(size // 4, np.float32) * r
recv = np.zeros(w * (size // 4), np.float32)
hdr = np.zeros(2 * w, np.int64)
me = np.array([os.getpid(), send.ctypes.data], np.int64)
laddr = recv.ctypes.data


def ag_cma():
    dist.all_gather_into_tensor(hdr, me)
    for k in range(1, w):
        j = (r + k) % w
        _cma.read(int(hdr[2 * j]), laddr + j * size, int(hdr[2 * j + 1]), size)
    recv[r * (size // 4) : (r + 1) * (size // 4)] = send
    dist.barrier()


def ag_pg():
    dist.all_gather_into_tensor(recv, send)


f = ag_cma if mode == "cma" else ag_pg
for _ in range(3):
    f()
assert np.array_equal(recv, np.repeat(np.arange(w, dtype=np.float32), size // 4))
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
    print(f"ag-{mode} {size}: slowest median {np.median(mx) * 1e6:.0f} us p90 {np.percentile(mx, 90) * 1e6:.0f}")
dist.destroy_process_group()
