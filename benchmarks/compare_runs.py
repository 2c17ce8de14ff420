#!/usr/bin/env python
"""Compare two `procgroup bench --json` runs case by case (e.g. before and after a change).

    python benchmarks/compare_runs.py before.json after.json [more pairs ...] --markdown out.md

For each (op, size): procgroup's median in each run, after/before, and the same-run ratios to the comparison
system (gloo) with their quotient, which cancels much of a shared machine's drift between the two runs.  Several
pairs (rounds) give one column each and a median over them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Sequence, Tuple


def _cases(path: str) -> Dict[Tuple[str, int], dict]:
    with open(path) as f:
        table = json.load(f)["table"]
    return {(op, row["bytes"]): row for op, rows in table.items() for row in rows}


def _size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def compare(pairs: Sequence[Tuple[str, str]], other: str = "gloo") -> List[str]:
    """Markdown lines: one row per case, the after/before quotients of each pair and their median."""
    runs = [(_cases(b), _cases(a)) for b, a in pairs]
    keys = [k for k in runs[0][0] if all(k in b and k in a for b, a in runs)]
    head = "| op | size | " + " | ".join(f"after/before {i + 1}" for i in range(len(runs)))
    head += f" | median | ratio to {other} after/before (median) |"
    out = [head, "|---|---:|" + "---:|" * (len(runs) + 2)]
    worst = []
    for op, size in keys:
        own = [a[(op, size)]["procgroup_median_s"] / b[(op, size)]["procgroup_median_s"] for b, a in runs]
        rel = [
            a[(op, size)][f"ratio_{other}"] / b[(op, size)][f"ratio_{other}"]
            for b, a in runs
            if b[(op, size)].get(f"ratio_{other}") and a[(op, size)].get(f"ratio_{other}")
        ]
        m, r = statistics.median(own), (statistics.median(rel) if rel else float("nan"))
        worst.append((min(m, r), m, r, op, size))
        cells = " | ".join(f"{x:.2f}" for x in own)
        out.append(f"| {op} | {_size(size)} | {cells} | {m:.2f} | {r:.2f} |")
    slower = [w for w in worst if w[0] > 1.05]
    out.append("")
    listed = ", ".join(f"{op} {_size(s)} ({m:.2f}/{r:.2f})" for _, m, r, op, s in slower) or "none"
    out.append(
        f"{len(keys)} cases; {len(slower)} slower by more than 5% on both measures (median of own time and of the "
        f"ratio to {other}): {listed}"
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="before.json after.json, repeated for each round")
    p.add_argument("--other", default="gloo", help="the comparison system of the runs (default gloo)")
    p.add_argument("--markdown", help="write the table here too")
    ns = p.parse_args(argv)
    if len(ns.runs) % 2:
        p.error("give the runs in pairs: before after [before after ...]")
    lines = compare(list(zip(ns.runs[::2], ns.runs[1::2])), ns.other)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if ns.markdown:
        with open(ns.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
