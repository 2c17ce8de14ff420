"""Same-process A/B of the shared-memory all_to_all against the message algorithms (how
select.BIG_LIMIT['all_to_all'] was set).

Run under the launcher, e.g.::

    SIZES=1024,65536,1048576 procgroup run --standalone --nproc-per-node 2 benchmarks/ab_alltoall.py

(``MODES=shm,hdr+msg`` picks modes; ``ITERS=200`` overrides the iterations per size.)

``all_to_all_single`` of SIZE bytes (float32, equal splits) per rank.  Modes, alternating per iteration
(time = max over ranks, medians printed, and each mode's time over ``msg``'s):

* ``msg``: the message algorithms (linear / pairwise by ``select.ALLTOALL_SMALL``), as before the shm path;
* ``shm``: the shared-memory path, big slots at every size (``BIG_LIMIT`` unlimited);
* ``hdr+msg``: the shared-memory path's header exchange, then messages for every stream beyond the slot
  (``BIG_LIMIT`` 0): what the selection does above ``BIG_LIMIT``;
* ``planned``: what a user's loop gets (no algorithm forced: the call's plan, shm path, unlimited);
* ``shm/pK``: ``shm`` with each stream cut into K windows (``alltoall_shm.PIPE_PARTS``; how it was set).
"""

import os
import time

import numpy as np

import procgroup as dist
from procgroup.algorithms import alltoall_shm, select

MODES = ("msg", "shm", "hdr+msg", "planned")


PARTS = alltoall_shm.PIPE_PARTS
LIMIT = select.BIG_LIMIT["all_to_all"]


def _set(mode: str, n: int) -> None:
    """``mode``'s path for the next call.  Only ``msg`` forces an algorithm: a forced ``shm`` runs the big slots
    whatever ``BIG_LIMIT`` says (``select.ALGORITHMS`` calls it without a limit), so the other modes set the
    limit and let the selection (and the plans, which read it per call) take the shared-memory path."""
    select.FORCE.pop("all_to_all", None)
    alltoall_shm.PIPE_PARTS = PARTS
    if mode.startswith("shm/p"):
        mode, alltoall_shm.PIPE_PARTS = "shm", int(mode[5:])
    select.BIG_LIMIT["all_to_all"] = {"hdr+msg": 0, "shm": 1 << 62}.get(mode, LIMIT)
    if mode == "msg":
        select.FORCE["all_to_all"] = "linear" if n <= select.ALLTOALL_SMALL else "pairwise"


def main() -> None:
    dist.init_process_group()
    r, p = dist.get_rank(), dist.get_world_size()
    sizes = [int(float(x)) for x in os.environ.get("SIZES", "1024,16384,65536,262144,1048576,4194304").split(",")]
    modes = [m for m in os.environ.get("MODES", ",".join(MODES)).split(",") if m]
    for n in sizes:
        # each mode its own buffers, so that each keeps its own plan (``procgroup.plans``: one per buffers, op and
        # group; it reads the limit per call)
        bufs = {m: (np.ones(n // 4, np.float32), np.empty(n // 4, np.float32)) for m in modes}
        iters = int(os.environ.get("ITERS", 0)) or max(10, min(200, int(2e7 // max(n, 1))))
        t = {m: [] for m in modes}
        for i in range(iters):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for mode in order:
                _set(mode, n)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(bufs[mode][1], bufs[mode][0])
                t[mode].append(time.perf_counter() - t0)
        _set("planned", n)
        arr = np.array([t[m] for m in modes], np.float64)
        dist.all_reduce(arr, op=dist.ReduceOp.MAX)
        med = {m: float(np.median(arr[k])) * 1e6 for k, m in enumerate(modes)}
        if r == 0:
            base = med.get("msg", 0.0)
            cols = "  ".join(
                f"{m} {med[m]:8.1f}" + (f" ({med[m] / base:.2f})" if base and m != "msg" else "") for m in modes
            )
            print(f"N={p} all_to_all {n:>9d}  {cols}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
