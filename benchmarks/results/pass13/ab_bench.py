"""Whole-run A/B of ``procgroup bench`` cases: each variant a whole bench run, variants alternating by round.

    python ab_bench.py ROUNDS NPROC OPS SIZES 'label|PATCH[|TREE[|ENV]]' 'label|PATCH[|TREE[|ENV]]'

``PATCH`` is ``-`` (the checkout as it is) or ``module.NAME=literal;...`` (``NAME[key]=...`` for a dict entry),
applied in every process of the run through a sitecustomize (see ab_jobs.py).  ``TREE`` (pass 15): another
checkout to run instead of this one (a git worktree of an older commit, its C extensions built in place; empty:
this one).  ``ENV`` (pass 19): ``NAME=value`` pairs, space-separated, set in the bench's environment
(``PROCGROUP_CPU_BIND=none``).
Prints per case the median over rounds of procgroup's median time, each round's value, and in how many rounds the
second variant was faster.
"""

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ab_jobs import check_patch, site_dir


def main() -> None:
    rounds, nproc, ops, sizes = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    variants = [(v.split("|") + ["", ""])[:4] for v in sys.argv[5:]]
    for _label, patch, _tree, _env in variants:
        if patch != "-":
            check_patch(patch)
    site = site_dir()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../..")
    res: dict = collections.defaultdict(list)
    out = tempfile.mkdtemp(prefix="pg-ab-bench-")
    for k in range(rounds):
        for label, patch, tree, extra in variants if k % 2 == 0 else variants[::-1]:
            src = os.path.join(tree or here, "src")
            env = dict(os.environ, PYTHONPATH=f"{site}:{os.path.abspath(src)}")
            env.update(kv.split("=", 1) for kv in extra.split())
            if patch != "-":
                env["PG_PATCH"] = patch
            path = os.path.join(out, f"{label}.json")
            cmd = ["procgroup", "bench", "--nproc", nproc, "--ops", ops, "--sizes", sizes, "--repeat", "1"]
            run = subprocess.run(cmd + ["--json", path], env=env, capture_output=True, cwd=out, text=True)
            if run.returncode:
                raise SystemExit(f"{label}: procgroup bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
            for r in json.load(open(path))["results"]["procgroup"]:
                if "median_s" in r:
                    res[(r["op"], r["nominal_bytes"], label)].append(r["median_s"] * 1e6)
    a, b = variants[0][0], variants[1][0]
    for op, n in sorted({(o, n) for o, n, _ in res}):
        x, y = res[(op, n, a)], res[(op, n, b)]
        wins = sum(q < p for p, q in zip(x, y))
        print(
            f"{op:>10} {n:>9}: {a} {statistics.median(x):8.1f}  {b} {statistics.median(y):8.1f}  ratio "
            f"{statistics.median(y) / statistics.median(x):.3f}  {b} faster {wins}/{len(x)}  "
            f"[{' '.join(f'{v:.0f}' for v in x)}] [{' '.join(f'{v:.0f}' for v in y)}]"
        )


if __name__ == "__main__":
    main()
