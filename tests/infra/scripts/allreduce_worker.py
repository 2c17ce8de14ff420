"""Per-process-mode worker: ``dist.init_process_group()`` with no arguments, under whatever launcher.

Started once per rank by srun, mpirun or mpiexec.  It must find its rank, world size, local rank
and node rank, and the rendezvous address, from the launcher's environment alone; then it checks
all_reduce results (int64 SUM from 7 elements to 2 MiB, around the shared-slot thresholds, three calls each so
the planned path runs too, float32 AVG and a float64 MAX, so both the latency and the bandwidth paths run, within
a host over shm and across hosts over TCP) against their closed forms, checks the layout it was told to expect,
and prints ONE line to stdout:

    PGW rank=R world=W local=L/LW node=N host=HOST ok

Anything wrong: a ``PGW-FAIL rank=R ...`` line on stdout naming what, and exit status 1.

Usage: allreduce_worker.py --tag TAG [--world W] [--per-node K] [--hosts h1,h2,h3]
  --tag       any string; only there so tests can find (and reap) every process of one launch
  --world     expected world size
  --per-node  expected ranks per node, placed in blocks: local rank r % K, node rank r // K
  --hosts     expected host name of node 0, 1, ... (checked against socket.gethostname())
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import numpy as np

import procgroup as dist

SMALL = 7
LARGE = 1 << 18  # int64 -> 2 MiB
#: around the shared-slot thresholds of a host's ranks (hierarchical all_reduce across hosts): the arena's
#: payload exactly (32,704 bytes = 4088 int64), one element more (big slots), and 800 KB; from 1 MiB the
#: multi-leader all_reduce, its host stages in the big slots (1 MiB: one step each, compiled once planned; 2 MiB:
#: several) or, with an odd count, on the ring
SIZES = (SMALL, 4088, 4089, 100_003, LARGE // 2, LARGE, LARGE + 1)


def expected_sum(n: int, world: int) -> np.ndarray:
    """sum over r of (r + 1) * (i + 1) for i in [0, n): (i + 1) * W (W + 1) / 2."""
    return np.arange(1, n + 1, dtype=np.int64) * (world * (world + 1) // 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--world", type=int)
    ap.add_argument("--per-node", type=int)
    ap.add_argument("--hosts")
    a = ap.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    local, node = dist.get_local_rank(), dist.get_node_rank()
    lws = dist.get_local_world_size()
    host = socket.gethostname()
    problems = []

    for n in SIZES:
        # three calls a size: the first builds the call's plan, the others run it (across hosts: the hierarchical
        # or multi-leader all_reduce bound once, plans/algorithms.hierbind); each with other values
        for rep in range(3):
            x = np.arange(1, n + 1, dtype=np.int64) * (rank + 1 + rep)
            dist.all_reduce(x)  # default op: SUM
            want = expected_sum(n, world) + np.arange(1, n + 1, dtype=np.int64) * (rep * world)
            if not np.array_equal(x, want):
                bad = int(np.flatnonzero(x != want)[0])
                problems.append(f"all_reduce(n={n}, call {rep})[{bad}]={x[bad]} expected {want[bad]}")
    for rep in range(3):  # float32 AVG (the plan finalizes after the bound all_reduce), within and above the arena
        for n in (1000, 30_001):
            y = np.full(n, float(rank + rep), np.float32)
            dist.all_reduce(y, op=dist.ReduceOp.AVG)
            if not np.allclose(y, (world - 1) / 2 + rep):
                problems.append(f"all_reduce AVG float32 n={n} call {rep}: {y[:3]}")
    m = np.full(5001, -float(rank), np.float64)
    m[rank % 5001] = 1e9 + rank
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    want_max = np.zeros(5001)
    for r in range(world):
        want_max[r % 5001] = max(want_max[r % 5001], 1e9 + r)
    if not np.array_equal(m, want_max):
        problems.append(f"all_reduce MAX float64 n=5001 differs at {int(np.flatnonzero(m != want_max)[0])}")
    # every rank agrees on the world layout
    layout = [None] * world
    dist.all_gather_object(layout, (rank, local, node, host))
    if [t[0] for t in layout] != list(range(world)):
        problems.append(f"all_gather_object ranks {[t[0] for t in layout]}")

    if a.world is not None and world != a.world:
        problems.append(f"get_world_size()={world} expected {a.world}")
    if a.per_node is not None:
        k = a.per_node
        if (local, node, lws) != (rank % k, rank // k, k):
            problems.append(
                f"(get_local_rank, get_node_rank, get_local_world_size)=({local}, {node}, {lws}) "
                f"expected ({rank % k}, {rank // k}, {k})"
            )
        if a.hosts:
            hosts = a.hosts.split(",")
            if rank // k < len(hosts) and host != hosts[rank // k]:
                problems.append(f"runs on {host}, expected {hosts[rank // k]}")
    dist.barrier()
    dist.destroy_process_group()

    head = f"rank={rank} world={world} local={local}/{lws} node={node} host={host}"
    if problems:
        say(f"PGW-FAIL {head} " + "; ".join(problems))
        return 1
    say(f"PGW {head} ok")
    return 0


def say(line: str) -> None:
    """One write(2) per line: launchers that merge ranks' output then cannot split it (print() makes two)."""
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
