"""Ranges of ab.sh logs (pass 22): for every variant and op:size, min-max of the per-round medians (us).

python ranges.py ../logs/ag_n2_reads_plan.log [more logs]
"""

import re
import sys
from collections import defaultdict

cells = defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path):
        m = re.match(r"\S+ r\d+ (\S+): (?:\[0\] )?(?:RES )?(.*)", line)
        if not m or m.group(1) == "period":
            continue
        toks = m.group(2).split()
        for k in range(0, len(toks) - 1, 2):
            if toks[k] == "LOAD":
                break
            cells[(m.group(1), toks[k])].append(int(toks[k + 1]))
variants = sorted({v for v, _ in cells}, key=lambda v: (v == "mpi", v))
ops = list(dict.fromkeys(o for _, o in cells))
print("| op | " + " | ".join(variants) + " |")
print("|---|" + "---:|" * len(variants))
for o in ops:
    row = []
    for v in variants:
        x = cells.get((v, o))
        row.append(f"{min(x)}-{max(x)}" if x else "")
    print(f"| {o} | " + " | ".join(row) + " |")
