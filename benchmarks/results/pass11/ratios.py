"""The ratio tables of this pass (procgroup / Open MPI and procgroup / gloo, N=2 and N=4) from the bench JSON files:
``python ratios.py n2.json n4.json > ratios.md``.  Bold: a cell over its target (<= 3x below 16 KiB, <= 1.0x from
16 KiB against Open MPI; < 1.0x against gloo)."""

import json
import sys

SIZES = ["-", "4", "1K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]


def label(n: int) -> str:
    for u, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{u}"
    return str(n)


for path in sys.argv[1:]:
    table = json.load(open(path))["table"]
    for other, name in (("mpi", "Open MPI"), ("gloo", "gloo")):
        print(f"{path}: procgroup / {name} (median over the rounds; < 1: procgroup faster)\n")
        print("| op | " + " | ".join(SIZES) + " |")
        print("|---|" + "---:|" * len(SIZES))
        for op, rows in table.items():
            cells = {("-" if op == "barrier" else label(r["bytes"])): r.get(f"ratio_{other}") for r in rows}
            out = []
            for s in SIZES:
                v = cells.get(s)
                if v is None:
                    out.append("")
                    continue
                small = s in ("-", "4", "1K")
                over = v > (3.0 if small and other == "mpi" else 1.0)
                out.append(f"**{v:.2f}**" if over else f"{v:.2f}")
            print(f"| {op} | " + " | ".join(out) + " |")
        print()
