"""Which period the VM is in (pass 20): a writer on CPU 0 copies 64 KiB into shared memory, a reader on CPU 1 copies
it out, in turn.  Prints the reader's (R) and the writer's (W) median copy, us: about R 2.0 / W 7.8 in the fast
periods, R 4.5 / W 29-39 in the slow ones (a store to a line the other CPU holds costs ~4x more).
"""

# A (CPU0) writes 64K into shm, B (CPU1) copies it out; alternate via a flag in shm (spinning); B's copy time median
import mmap
import os
import time

import numpy as np

N = 64 << 10
m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_SHARED)
buf = np.frombuffer(m, np.uint8, count=N, offset=4096)
flag = np.frombuffer(m, np.int64, count=8, offset=0)
R = 3000
pid = os.fork()
if pid == 0:
    os.sched_setaffinity(0, {1})
    priv = np.empty(N, np.uint8)
    ts = np.empty(R)
    for i in range(R):
        while flag[0] != 2 * i + 1:
            pass
        t0 = time.perf_counter_ns()
        np.copyto(priv, buf)
        ts[i] = time.perf_counter_ns() - t0
        flag[0] = 2 * i + 2
    print(f"R {np.median(ts) / 1e3:.2f}", flush=True)
    os._exit(0)
os.sched_setaffinity(0, {0})
src = np.ones(N, np.uint8)
tw = np.empty(R)
for i in range(R):
    while flag[0] != 2 * i:
        pass
    t0 = time.perf_counter_ns()
    np.copyto(buf, src)
    tw[i] = time.perf_counter_ns() - t0
    flag[0] = 2 * i + 1
os.waitpid(pid, 0)
print(f"W {np.median(tw) / 1e3:.2f}")
