"""Where a 256 KiB multi-host all_reduce spends its call, on every rank (pass 16).

The bound hierarchical all_reduce (3 netns hosts x 2 ranks, ``procgroup.algorithms.hierbind``): the host's reduce
to the leader (``fold``, the compiled ``bigarena.bind_reduce``), the leaders' stage between hosts (``inter``, the
stage choice ``all_reduce_flat``, here ``allreduce_direct_rsag``) and the host's broadcast (``spread``,
``bind_bcast``), each timed by wrapping what the binding asks for.  IT calls of SZ bytes after 20 warm-up calls;
rank 0 prints each rank's median call and stage times, the median of the slowest rank per call (the harness's
measure) and the mean per call.

``BURN=US`` spins US microseconds in every ``Comm.isend`` first: a sensitivity test of how much of the leaders'
per-message CPU lands on the call's critical path (pass 16: 10 us on each of a leader's 4 sends added 76-144 us
to the mean call).  Run it as ``../pass11/mh_loop.sh`` runs ``loop.py``:
``bash ../pass11/mh_loop.sh ../pass16/timeline256.py SZ=262144 IT=1000 [BURN=10]`` from ``../pass13``.
"""

import dataclasses
import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import allreduce as AR
from procgroup.algorithms import comm as CM
from procgroup.algorithms import hierbind as HB

pc = time.perf_counter
T = {"f": [], "x": [], "s": [], "b": []}


def timed(f, key):
    """``f`` that records when each call ended under ``key``."""

    def g(*a):
        r = f(*a)
        T[key].append(pc())
        return r

    return g


def wrap_binder(make, key):
    """A binder whose bound stage is :func:`timed`."""

    def mk(*a, **k):
        f = make(*a, **k)
        return None if f is None else timed(f, key)

    return mk


HB.bind_reduce = wrap_binder(HB.bind_reduce, "f")
HB.bind_bcast = wrap_binder(HB.bind_bcast, "s")
_flat = AR._stages.all_reduce_flat
AR.install_stage_choices(dataclasses.replace(AR._stages, all_reduce_flat=lambda *a: timed(_flat(*a), "x")))

BURN = float(os.environ.get("BURN", 0)) * 1e-6
if BURN:
    _isend = CM.Comm.isend

    def isend(self, *a, **k):
        t = pc()
        while pc() - t < BURN:
            pass
        return _isend(self, *a, **k)

    CM.Comm.isend = isend

dist.init_process_group("gloo")
r, p = dist.get_rank(), dist.get_world_size()
n = int(os.environ.get("SZ", 262144)) // 4
it = int(os.environ.get("IT", 400))
x = np.ones(n, np.float32)
for _ in range(20):
    x[:] = 1
    dist.all_reduce(x)
assert float(x[0]) == p and float(x[-1]) == p
for v in T.values():
    v.clear()
x[:] = 0  # the timed calls sum zeros (the same cost, no overflow)
dist.barrier()
for _ in range(it):
    T["b"].append(pc())
    dist.all_reduce(x)
T["b"].append(pc())
out = [None] * p
dist.all_gather_object(out, {k: np.array(v) for k, v in T.items()})
if r == 0:
    for q, d in enumerate(out):
        b = d["b"]
        s = "rank %d: call %.0f" % (q, 1e6 * np.median(np.diff(b)))
        if len(d["f"]) == it:
            s += " fold %.0f" % (1e6 * np.median(d["f"] - b[:-1]))
        if len(d["x"]) == it:
            s += " inter %.0f" % (1e6 * np.median(d["x"] - d["f"]))
        if len(d["s"]) == it:
            prev, what = (d["x"], "inter") if len(d["x"]) == it else (d["f"], "fold")
            s += " spread %.0f (from the %s's end)" % (1e6 * np.median(d["s"] - prev), what)
        print(s, flush=True)
    mx = np.max([np.diff(d["b"]) for d in out], axis=0)
    print("slowest rank per call: median %.0f us, mean %.0f us" % (1e6 * np.median(mx), 1e6 * np.mean(mx)))
dist.destroy_process_group()
