"""Whole-job A/B of the multi-host all_reduce: variants take turns job by job, never call by call.

    python ab_jobs.py ROUNDS SZ IT 'label|tree|VAR=value ...' 'label|tree|VAR=value ...' ...   # as root

Each round runs every variant once as a whole job (``../pass11/mh_loop.sh`` of ``../pass11/loop.py`` from the
checkout ``tree``: IT back-to-back all_reduce calls of SZ bytes on 3 netns hosts x 2 ranks), in alternating order
(round 0 A B, round 1 B A, ...).  ``VAR=value`` goes into the ranks' environment: ``FORCE=...`` of loop.py, any
``PROCGROUP_*`` setting, or ``PG_PATCH=module.NAME=literal;...``, which sets a module constant in every rank
before it starts (``NAME[key]`` sets a dict entry).  Prints per variant the median over rounds of loop.py's
"slowest rank per call, median", every round's value, the CPU of all ranks per call, and in how many rounds the
second variant beat the first.

Why whole jobs: pass 13 found that alternating the variants call by call inside one job (``ab.py``-style, as
earlier passes tuned) can favour either side on this VM -- a call runs right after the other variant's, in the
state that one left -- and reversed two decisions (hierarchical against multileader at 1 MiB, direct against
reduce-scatter + all-gather between hosts at 256 KiB).  Two identical trees measured this way differ by 2 %.
"""

import ast
import os
import re
import statistics
import subprocess
import sys
import tempfile

_SITE = """
import ast, importlib, os, sys
try:
    for kv in filter(None, os.environ.get("PG_PATCH", "").split(";")):
        k, v = kv.split("=", 1)
        mod, attr = k.rsplit(".", 1)
        m = importlib.import_module(mod)
        if "[" in attr:
            a, key = attr[:-1].split("[")
            getattr(m, a)[ast.literal_eval(key)] = ast.literal_eval(v)
        else:
            getattr(m, attr)  # a name that does not exist is a typo, not a new constant
            setattr(m, attr, ast.literal_eval(v))
except Exception as e:  # a patch that does not apply must not run as the unpatched code (an A/A in disguise)
    print(f"PG_PATCH does not apply: {e!r}", file=sys.stderr, flush=True)
    os._exit(97)
"""


def check_patch(patch: str) -> None:
    """Raise SystemExit when a ``PG_PATCH`` value would not apply: every value must be a Python literal (pass 14 ran
    ``1<<62``, which is not one, so its sitecustomize failed and both variants ran the same code)."""
    for kv in filter(None, patch.split(";")):
        k, _, v = kv.partition("=")
        try:
            ast.literal_eval(v)
            if "[" in k:
                ast.literal_eval(k[k.index("[") + 1 : -1])
        except (ValueError, SyntaxError) as e:
            raise SystemExit(
                f"PG_PATCH {kv!r}: not a literal ({e}); write the number, e.g. 4611686018427387904"
            ) from None


def site_dir() -> str:
    """A folder whose sitecustomize.py applies PG_PATCH in every Python process that has it on its path."""
    d = tempfile.mkdtemp(prefix="pg-ab-site-")
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(_SITE)
    return d


def main() -> None:
    rounds, sz, it = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    variants = [v.split("|") for v in sys.argv[4:]]
    for _label, _tree, extra in variants:
        for tok in extra.split():
            if tok.startswith("PG_PATCH="):
                check_patch(tok[len("PG_PATCH=") :])
    site = site_dir()
    times = {v[0]: [] for v in variants}
    cpu = {v[0]: [] for v in variants}
    env = dict(os.environ, TMPDIR=os.environ.get("TMPDIR", tempfile.gettempdir()))
    for k in range(rounds):
        for label, tree, extra in variants if k % 2 == 0 else variants[::-1]:
            tree = os.path.abspath(tree)
            loop = os.path.join(tree, "benchmarks/results/pass11")
            cmd = ["bash", f"{loop}/mh_loop.sh", f"{loop}/loop.py", f"SZ={sz}", f"IT={it}"]
            cmd += [f"PYTHONPATH={site}:{tree}/src"] + extra.split()
            out = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
            m = re.search(r"slowest rank per call median ([\d.]+)", out)
            if m:
                times[label].append(float(m.group(1)))
                cpu[label].append(sum(float(x) for x in re.findall(r"CPU (\d+) us/call", out)))
    for label, v in times.items():
        print(
            f"{label:>12} SZ={sz}: median of {len(v)} jobs {statistics.median(v):.0f} us "
            f"[{' '.join(f'{x:.0f}' for x in v)}]  CPU all ranks {statistics.median(cpu[label]):.0f} us/call"
        )
    a, b = list(times)[:2]
    wins = sum(y < x for x, y in zip(times[a], times[b]))
    ratio = statistics.median(times[b]) / statistics.median(times[a])
    print(f"{b} faster than {a} in {wins}/{min(len(times[a]), len(times[b]))} rounds; ratio of medians {ratio:.3f}")


if __name__ == "__main__":
    main()
