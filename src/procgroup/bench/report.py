"""Turning result records into tables (console, markdown), target verdicts and an optional plot."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from .cases import OPS, fmt_size

__all__ = [
    "SYSTEMS",
    "rows_by_op",
    "console_tables",
    "markdown",
    "evaluate_targets",
    "evaluate_mpi_backend_targets",
    "plot",
    "TARGETS",
]

SYSTEMS = ("procgroup", "gloo", "mpi", "cpu")
LABEL = {"procgroup": "procgroup", "gloo": "gloo", "mpi": "MPI", "cpu": "pg-cpu"}

#: The goals of the performance issue, judged on ratios measured in the same run:
#: (name, op, bytes or None for "smallest measured", other system, max ratio, world size or None for any)
TARGETS = (
    ("small all_reduce <= 0.1x gloo", "all_reduce", None, "gloo", 0.1, None),
    ("64 MiB all_reduce <= 0.8x Open MPI", "all_reduce", 64 << 20, "mpi", 0.8, None),
    ("64 MiB broadcast <= 1.0x Open MPI (N=2)", "broadcast", 64 << 20, "mpi", 1.0, 2),
    ("64 MiB all_gather <= 1.0x Open MPI (N=2)", "all_gather", 64 << 20, "mpi", 1.0, 2),
    ("barrier <= 0.05x gloo (N=4)", "barrier", 0, "gloo", 0.05, 4),
)
STARTUP_TARGET_S = 1.0
STORE_TARGET = (4096, 5.0)


def _key(rec: dict) -> tuple[str, int]:
    return rec["op"], int(rec.get("bytes", rec.get("nominal_bytes", 0)) or 0)


def rows_by_op(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """{op: [row]} where a row is {"bytes", system: record, "ratio_<sys>": float|None}, sizes ascending."""
    table: dict[str, dict[int, dict]] = {}
    for sysname, recs in results.items():
        for rec in recs:
            if rec.get("skipped"):
                continue
            op, b = _key(rec)
            row = table.setdefault(op, {}).setdefault(b, {"op": op, "bytes": b})
            row[sysname] = rec
    out: dict[str, list[dict]] = {}
    for op in sorted(table, key=lambda o: OPS.index(o) if o in OPS else len(OPS)):
        rows = [table[op][b] for b in sorted(table[op])]
        for row in rows:
            pg = _med(row.get("procgroup"))
            for other in SYSTEMS[1:]:
                om = _med(row.get(other))
                row[f"ratio_{other}"] = (pg / om) if (pg is not None and om) else None
        out[op] = rows
    return out


def combine_rounds(records: Sequence[dict]) -> list[dict]:
    """One record per (op, size) from several rounds: the median over rounds of each statistic.

    ``round_medians_s`` keeps every round's median; a case that failed in any round stays failed.
    """
    import statistics

    groups: dict[tuple[str, int], list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["op"], int(rec.get("bytes", rec.get("nominal_bytes", 0)) or 0)), []).append(rec)
    out = []
    for recs in groups.values():
        bad = [r for r in recs if "error" in r or r.get("skipped")]
        if bad:
            out.append(bad[0])
            continue
        c = dict(recs[0])
        c.pop("round", None)
        c.pop("position", None)
        for f in ("median_s", "p90_s", "mean_s", "min_s", "max_s", "algbw_GBps", "busbw_GBps", "background_cpu"):
            vals = [r[f] for r in recs if r.get(f) is not None]
            if vals:
                c[f] = statistics.median(vals)
        c["min_s"] = min(r["min_s"] for r in recs)
        c["round_medians_s"] = [r["median_s"] for r in recs]
        c["iters"] = sum(r["iters"] for r in recs)
        out.append(c)
    return out


def add_round_ratios(by_op: dict[str, list[dict]], rounds: dict[str, list[dict]], systems: Sequence[str]) -> None:
    """Add ``ratio_<sys>_rounds``: the ratio measured within each round (same round, same op)."""
    med: dict[tuple[str, str, int, int], float] = {}
    for s, recs in rounds.items():
        for r in recs:
            if "median_s" in r:
                med[(s, r["op"], int(r.get("bytes", 0)), r.get("round", 0))] = r["median_s"]
    nrounds = 1 + max((r.get("round", 0) for recs in rounds.values() for r in recs), default=0)
    for op, rows in by_op.items():
        for row in rows:
            for other in systems[1:]:
                vals = []
                for k in range(nrounds):
                    a, b = med.get(("procgroup", op, row["bytes"], k)), med.get((other, op, row["bytes"], k))
                    if a is not None and b:
                        vals.append(a / b)
                if vals:
                    row[f"ratio_{other}_rounds"] = vals


def compact_table(by_op: dict[str, list[dict]], systems: Sequence[str]) -> dict[str, list[dict]]:
    """The comparison for the JSON file: per op and size, each system's median and the ratios
    (the full records are under "results")."""
    out: dict[str, list[dict]] = {}
    for op, rows in by_op.items():
        out[op] = []
        for row in rows:
            c: dict = {"bytes": row["bytes"]}
            for s in systems:
                rec = row.get(s)
                if rec is not None:
                    c[f"{s}_median_s"] = rec.get("median_s")
                    if "error" in rec:
                        c[f"{s}_error"] = rec["error"]
            for s in systems[1:]:
                c[f"ratio_{s}"] = row.get(f"ratio_{s}")
                if f"ratio_{s}_rounds" in row:
                    c[f"ratio_{s}_rounds"] = row[f"ratio_{s}_rounds"]
            out[op].append(c)
    return out


def _med(rec: Optional[dict]) -> Optional[float]:
    if not rec or "median_s" not in rec:
        return None
    return float(rec["median_s"])


def _us(rec: Optional[dict], field: str = "median_s") -> str:
    if rec is None:
        return "-"
    if "error" in rec:
        return "FAILED"
    if field not in rec:
        return "-"
    return f"{rec[field] * 1e6:.1f}"


def _num(v: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _bw(rec: Optional[dict], field: str) -> str:
    if not rec or field not in rec:
        return "-"
    return f"{rec[field]:.3f}"


def _size(b: int, op: str) -> str:
    return "-" if op == "barrier" else fmt_size(b)


def _columns(systems: Sequence[str]) -> list[tuple[str, int]]:
    cols = [("size", 6), ("pg med us", 11), ("pg p90 us", 11), ("algbw GB/s", 10), ("busbw GB/s", 10)]
    for s in systems[1:]:
        cols += [(f"{LABEL[s]} med us", 12), (f"ratio {LABEL[s]}", 9)]
    return cols


def _cells(row: dict, systems: Sequence[str]) -> list[str]:
    pg = row.get("procgroup")
    cells = [_size(row["bytes"], row["op"]), _us(pg), _us(pg, "p90_s"), _bw(pg, "algbw_GBps"), _bw(pg, "busbw_GBps")]
    for s in systems[1:]:
        cells += [_us(row.get(s)), _num(row.get(f"ratio_{s}"))]
    return cells


def console_tables(by_op: dict[str, list[dict]], systems: Sequence[str], n: int) -> str:
    cols = _columns(systems)
    lines = []
    for op, rows in by_op.items():
        title = f"{op}  (N={n}, float32; time = max over ranks per iteration"
        title += ", one way)" if op == "sendrecv" else ")"
        lines.append(title)
        bg = _background(rows, systems)
        if bg:
            lines.append(f"  other users' CPU load while this op ran: {bg}")
        lines.append("  ".join(f"{name:>{w}}" for name, w in cols))
        for row in rows:
            lines.append("  ".join(f"{c:>{w}}" for c, (_, w) in zip(_cells(row, systems), cols)))
        errs = [(s, row[s]["error"]) for row in rows for s in systems if row.get(s) and "error" in row[s]]
        for s, e in errs[:4]:
            lines.append(f"  ! {LABEL[s]}: {e}")
        lines.append("")
    return "\n".join(lines)


def _background(rows: Sequence[dict], systems: Sequence[str]) -> str:
    parts = []
    for s in systems:
        vals = [r[s]["background_cpu"] for r in rows if r.get(s) and r[s].get("background_cpu") is not None]
        if vals:
            parts.append(f"{LABEL[s]} {100 * max(vals):.0f}%")
    return ", ".join(parts)


def markdown(by_op: dict[str, list[dict]], systems: Sequence[str], n: int) -> str:
    cols = [c for c, _ in _columns(systems)]
    out = []
    for op, rows in by_op.items():
        out.append(f"#### {op} (N={n}{', one-way latency' if op == 'sendrecv' else ''})\n")
        bg = _background(rows, systems)
        if bg:
            out.append(f"Other users' CPU load while this op ran: {bg}.\n")
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---:|" * len(cols))
        for row in rows:
            out.append("| " + " | ".join(_cells(row, systems)) + " |")
        out.append("")
    return "\n".join(out)


def evaluate_targets(
    by_op: dict[str, list[dict]], n: int, startup: Optional[dict], store: Optional[dict]
) -> list[dict]:
    """Verdicts for the issue's targets that this run can judge (met / missed / not measured)."""
    out = []
    for name, op, b, other, limit, only_n in TARGETS:
        if only_n is not None and only_n != n:
            continue
        if op not in by_op:
            continue  # this run did not measure the op at all
        rows = by_op[op]
        if not any(r.get(other) for r in rows):
            continue  # nothing to compare with in this run
        if b is None:
            rows = [r for r in rows if r.get(f"ratio_{other}") is not None][:1]
        else:
            rows = [r for r in rows if r["bytes"] == b]
            if not rows:
                continue  # the size was outside this run's range
        ratio = rows[0].get(f"ratio_{other}") if rows else None
        v = {
            "target": name,
            "limit": limit,
            "ratio": ratio,
            "ratio_rounds": rows[0].get(f"ratio_{other}_rounds") if rows else None,
            "bytes": rows[0]["bytes"] if rows else b,
            "status": "not measured" if ratio is None else ("met" if ratio <= limit else "missed"),
        }
        out.append(v)
    if startup and startup.get("nproc") == 4 and startup.get("procgroup", {}).get("median_s") is not None:
        m = startup["procgroup"]["median_s"]
        out.append(
            {
                "target": f"startup (N={startup.get('nproc')}) <= {STARTUP_TARGET_S:.1f} s",
                "limit": STARTUP_TARGET_S,
                "value_s": m,
                "status": "met" if m <= STARTUP_TARGET_S else "missed",
            }
        )
    if store and store.get("total_s") is not None:
        c, lim = STORE_TARGET
        if store.get("clients") == c:
            t = store["total_s"]
            out.append(
                {
                    "target": f"store rendezvous of {c} clients <= {lim:.0f} s",
                    "limit": lim,
                    "value_s": t,
                    "status": "met" if store.get("ok") and t <= lim else "missed",
                }
            )
    return out


