#!/usr/bin/env python
"""Latency of a 4 B allreduce through ray.util.collective: backend "procgroup" vs Ray's "gloo", same run.

    PYTHONPATH=$PWD/src python benchmarks/ray_collective.py                 # 2 actors, 2000 iterations, 3 rounds
    PYTHONPATH=$PWD/src python benchmarks/ray_collective.py --iters 500 --repeat 5

Two Ray actors (a local cluster this script starts and shuts down) join two collective groups, one per
backend ("procgroup": procgroup's default group, shm transport on one host; "gloo": torch.distributed's gloo,
which Ray 2.60 uses for GLOO).  In each round both backends run, in alternating order (round 0: procgroup first,
round 1: gloo first, ...) so that they see the same background load: a warm-up, then ``--iters`` timed
``col.allreduce`` of one float32 (4 B), each checked against the closed form once.  An iteration's time is the
slower of the two ranks' (each rank times its own call with perf_counter); the table gives per round and
backend the median and p90 in microseconds, and the median over rounds.  /proc/loadavg is recorded with each
round.  Writes JSON and markdown under ``--out-dir`` (default benchmarks/results/ray/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

BACKENDS = ("procgroup", "gloo")


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:  # benchmark script, not the library: procfs.py rule does not apply
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _member_cls(ray):
    @ray.remote(num_cpus=1)
    class Member:
        """One rank: in both groups, timing allreduce on request."""

        def __init__(self, rank: int, world: int) -> None:
            from procgroup.ray import register_collective_backend

            register_collective_backend()
            self.rank, self.world = rank, world

        def join(self, backend: str) -> None:
            import ray.util.collective as col

            col.init_collective_group(self.world, self.rank, backend=backend, group_name=backend)

        def time_allreduce(self, backend: str, iters: int, warmup: int) -> List[float]:
            import ray.util.collective as col

            x = np.ones(1, dtype=np.float32)
            col.allreduce(x, group_name=backend)
            if x[0] != self.world:
                raise AssertionError(f"{backend}: allreduce gave {x[0]}, expected {self.world}")
            for _ in range(warmup):
                col.allreduce(x, group_name=backend)
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                col.allreduce(x, group_name=backend)
                out.append(time.perf_counter() - t0)
            col.barrier(group_name=backend)
            return out

        def leave(self, backend: str) -> None:
            import ray.util.collective as col

            col.destroy_collective_group(backend)

    return Member


def main(argv: List[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "ray"))
    a = ap.parse_args(argv)
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        member = _member_cls(ray)
        actors = [member.remote(r, 2) for r in range(2)]
        for b in BACKENDS:
            ray.get([m.join.remote(b) for m in actors], timeout=300)
        rounds: List[Dict] = []
        for rnd in range(a.repeat):
            order = BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]
            row: Dict = {"round": rnd, "order": list(order), "loadavg": _load()}
            for b in order:
                per_rank = ray.get([m.time_allreduce.remote(b, a.iters, a.warmup) for m in actors], timeout=600)
                worst = [max(ts) * 1e6 for ts in zip(*per_rank)]
                q = statistics.quantiles(worst, n=10)
                row[b] = {"median_us": statistics.median(worst), "p90_us": q[-1]}
            rounds.append(row)
            print(json.dumps(row), flush=True)
        ray.get([m.leave.remote(b) for m in actors for b in BACKENDS], timeout=120)
    finally:
        ray.shutdown()
    summary = {b: statistics.median(r[b]["median_us"] for r in rounds) for b in BACKENDS}
    import ray as _ray

    meta = {
        "ray": _ray.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "iters": a.iters,
        "warmup": a.warmup,
        "repeat": a.repeat,
        "bytes": 4,
        "actors": 2,
    }
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "allreduce_4B.json").write_text(
        json.dumps({"meta": meta, "rounds": rounds, "median_us": summary}, indent=1) + "\n"
    )
    lines = [
        "# ray.util.collective: 4 B allreduce between 2 actors (µs, slower rank per iteration)",
        "",
        f"ray {meta['ray']}, {a.iters} iterations after {a.warmup} warm-up, {a.repeat} rounds, "
        f"{meta['cpus']} CPUs (shared; loadavg per round).",
        "",
        "| round | order | loadavg | procgroup median | procgroup p90 | gloo median | gloo p90 | gloo / procgroup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        p, g = r["procgroup"], r["gloo"]
        lines.append(
            f"| {r['round']} | {' then '.join(r['order'])} | {r['loadavg']} | {p['median_us']:.0f} | "
            f"{p['p90_us']:.0f} | {g['median_us']:.0f} | {g['p90_us']:.0f} | "
            f"{g['median_us'] / p['median_us']:.1f}x |"
        )
    lines.append(
        f"| **median of rounds** | | | **{summary['procgroup']:.0f}** | | **{summary['gloo']:.0f}** | | "
        f"**{summary['gloo'] / summary['procgroup']:.1f}x** |"
    )
    (out / "allreduce_4B.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
