"""Pieces every worker shares: its command line and the JSON-lines result file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Optional, Sequence

import numpy as np

from .cases import OPS, Adapter, Case, parse_size, plan, run_cases, sizes_between


def worker_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="one system's benchmark worker (started by procgroup bench)")
    p.add_argument("--out", required=True, help="JSON-lines file rank 0 appends its records to")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", default="4")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--sizes", default=None, help="only these sizes (comma-separated), instead of the range")
    p.add_argument("--iters", default="auto")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one collective may take")
    p.add_argument("--backend", default="cpu", help="procgroup's backend (procgroup's worker only): cpu or mpi")
    p.add_argument("--name", default="procgroup", help="the system name its records carry (procgroup's worker only)")
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="run the cases under cProfile; every rank writes DIR/<system>-rank<r>-<pid>.prof and .txt",
    )
    return p


def cases_from(ns: argparse.Namespace, n: int) -> list[Case]:
    ops = [o for o in ns.ops.split(",") if o]
    iters = None if ns.iters == "auto" else int(ns.iters)
    if ns.sizes:
        sizes = sorted({parse_size(x) for x in ns.sizes.split(",") if x.strip()})
    else:
        sizes = sizes_between(parse_size(ns.min_bytes), parse_size(ns.max_bytes))
    return plan(ops, sizes, n, iters)


def versions() -> dict:
    return {"python": platform.python_version(), "numpy": np.__version__}


def drive(a: Adapter, ns: argparse.Namespace, info: Optional[dict] = None) -> int:
    """Run the cases; rank 0 writes a header line then one line per case, flushed as it goes."""
    cases = cases_from(ns, a.size)
    f = open(ns.out, "a", encoding="utf-8") if a.rank == 0 else None
    try:
        if f is not None:
            head = {
                "kind": "header",
                "system": a.name,
                "world_size": a.size,
                "pid": os.getpid(),
                "cases": len(cases),
                **versions(),
                **(info or {}),
            }
            f.write(json.dumps(head) + "\n")
            f.flush()
        prof = None
        if ns.profile:
            import cProfile

            os.makedirs(ns.profile, exist_ok=True)
            prof = cProfile.Profile()
            prof.enable()
        for rec in run_cases(a, cases):
            rec["kind"] = "case"
            rec["system"] = a.name
            if prof is not None:
                rec["profiled"] = True  # cProfile slows Python code: these times are not comparable
            assert f is not None
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if prof is not None:
            prof.disable()
            _dump_profile(prof, os.path.join(ns.profile, f"{a.name}-rank{a.rank}-{os.getpid()}"))
        if f is not None:
            f.write(json.dumps({"kind": "end", "system": a.name}) + "\n")
    finally:
        if f is not None:
            f.close()
    return 0


def _dump_profile(prof, base: str) -> None:
    import io
    import pstats

    prof.dump_stats(base + ".prof")
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    with open(base + ".txt", "w", encoding="utf-8") as f:
        f.write(buf.getvalue())


def argv_list(argv: Optional[Sequence[str]]) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
