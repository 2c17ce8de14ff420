"""Whole-job A/B of a pair's broadcast: the big slots against the rendezvous (pass 16).

    python bcast_jobs.py ROUNDS NPROC SIZES LIMIT      # e.g. 5 2 16777216,33554432,50331648,67108864 1048576

Each round runs two jobs of ``procgroup run --standalone --nproc-per-node NPROC`` in turn: A with the checkout's
settings, B with ``select.BIG_LIMIT['broadcast'] = LIMIT`` (above it, the message algorithms: between two ranks
the rendezvous, one copy out of the root's buffer).  A job broadcasts a buffer of written data (each rank's own
value, checked after the warm-up) 30 times back to back per size and reports the median of the slowest rank per
call.  Prints per size the median over rounds of A and B, B/A, and in how many rounds B won.  (Same-process A/Bs
with ``benchmarks/ab_bigslots.py`` broadcast ``np.zeros`` buffers: the root's untouched zero pages stay in the
cache, which hid the cost of the big slots' second copy above the last-level cache.)
"""

import os
import statistics
import subprocess
import sys

import numpy as np


def job() -> None:
    """One job's broadcasts (run under the launcher with ``PG_BCAST_SIZES``)."""
    import time

    import procgroup as dist
    from procgroup.algorithms import select

    dist.init_process_group("gloo")
    r, p = dist.get_rank(), dist.get_world_size()
    if os.environ.get("PG_BCAST_LIMIT"):
        select.BIG_LIMIT["broadcast"] = int(os.environ["PG_BCAST_LIMIT"])
    for sz in [int(s) for s in os.environ["PG_BCAST_SIZES"].split(",")]:
        a = np.full(sz // 4, 1.0 + r, np.float32)
        for _ in range(5):
            dist.broadcast(a, src=0)
        assert a[0] == 1.0 and a[-1] == 1.0
        ts = np.zeros(30)
        dist.barrier()
        t = time.perf_counter()
        for k in range(len(ts)):
            dist.broadcast(a, src=0)
            t2 = time.perf_counter()
            ts[k], t = t2 - t, t2
        out = [None] * p
        dist.all_gather_object(out, ts)
        if r == 0:
            print("RES", sz, "%.1f" % (1e6 * np.median(np.max(out, axis=0))), flush=True)
    dist.destroy_process_group()


def main() -> None:
    rounds, nproc, sizes, limit = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    res: dict = {}
    for k in range(rounds):
        for v in ("A", "B") if k % 2 == 0 else ("B", "A"):
            env = dict(os.environ, PG_BCAST_SIZES=sizes, PG_BCAST_JOB="1")
            if v == "B":
                env["PG_BCAST_LIMIT"] = limit
            cmd = ["procgroup", "run", "--standalone", "--nproc-per-node", nproc, os.path.abspath(__file__)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
            for line in out.splitlines():
                f = line.split()
                if len(f) >= 3 and f[-3] == "RES":
                    res.setdefault((int(f[-2]), v), []).append(float(f[-1]))
    for sz in sorted({s for s, _ in res}):
        a, b = res[(sz, "A")], res[(sz, "B")]
        wins = sum(y < x for x, y in zip(a, b))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{sz:>10}  A {ma:8.1f}  B {mb:8.1f}  B/A {mb / ma:.2f}  B won {wins} of {len(a)}  {a} {b}")


if __name__ == "__main__":
    job() if os.environ.get("PG_BCAST_JOB") else main()
