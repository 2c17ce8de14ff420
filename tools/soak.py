#!/usr/bin/env python3
"""Soak test: randomized mixed collectives for a given duration, every result checked, RSS watched.

Usage (from the repository root; no install needed, ``src/`` is put on PYTHONPATH)::

    python tools/soak.py --duration 600            # 10 minutes at 4 ranks, transport auto (shm)
    python tools/soak.py --duration 60 --transport tcp --seed 7 --nproc 4

It launches itself through the real launcher
(``python -m procgroup run --standalone --nproc-per-node N tools/soak.py --worker ...``).
Every rank then runs the *same* random sequence (drawn from ``--seed``) of
operations: all_reduce (SUM/MAX/MIN/AVG), broadcast, reduce, all_gather,
all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, all_to_all
(uneven per-pair sizes), gather, scatter, barrier and send/recv, with random
sizes from 0 to ``--max-bytes`` (4 MiB; log-uniform, so small and large both
occur), random dtypes, random roots, on the world or on one of the random
subgroups made with ``new_group`` at the start.  Every result is compared
with a closed form (each rank's contribution is ``(rank + 1 + salt) *
(i % 5 + 1)``, so sums/maxima/placements are known without communicating).

Each rank samples its own RSS (``/proc/self/statm``) every ``--rss-interval``
seconds.  At the end rank 0 prints the summary::

    SOAK SUMMARY ops=<ops run, all ranks> wrong=<must be 0> ...
    SOAK RSS rank R: start=.. MiB after-warmup=.. end=.. max=.. growth=.. (after warmup ..)

Exit status: 0 when every result was right, 1 when any was wrong (or a
collective raised; the launcher then reports the root cause).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

OPS = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "send_recv",
]
DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64"]


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of operations (default 60)")
    p.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="largest buffer in bytes (default 4 MiB)")
    p.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    p.add_argument("--transport", choices=["auto", "shm", "tcp"], default=None, help="PROCGROUP_TRANSPORT for the job")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines of rank 0 (0: none)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- launcher side
def launch(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.transport:
        env["PROCGROUP_TRANSPORT"] = args.transport
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PROCGROUP_RUN_ID",
    ):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "procgroup",
        "run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(Path(__file__).resolve()),
        "--worker",
        "--duration",
        str(args.duration),
        "--seed",
        str(seed),
        "--max-bytes",
        str(args.max_bytes),
        "--rss-interval",
        str(args.rss_interval),
        "--progress",
        str(args.progress),
    ]
    print(
        f"soak: seed={seed} duration={args.duration}s nproc={args.nproc} "
        f"transport={env.get('PROCGROUP_TRANSPORT', 'auto')} "
        f"max_bytes={args.max_bytes}",
        flush=True,
    )
    print("soak: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env, cwd=str(ROOT))


# ---------------------------------------------------------------------------------------------- worker side
def rss_bytes() -> Tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes: RssAnon excludes the mapped shm rings and shared libraries."""
    from procgroup import procfs

    got = procfs.status_fields("self", ("VmRSS", "RssAnon"))
    return got.get("VmRSS", 0), got.get("RssAnon", 0)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np

        import procgroup as dist

        self.np, self.dist, self.args = np, dist, args
        dist.init_process_group(timeout=120)
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.rng = random.Random(args.seed)  # identical on every rank: the same operations in the same order
        # subgroups: every rank calls new_group for the same rank lists in the same order
        self.groups: List[Tuple[Any, List[int]]] = [(None, list(range(self.ws)))]
        n_sub = self.rng.randint(2, 4) if self.ws > 2 else 0
        for _ in range(n_sub):
            k = self.rng.randint(2, self.ws)
            ranks = sorted(self.rng.sample(range(self.ws), k))
            self.groups.append((dist.new_group(ranks), ranks))
        self.ops: Dict[str, int] = {}
        self.wrong: List[str] = []
        self.rss: List[Tuple[float, int, int]] = []  # (seconds since start, VmRSS, RssAnon)

    # contributions: rank q's value at element i is (q + 1 + salt) * (i % 5 + 1)
    def contrib(self, q: int, n: int, dt: str, salt: int) -> Any:
        np = self.np
        return ((q + 1 + salt) * (np.arange(n) % 5 + 1)).astype(dt)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.wrong.append(what)
            if len(self.wrong) <= 20:
                print(f"WRONG rank {self.rank}: {what}", flush=True)

    def sample(self, t0: float, force: bool = False) -> None:
        now = time.monotonic()
        if force or not self.rss or now - self.rss[-1][0] - t0 >= self.args.rss_interval:
            self.rss.append((now - t0, *rss_bytes()))

    def one(self, it: int) -> None:
        np, dist, rng = self.np, self.dist, self.rng
        op = rng.choice(OPS)
        group, ranks = rng.choice(self.groups)
        dt = rng.choice(DTYPES)
        itemsize = np.dtype(dt).itemsize
        nbytes = 0 if rng.random() < 0.05 else int(2 ** rng.uniform(0, 22))
        nbytes = min(nbytes, self.args.max_bytes)
        gs = len(ranks)
        if op in (
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "gather",
            "scatter",
            "all_to_all",
        ):
            nbytes //= gs  # keep every buffer, including the gathered one, under max_bytes
        n = nbytes // itemsize
        salt = it % 3
        root_g = rng.randrange(gs)
        root = ranks[root_g]
        rop = rng.choice(["SUM", "MAX", "MIN", "AVG"])
        if dt == "complex64" and rop in ("MAX", "MIN"):
            rop = "SUM"
        if rop == "AVG" and dt.startswith(("int", "uint")):
            rop = "SUM"
        if op == "send_recv":
            pair = rng.sample(range(gs), 2) if gs > 1 else None
        a2a_sizes = (
            [[rng.randrange(0, max(1, n) + 1) for _ in range(gs)] for _ in range(gs)] if op == "all_to_all" else None
        )
        self.ops[op] = self.ops.get(op, 0) + 1
        if self.rank not in ranks:
            return
        r = self.rank
        gr = ranks.index(r)
        what = f"it={it} {op} dtype={dt} n={n} ranks={ranks} root={root} op={rop}"
        base = np.arange(n) % 5 + 1
        coef = [q + 1 + salt for q in ranks]
        if op == "all_reduce" or op == "reduce":
            x = self.contrib(r, n, dt, salt)
            orig = x.copy()
            if op == "all_reduce":
                dist.all_reduce(x, op=getattr(dist.ReduceOp, rop), group=group)
            else:
                dist.reduce(x, dst=root, op=getattr(dist.ReduceOp, rop), group=group)
            if op == "reduce" and r != root:
                self.check(np.array_equal(x, orig), what + " (non-root buffer changed)")
                return
            if rop == "SUM":
                self.check(np.array_equal(x, (base * sum(coef)).astype(dt)), what)
            elif rop == "MAX":
                self.check(np.array_equal(x, (base * max(coef)).astype(dt)), what)
            elif rop == "MIN":
                self.check(np.array_equal(x, (base * min(coef)).astype(dt)), what)
            else:
                self.check(
                    np.allclose(x, (base * sum(coef) / gs).astype(dt), rtol=1e-2 if dt == "float16" else 1e-6), what
                )
        elif op == "broadcast":
            x = self.contrib(r, n, dt, salt) if r == root else np.zeros(n, dt)
            dist.broadcast(x, src=root, group=group)
            self.check(np.array_equal(x, self.contrib(root, n, dt, salt)), what)
        elif op == "all_gather":
            outs = [np.zeros(n, dt) for _ in ranks]
            dist.all_gather(outs, self.contrib(r, n, dt, salt), group=group)
            self.check(all(np.array_equal(outs[i], self.contrib(q, n, dt, salt)) for i, q in enumerate(ranks)), what)
        elif op == "all_gather_into_tensor":
            out = np.zeros(gs * n, dt)
            dist.all_gather_into_tensor(out, self.contrib(r, n, dt, salt), group=group)
            self.check(
                np.array_equal(out, np.concatenate([self.contrib(q, n, dt, salt) for q in ranks]) if n else out), what
            )
        elif op in ("reduce_scatter", "reduce_scatter_tensor"):
            # rank q's input block j is (q + 1 + salt) * (j + 1) * base:
            # block gr of the SUM is sum(coef) * (gr + 1) * base
            blocks = [((r + 1 + salt) * (j + 1) * base).astype(dt) for j in range(gs)]
            out = np.zeros(n, dt)
            sop = "SUM" if rop in ("SUM", "AVG") else rop
            if op == "reduce_scatter":
                dist.reduce_scatter(out, blocks, op=getattr(dist.ReduceOp, sop), group=group)
            else:
                dist.reduce_scatter_tensor(
                    out, np.concatenate(blocks) if n else np.zeros(0, dt), op=getattr(dist.ReduceOp, sop), group=group
                )
            agg = {"SUM": sum, "MAX": max, "MIN": min}[sop](coef)
            self.check(np.array_equal(out, (agg * (gr + 1) * base).astype(dt)), what)
        elif op == "all_to_all":
            assert a2a_sizes is not None

            # rank gi sends a2a_sizes[gi][gj] elements of value (8*gi + gj + 1) * (k % 3 + 1) to group rank gj
            def blk(gi: int, gj: int) -> Any:
                m = a2a_sizes[gi][gj]
                return ((8 * gi + gj + 1) * (np.arange(m) % 3 + 1)).astype(dt)

            ins = [blk(gr, j) for j in range(gs)]
            outs = [np.zeros(a2a_sizes[i][gr], dt) for i in range(gs)]
            dist.all_to_all(outs, ins, group=group)
            self.check(all(np.array_equal(outs[i], blk(i, gr)) for i in range(gs)), what)
        elif op == "gather":
            gl = [np.zeros(n, dt) for _ in ranks] if r == root else None
            dist.gather(self.contrib(r, n, dt, salt), gl, dst=root, group=group)
            if r == root:
                assert gl is not None
                self.check(all(np.array_equal(gl[i], self.contrib(q, n, dt, salt)) for i, q in enumerate(ranks)), what)
        elif op == "scatter":
            out = np.zeros(n, dt)
            dist.scatter(
                out, [self.contrib(q, n, dt, salt) for q in ranks] if r == root else None, src=root, group=group
            )
            self.check(np.array_equal(out, self.contrib(r, n, dt, salt)), what)
        elif op == "barrier":
            dist.barrier(group=group)
        elif op == "send_recv":
            if pair is None:
                return
            s, d = pair
            tag = it % (1 << 20)
            if gr == s:
                dist.send(self.contrib(r, n, dt, salt), dst=ranks[d], group=group, tag=tag)
            elif gr == d:
                got = np.zeros(n, dt)
                src = dist.recv(got, src=ranks[s], group=group, tag=tag)
                self.check(src == ranks[s] and np.array_equal(got, self.contrib(ranks[s], n, dt, salt)), what)

    def run(self) -> int:
        np, dist = self.np, self.dist
        t0 = time.monotonic()
        self.sample(t0, force=True)
        print(f"SOAK-PID rank {self.rank} pid {os.getpid()}", flush=True)
        it = 0
        stop = np.zeros(1, np.int32)
        last_progress = 0.0
        while True:
            self.one(it)
            it += 1
            self.sample(t0)
            if it % 16 == 0:
                el = time.monotonic() - t0
                stop[0] = 1 if (self.rank == 0 and el >= self.args.duration) else 0
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops after the same iteration
                if self.rank == 0 and self.args.progress and el - last_progress >= self.args.progress:
                    last_progress = el
                    print(
                        f"SOAK progress {el:.0f}s: {it} iterations, {len(self.wrong)} wrong, "
                        f"rss {self.rss[-1][1] / 2**20:.1f} MiB (anon {self.rss[-1][2] / 2**20:.1f})",
                        flush=True,
                    )
                if stop[0]:
                    break
        self.sample(t0, force=True)
        elapsed = time.monotonic() - t0
        mine = {
            "rank": self.rank,
            "ops": self.ops,
            "wrong": len(self.wrong),
            "rss": self.rss,
            "its": it,
            "pid": os.getpid(),
        }
        everyone: List[Any] = [None] * self.ws
        dist.all_gather_object(everyone, mine)
        if self.rank == 0:
            self.summary(everyone, elapsed)
        dist.destroy_process_group()
        return 0 if all(e["wrong"] == 0 for e in everyone) else 1

    def summary(self, everyone: List[Dict[str, Any]], elapsed: float) -> None:
        mib = 2.0**20
        its = everyone[0]["its"]
        by_op = everyone[0]["ops"]  # drawn identically on every rank
        wrong = sum(e["wrong"] for e in everyone)
        print(
            f"SOAK SUMMARY ops={its} (collective/p2p calls, + {its // 16} stop-flag all_reduces) wrong={wrong} "
            f"elapsed={elapsed:.1f}s ranks={self.ws} groups={[g for _, g in self.groups]} seed={self.args.seed}",
            flush=True,
        )
        print("SOAK OPS " + " ".join(f"{k}={v}" for k, v in sorted(by_op.items())), flush=True)
        warm_t = min(60.0, 0.1 * elapsed)
        rows = []
        for e in everyone:
            rss = e["rss"]
            vals = [b for _, b, _ in rss]
            anon = [a for _, _, a in rss]
            warm = next((b for t, b, _ in rss if t >= warm_t), vals[-1])
            row = {
                "rank": e["rank"],
                "samples": len(vals),
                "start": vals[0] / mib,
                "after_warmup": warm / mib,
                "end": vals[-1] / mib,
                "max": max(vals) / mib,
            }
            row["growth"] = row["end"] - row["start"]
            row["growth_after_warmup"] = row["end"] - row["after_warmup"]
            row["anon_start"], row["anon_end"], row["anon_max"] = anon[0] / mib, anon[-1] / mib, max(anon) / mib
            # the second half of the run: a leak keeps growing there, a warming cache does not
            half = [b for t, b, _ in rss if t >= elapsed / 2] or vals[-1:]
            row["growth_second_half"] = (vals[-1] - half[0]) / mib
            rows.append(row)
            print(
                f"SOAK RSS rank {e['rank']}: start={row['start']:.1f} MiB "
                f"after-warmup({warm_t:.0f}s)={row['after_warmup']:.1f} "
                f"end={row['end']:.1f} max={row['max']:.1f} growth={row['growth']:+.1f} MiB "
                f"(after warmup {row['growth_after_warmup']:+.1f}, second half {row['growth_second_half']:+.1f}; "
                f"anon {row['anon_start']:.1f}->{row['anon_end']:.1f} max {row['anon_max']:.1f}; {len(vals)} samples)",
                flush=True,
            )
        print(
            "SOAK JSON " + json.dumps({"ops": its, "wrong": wrong, "elapsed": elapsed, "rss": rows, "by_op": by_op}),
            flush=True,
        )


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if not args.worker:
        return launch(args)
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
