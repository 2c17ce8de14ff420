"""Where a 4 MiB multi-host all_reduce's slowest rank spends its call (pass 15).

The multi-leader all_reduce above one step a host stage (4 MiB on 3 netns hosts x 2 ranks): the host's
reduce-scatter and all-gather in the big slots (``bigarena.reduce_scatter_big`` / ``allgather_big``, timed by
wrapping them) and the stage between hosts in between.  IT calls of SZ bytes after 20 warm-up calls; rank 0 prints,
for the faster and the slower half of the calls (by the slowest rank's duration), the mean of that rank's stages,
which ranks were slowest, every rank's mean stage times, and the mean spread of the ranks' end times per call.  Run
it as ``../pass11/mh_loop.sh`` runs ``loop.py``.  (At 1 MiB the host stages run bound, ``bigarena.bind_split``,
and are not timed here.)
"""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import bigarena as BA

T = {}


def wrap(name):
    f = getattr(BA, name)

    def g(*a, **k):
        T.setdefault(name + "0", []).append(time.perf_counter())
        r = f(*a, **k)
        T.setdefault(name + "1", []).append(time.perf_counter())
        return r

    setattr(BA, name, g)


wrap("reduce_scatter_big")
wrap("allgather_big")
dist.init_process_group("gloo")
r = dist.get_rank()
n = int(os.environ.get("SZ", 4194304)) // 4
it = int(os.environ.get("IT", 150))
x = np.ones(n, np.float32)
for _ in range(20):
    dist.all_reduce(x)
dist.barrier()
for v in T.values():
    v.clear()
ends = []
for _ in range(it):
    dist.all_reduce(x)
    ends.append(time.perf_counter())
rows = [None] * dist.get_world_size()
keys = ("reduce_scatter_big0", "reduce_scatter_big1", "allgather_big0", "allgather_big1")
dist.all_gather_object(rows, (ends,) + tuple(T[k] for k in keys))


def stage_means(stages: dict, who: np.ndarray, calls: np.ndarray) -> str:
    return " ".join(f"{name} {np.mean(v[who, calls]):.0f}" for name, v in stages.items())


if r == 0:
    E, RS0, RS1, AG0, AG1 = (np.array([row[j] for row in rows]) for j in range(5))
    dur = np.diff(E, axis=1) * 1e6  # ranks x (IT - 1): each call's duration, from the end of the previous one
    mx, slow = dur.max(axis=0), np.argmax(dur, axis=0)
    stages = {
        "pre": (RS0[:, 1:] - E[:, :-1]) * 1e6,
        "rs": (RS1[:, 1:] - RS0[:, 1:]) * 1e6,
        "inter": (AG0[:, 1:] - RS1[:, 1:]) * 1e6,
        "ag": (AG1[:, 1:] - AG0[:, 1:]) * 1e6,
        "post": (E[:, 1:] - AG1[:, 1:]) * 1e6,
    }
    order = np.argsort(mx)
    for name, sel in (("fast half", order[: len(order) // 2]), ("slow half", order[len(order) // 2 :])):
        print(
            f"TL {name}: max {np.mean(mx[sel]):.0f} | slowest rank: {stage_means(stages, slow[sel], sel)} | "
            f"slowest ranks {np.bincount(slow[sel], minlength=len(rows)).tolist()}",
            flush=True,
        )
    every = " ".join(f"{k} {v.mean():.0f}" for k, v in stages.items())
    skew = np.mean(E.max(0) - E.min(0)) * 1e6
    print(f"TL all-rank means: {every}; end skew (max-min end per call) {skew:.0f}", flush=True)
