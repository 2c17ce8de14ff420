"""Plain against streaming stores into a shared buffer that another CPU reads (pass 20).

    gcc -O2 -mavx2 -shared -fPIC -o store_probe.so store_probe.c
    python store_probe.py plain|nt|prefetchw K [BYTES [READER_CPU]]

A writer bound to CPU 0 copies BYTES into one of K shared buffers in turn; a reader bound to READER_CPU (default 1)
copies it out; they alternate through a flag.  Prints the reader's (R) and the writer's (W) median copy, us.
"""

import ctypes
import mmap
import os
import sys
import time

import numpy as np

lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_probe.so"))
N = int(sys.argv[3]) if len(sys.argv) > 3 else 64 << 10
K = int(sys.argv[2])
mode = sys.argv[1]
fn = getattr(lib, "copy_" + mode)
fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
m = mmap.mmap(-1, 4096 + K * N, flags=mmap.MAP_SHARED)
bufs = [np.frombuffer(m, np.uint8, count=N, offset=4096 + k * N) for k in range(K)]
flag = np.frombuffer(m, np.int64, count=8, offset=0)
R = 3000
pid = os.fork()
if pid == 0:
    os.sched_setaffinity(0, {int(sys.argv[4]) if len(sys.argv) > 4 else 1})
    priv = np.empty(N, np.uint8)
    ts = np.empty(R)
    for i in range(R):
        while flag[0] != 2 * i + 1:
            os.sched_yield()
        t0 = time.perf_counter_ns()
        np.copyto(priv, bufs[i % K])
        ts[i] = time.perf_counter_ns() - t0
        flag[0] = 2 * i + 2
    print(f"R {np.median(ts) / 1e3:.2f}", end=" ", flush=True)
    os._exit(0)
os.sched_setaffinity(0, {0})
src = np.ones(N, np.uint8)
tw = np.empty(R)
for i in range(R):
    while flag[0] != 2 * i:
        os.sched_yield()
    d = bufs[i % K].ctypes.data
    t0 = time.perf_counter_ns()
    fn(d, src.ctypes.data, N)
    tw[i] = time.perf_counter_ns() - t0
    flag[0] = 2 * i + 1
os.waitpid(pid, 0)
print(f"W {np.median(tw) / 1e3:.2f} ({mode} K={K})")
