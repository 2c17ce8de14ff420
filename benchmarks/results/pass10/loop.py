"""The per-call loop behind pass 9's and pass 10's A/B rows: IT calls of OP (all_reduce, broadcast, reduce,
all_gather or reduce_scatter; default all_reduce) on SZ bytes of float32 per rank (reduce_scatter: its input),
back to back.

Run it with ``procgroup run``: one per namespace host across hosts (see README.md), or ``--nproc-per-node 4`` on
one host.  Rank 0 prints the slowest rank's time per call,
median and p90 (the harness's measure: ``benchmarks/multihost.py``), the mean time per call, and each rank's CPU
per call (user + system), CPU in user mode, and voluntary / involuntary context switches per call.
``FORCE=all_reduce=multileader`` (or ``NAME=int`` for a threshold of ``procgroup.algorithms.select``) pins a
choice, as ``multihost.py --pg-variant`` does.  Pass 10's knobs: ``DIRECT=n`` sets
``algorithms.bigarena.DIRECT_MAX``; ``BIGRED=n`` sets the world's arena's ``max_bytes`` (calls above it take the
big slots: the "tried" row of the small reduce); ``BURN=us`` spins that long in Python before every call;
``PROF=rank`` prints that rank's cProfile of the loop.
"""

import os
import resource
import time

import numpy as np

import procgroup as dist

dist.init_process_group("gloo")
if os.environ.get("DIRECT"):
    from procgroup.algorithms import bigarena as _B

    _B.DIRECT_MAX = int(os.environ["DIRECT"])
if os.environ.get("BIGRED"):
    from procgroup.state import default_group as _dg

    _dg().arena().max_bytes = int(os.environ["BIGRED"])
if os.environ.get("FORCE"):
    from procgroup.algorithms import select

    for kv in os.environ["FORCE"].split(","):
        k, v = kv.split("=", 1)
        if k.isupper():
            setattr(select, k, int(v))
        else:
            select.FORCE[k] = v
r, w = dist.get_rank(), dist.get_world_size()
size, iters = int(os.environ.get("SZ", 65536)), int(os.environ.get("IT", 300))
op = os.environ.get("OP", "all_reduce")
buf = np.ones(size // 4, np.float32)
out = np.zeros(w * buf.size, np.float32)
rs_out = np.zeros(buf.size // w, np.float32)
call = {
    "all_reduce": lambda: dist.all_reduce(buf),
    "broadcast": lambda: dist.broadcast(buf, 0),
    "reduce": lambda: dist.reduce(buf, 0),
    "all_gather": lambda: dist.all_gather_into_tensor(out, buf),
    "reduce_scatter": lambda: dist.reduce_scatter_tensor(rs_out, buf),
}[op]
for _ in range(20):
    buf[:] = 1
    call()
assert op != "all_reduce" or buf[0] == w, buf[0]
dist.barrier()
ru0 = resource.getrusage(resource.RUSAGE_SELF)
ends = []
burn_us = float(os.environ.get("BURN", 0))
if burn_us:
    inner = call

    def call():
        t = time.perf_counter() + burn_us * 1e-6
        while time.perf_counter() < t:
            pass
        inner()


prof = None
if os.environ.get("PROF") == str(r):
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
for _ in range(iters):
    call()
    ends.append(time.perf_counter())
if prof is not None:
    prof.disable()
    import io
    import pstats

    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(22)
    print(sio.getvalue(), flush=True)
ru1 = resource.getrusage(resource.RUSAGE_SELF)
mine = (
    (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / iters * 1e6,
    (ru1.ru_utime - ru0.ru_utime) / iters * 1e6,
    (ru1.ru_nvcsw - ru0.ru_nvcsw) / iters,
    (ru1.ru_nivcsw - ru0.ru_nivcsw) / iters,
)
rows, times = [None] * w, [None] * w
dist.all_gather_object(rows, mine)
dist.all_gather_object(times, ends)
if r == 0:
    per = np.diff(np.array(times), axis=1)  # rank x call
    slowest = per.max(axis=0)
    print(
        f"{op} {size} B: slowest rank per call median {np.median(slowest) * 1e6:.1f} us, p90 "
        f"{np.percentile(slowest, 90) * 1e6:.1f}; mean per call {per.mean() * 1e6:.1f} us"
    )
    for k, (cpu, usr, vcs, ics) in enumerate(rows):
        print(f"  rank {k}: CPU {cpu:.0f} us/call (user {usr:.0f}), context switches {vcs:.1f} + {ics:.1f}")
dist.destroy_process_group()
