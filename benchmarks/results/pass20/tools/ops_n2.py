"""procgroup job (pass 20): at N=2: all_gather 64 KiB and 1 MiB, broadcast 256 KiB, all_reduce 1 MiB.

300 calls each, after 30 and a barrier; prints the slowest rank per call, median, us, and each rank's voluntary
and involuntary switches and CPU per call.

    procgroup run --standalone --nproc-per-node 2 ops_n2.py
"""

import time

import numpy as np

import procgroup as dist

dist.init_process_group("gloo")
r, p = dist.get_rank(), dist.get_world_size()
res = []


def mc():
    a = np.ones(1 << 20, np.uint8)
    b = np.empty_like(a)
    t = []
    for _ in range(200):
        t0 = time.perf_counter()
        np.copyto(b, a)
        t.append(time.perf_counter() - t0)
    return np.median(t) * 1e6


MC = mc()


def ctx():
    v = n = 0
    for l in open("/proc/self/status"):
        if l.startswith("voluntary_ctxt"):
            v = int(l.split()[1])
        if l.startswith("nonvoluntary_ctxt"):
            n = int(l.split()[1])
    return v, n


def run(name, fn, it=300):
    for _ in range(30):
        fn()
    dist.barrier()
    ts = np.empty(it)
    c0 = ctx()
    cpu0 = time.process_time()
    t = time.perf_counter()
    for i in range(it):
        fn()
        t2 = time.perf_counter()
        ts[i] = t2 - t
        t = t2
    c1 = ctx()
    cpu1 = time.process_time()
    res.append((name, ts, ((c1[0] - c0[0]) / it, (c1[1] - c0[1]) / it, (cpu1 - cpu0) / it * 1e6)))


g_in = np.ones(1 << 13, np.float32)
g_out = np.empty(1 << 14, np.float32)
run("ag64K", lambda: dist.all_gather_into_tensor(g_out, g_in))
h_in = np.ones(1 << 17, np.float32)
h_out = np.empty(1 << 18, np.float32)
run("ag1M", lambda: dist.all_gather_into_tensor(h_out, h_in))
b = np.ones(1 << 16, np.float32)
run("bc256K", lambda: dist.broadcast(b, 0))
z = np.zeros(1 << 18, np.float32)
run("ar1M", lambda: dist.all_reduce(z))
allt = [None] * p
dist.all_gather_object(allt, [ts.tolist() for _, ts, _c in res] + [[c for _, _, c in res]])
if r == 0:
    out = []
    for k, (name, _, _c) in enumerate(res):
        T = np.array([allt[q][k] for q in range(p)])
        cs = [allt[q][-1][k] for q in range(p)]
        out.append(
            f"{name} {np.median(T.max(0)) * 1e6:.0f} (vol/call "
            + ",".join(f"{c[0]:.1f}" for c in cs)
            + " invol "
            + ",".join(f"{c[1]:.1f}" for c in cs)
            + " cpu "
            + ",".join(f"{c[2]:.0f}" for c in cs)
            + ")"
        )
    print(f"MC rank0 {MC:.1f}")
    print("RES\n" + "\n".join(out))
dist.destroy_process_group()
