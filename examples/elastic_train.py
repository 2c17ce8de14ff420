"""Elastic training with checkpoints: the job survives nodes coming and going (``--nnodes MIN:MAX``).

Run one agent per node, for example on h1, h2 and (later) h3::

    PROCGROUP_SECRET=... procgroup run --nnodes 2:3 --max-restarts 5 --master-addr h1 --master-port 29400 \\
        --nproc-per-node 2 examples/elastic_train.py --checkpoint /shared/ckpt.json --steps 200

Whenever a node is lost or a new one arrives, every agent stops its workers and re-forms the job with the
nodes it has (a new *generation*, with ranks reassigned); the workers start again from the top of this
script.  They read ``PROCGROUP_RESTART_COUNT`` (``TORCHELASTIC_RESTART_COUNT`` under torchrun, the same
number) and resume from the last checkpoint, which rank 0 writes atomically every ``--every`` steps.

Each step all-reduces rank-dependent data and checks the result against its closed form, so a wrong sum in
any generation fails loudly.  ``--stop-file PATH`` ends the run early (after the step that sees the file).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import numpy as np

import procgroup as dist


def load(path: str) -> dict:
    """The last checkpoint ({"step": n, "total": x}), or a fresh start."""
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {"step": 0, "total": 0.0}


def save(path: str, state: dict) -> None:
    """Write the checkpoint atomically (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint file every node can read (a shared path)")
    p.add_argument("--steps", type=int, default=100, help="total steps of the run (default 100)")
    p.add_argument("--every", type=int, default=1, help="checkpoint every N steps (default 1)")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds of 'work' per step (default 0.05)")
    p.add_argument("--stop-file", default=None, help="finish early once this file exists")
    a = p.parse_args()

    generation = int(os.environ.get("PROCGROUP_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    state = load(a.checkpoint)
    view = [state]
    dist.broadcast_object_list(view, src=0)  # every rank resumes from rank 0's view of the checkpoint
    state = view[0]
    start = int(state["step"])
    print(
        f"ELASTIC gen={generation} world={world} rank={rank} host={socket.gethostname()} resume_step={start}",
        flush=True,
    )
    expect = world * (world + 1) / 2
    step = start
    while step < a.steps:
        x = np.full(4, float(rank + 1))
        dist.all_reduce(x)
        if not np.allclose(x, expect):
            raise RuntimeError(f"all_reduce gave {x[0]} on rank {rank} of {world}, expected {expect}")
        step += 1
        state = {"step": step, "total": float(state["total"]) + float(x[0])}
        if rank == 0 and step % a.every == 0:
            save(a.checkpoint, state)
        if step == start + 1:
            print(f"ELASTIC gen={generation} world={world} rank={rank} allreduce_ok sum={x[0]:g}", flush=True)
        time.sleep(a.step_time)
        stop = np.array([1.0 if a.stop_file and os.path.exists(a.stop_file) else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        if stop[0] > 0:
            break
    if rank == 0:
        save(a.checkpoint, state)
    print(f"ELASTIC done gen={generation} world={world} rank={rank} step={step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