#: the mpi backend's goals (issue 13), against raw mpi4py in the same run: added microseconds at the smallest
#: size, and bandwidth at 64 MiB as a fraction of raw mpi4py's (ratio of times <= 1 / 0.95)
MPI_ADDED_US = 3.0
MPI_BW_FRACTION = 0.95


def evaluate_mpi_backend_targets(by_op: dict[str, list[dict]]) -> list[dict]:
    """Verdicts of procgroup on backend="mpi" against raw mpi4py: <= 3 us added at 4 B, >= 0.95x at 64 MiB."""
    out = []
    for op, rows in by_op.items():
        rows = [r for r in rows if r.get("procgroup") and r.get("mpi")]
        if not rows:
            continue
        small = rows[0]
        pg, raw = _med(small["procgroup"]), _med(small["mpi"])
        if pg is not None and raw is not None and (small["bytes"] <= 4 or op == "barrier"):
            added = (pg - raw) * 1e6
            out.append(
                {
                    "target": f"{op} {_size(small['bytes'], op)}: <= {MPI_ADDED_US:.0f} us over raw mpi4py",
                    "limit": MPI_ADDED_US,
                    "value_us": added,
                    "ratio": pg / raw if raw else None,
                    "status": "met" if added <= MPI_ADDED_US else "missed",
                }
            )
        big = [r for r in rows if r["bytes"] == 64 << 20]
        if big:
            pg, raw = _med(big[0]["procgroup"]), _med(big[0]["mpi"])
            if pg and raw:
                out.append(
                    {
                        "target": f"{op} 64M: >= {MPI_BW_FRACTION:.2f}x raw mpi4py bandwidth",
                        "limit": 1 / MPI_BW_FRACTION,
                        "ratio": pg / raw,
                        "ratio_rounds": big[0].get("ratio_mpi_rounds"),
                        "status": "met" if raw / pg >= MPI_BW_FRACTION else "missed",
                    }
                )
    return out


