"""Pass 9's per-call loop (``../pass9/loop.py``) with two additions of this pass: ``STAGES=1`` prints each rank's
time in the hierarchical all_reduce's stages (fold within the host, between hosts, spread; pass 12 added each
stage's CPU, ``NAME_cpu``), ``PROF=1`` writes a cProfile of ranks 0 and 1 to ``$TMPDIR/prof.R.txt`` (sorted by
``PSORT``, default tottime; ``PCPU=1`` times with the process's CPU clock instead of the wall clock).  IT
calls of OP (all_reduce, broadcast, reduce or all_gather; default all_reduce) on SZ bytes of float32 per rank,
back to back; ``mh_loop.sh loop.py SZ=... IT=...`` runs it on three netns hosts x 2 ranks.

Run it with ``procgroup run``: one per namespace host across hosts (see README.md), or ``--nproc-per-node 4`` on
one host.  Rank 0 prints the slowest rank's time per call,
median and p90 (the harness's measure: ``benchmarks/multihost.py``), the mean time per call, and each rank's CPU
per call (user + system), CPU in user mode, and voluntary / involuntary context switches per call.
``FORCE=all_reduce=multileader`` (or ``NAME=int`` for a threshold of ``procgroup.algorithms.select``) pins a
choice, as ``multihost.py --pg-variant`` does.  ``WIN=1`` (pass 17) also prints the slowest rank's median per call
in windows of calls (0-60, 60-120, ...: a job's slow start).
"""

import os
import resource
import time

import numpy as np

import procgroup as dist

dist.init_process_group("gloo")
if os.environ.get("FORCE"):
    from procgroup.algorithms import select

    for kv in os.environ["FORCE"].split(","):
        k, v = kv.split("=", 1)
        if k.isupper():
            setattr(select, k, int(v))
        else:
            select.FORCE[k] = v
r, w = dist.get_rank(), dist.get_world_size()
ST = {}
if os.environ.get("STAGES"):
    from procgroup.algorithms import allreduce as AR

    st = AR._stages

    def timed(name, f):
        if f is None:
            return None

        def g(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            f(*a, **k)
            ST.setdefault(name, []).append(time.perf_counter() - t0)
            ST.setdefault(name + "_cpu", []).append(time.process_time() - c0)  # the process's CPU (all threads)

        return g

    AR._stages = AR.StageChoices(
        all_reduce_flat=lambda p, nb, ne: timed("inter", st.all_reduce_flat(p, nb, ne)),
        reduce=st.reduce,
        broadcast=st.broadcast,
        host_reduce=lambda c, nb: timed("fold", st.host_reduce(c, nb)),
        host_broadcast=lambda c, nb: timed("spread", st.host_broadcast(c, nb)),
        host_split=st.host_split,  # (before pass 14 it was left out: multileader then ran its host stages as messages)
    )
size, iters = int(os.environ.get("SZ", 65536)), int(os.environ.get("IT", 300))
op = os.environ.get("OP", "all_reduce")
buf = np.ones(size // 4, np.float32)
buf[:] = 0
out = np.zeros(w * buf.size, np.float32)
call = {
    "all_reduce": lambda: dist.all_reduce(buf),
    "broadcast": lambda: dist.broadcast(buf, 0),
    "reduce": lambda: dist.reduce(buf, 0),
    "all_gather": lambda: dist.all_gather_into_tensor(out, buf),
}[op]
for _ in range(20):
    buf[:] = 1
    call()
assert op != "all_reduce" or buf[0] == w, buf[0]
dist.barrier()
ru0 = resource.getrusage(resource.RUSAGE_SELF)
ends = []
prof = None
if os.environ.get("PROF") and r in (0, 1):
    import cProfile

    prof = cProfile.Profile(time.process_time) if os.environ.get("PCPU") else cProfile.Profile()
    prof.enable()
for _ in range(iters):
    call()
    ends.append(time.perf_counter())
if prof is not None:
    prof.disable()
    import io
    import pstats

    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats(os.environ.get("PSORT", "tottime")).print_stats(
        int(os.environ.get("PN", 40))
    )
    open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"prof.{r}.txt"), "w").write(sio.getvalue())
ru1 = resource.getrusage(resource.RUSAGE_SELF)
mine = (
    (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / iters * 1e6,
    (ru1.ru_utime - ru0.ru_utime) / iters * 1e6,
    (ru1.ru_nvcsw - ru0.ru_nvcsw) / iters,
    (ru1.ru_nivcsw - ru0.ru_nivcsw) / iters,
)
if ST:
    print(
        f"rank {r} stages us (median/mean): "
        + "; ".join(f"{k} {np.median(v[-iters:]) * 1e6:.0f}/{np.mean(v[-iters:]) * 1e6:.0f}" for k, v in ST.items()),
        flush=True,
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
    if os.environ.get("WIN"):  # pass 17: the slowest rank's median in windows of calls (a job's slow start)
        edges = [e for e in (0, 60, 120, 180, 240, 300, 360, 480, 960) if e < iters] + [iters]
        wins = [f"{a}-{b}: {np.median(slowest[a:b]) * 1e6:.0f}" for a, b in zip(edges, edges[1:])]
        print("windows of calls:", wins)
    for k, (cpu, usr, vcs, ics) in enumerate(rows):
        print(f"  rank {k}: CPU {cpu:.0f} us/call (user {usr:.0f}), context switches {vcs:.1f} + {ics:.1f}")
dist.destroy_process_group()