def format_targets(verdicts: Iterable[dict]) -> str:
    lines = []
    for v in verdicts:
        if "value_us" in v:
            val = f"{v['value_us']:+.1f} us"
        elif "ratio" in v:
            val = "-" if v["ratio"] is None else f"{v['ratio']:.3f}x"
            if v.get("ratio_rounds") and len(v["ratio_rounds"]) > 1:
                val += f" (rounds {min(v['ratio_rounds']):.3f}-{max(v['ratio_rounds']):.3f})"
        else:
            val = f"{v['value_s']:.3f} s"
        lines.append(f"  {v['status'].upper():>12}  {v['target']:<46} measured {val}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plot


def plot(
    by_op: dict[str, list[dict]],
    systems: Sequence[str],
    n: int,
    path: str,
    startup: Optional[dict] = None,
    title: str = "",
) -> Optional[str]:
    """Write a PNG (latency and busbw vs size, log-log, one line per system); returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return "matplotlib is not installed, so no plot was drawn (pip install matplotlib)"
    sized = [op for op in by_op if op != "barrier"]
    panels = 2 * len(sized) + (1 if "barrier" in by_op else 0) + (1 if startup else 0)
    ncols = 4
    nrows = max(1, math.ceil(panels / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    colors = {"procgroup": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green", "cpu": "tab:purple"}
    i = 0
    for op in sized:
        rows = by_op[op]
        for metric, label in (("median_s", "median latency (us)"), ("busbw_GBps", "busbw (GB/s)")):
            ax = flat[i]
            i += 1
            for s in systems:
                pts = [
                    (r["bytes"], r[s][metric] * (1e6 if metric == "median_s" else 1.0))
                    for r in rows
                    if r.get(s) and metric in r[s] and r[s][metric] > 0
                ]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", ms=3, label=LABEL[s], color=colors.get(s))
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(LogLocator(base=4))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_size(int(round(v))) if v >= 1 else ""))
            ax.set_yscale("log")
            ax.set_title(f"{op}: {label.split(' (')[0]}", fontsize=9)
            ax.set_xlabel("bytes per rank", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    bars = []
    if "barrier" in by_op:
        row = by_op["barrier"][0]
        bars.append(
            (
                "barrier median (us)",
                [(LABEL[s], row[s]["median_s"] * 1e6) for s in systems if row.get(s) and "median_s" in row[s]],
            )
        )
    if startup:
        bars.append(
            (
                f"startup, N={startup.get('nproc')} (s)",
                [
                    (LABEL.get(s, s), v["median_s"])
                    for s, v in startup.items()
                    if isinstance(v, dict) and v.get("median_s") is not None
                ],
            )
        )
    for label, data in bars:
        ax = flat[i]
        i += 1
        if data:
            names, vals = zip(*data)
            ax.bar(names, vals, color=[colors.get(k.lower() if k != "MPI" else "mpi", "grey") for k in names])
            ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    for ax in flat[i:]:
        ax.axis("off")
    fig.suptitle(title or f"procgroup bench, N={n}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
