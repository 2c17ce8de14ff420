"""Summaries, the markdown report and the verdict."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from .common import MPI_CONFIGS


def fmt_size(n: int) -> str:
    from procgroup.bench.cases import fmt_size as f

    return f(n)


def summarize(runs: List[dict], systems: List[str], sizes: List[int], n: int, op: str = "all_reduce") -> dict:
    from procgroup.bench.cases import busbw_factor
    from procgroup.bench.report import combine_rounds

    by_sys: Dict[str, List[dict]] = {s: [] for s in systems}
    for r in runs:
        by_sys.setdefault(r["system"], []).extend(r["records"])
    combined = {s: {int(c["bytes"]): c for c in combine_rounds(recs) if "bytes" in c} for s, recs in by_sys.items()}
    per_round: Dict[tuple, dict] = {}
    for r in runs:
        for rec in r["records"]:
            per_round[(r["system"], r["round"], int(rec.get("bytes", 0)))] = rec
    nrounds = 1 + max((r["round"] for r in runs), default=0)
    rows = []
    for s in sizes:
        pg = combined.get("procgroup", {}).get(s)
        for other in systems[1:]:
            o = combined.get(other, {}).get(s)
            ratios = []
            for k in range(nrounds):
                a, b = per_round.get(("procgroup", k, s)), per_round.get((other, k, s))
                if a and b and "median_s" in a and "median_s" in b:
                    ratios.append(a["median_s"] / b["median_s"])
            rows.append(
                {
                    "bytes": s,
                    "other": other,
                    "procgroup_median_s": pg.get("median_s") if pg else None,
                    "other_median_s": o.get("median_s") if o else None,
                    "ratio_of_medians": (pg["median_s"] / o["median_s"])
                    if pg and o and "median_s" in pg and "median_s" in o
                    else None,
                    "ratio_rounds": ratios,
                    "ratio_median_of_rounds": statistics.median(ratios) if ratios else None,
                }
            )
    return {
        "combined": {s: list(v.values()) for s, v in combined.items()},
        "ratios": rows,
        "busbw_factor": busbw_factor(op, n),
    }


def _ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    ms = v * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def _cell(rec: Optional[dict]) -> str:
    if rec is None:
        return "-"
    if "error" in rec:
        return "FAILED"
    return f"{_ms(rec['median_s'])} ({_ms(rec['p90_s'])})"


def markdown(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    systems, sizes = cfg["systems"], cfg["sizes"]
    src = m.get("procgroup_source", {})
    n = cfg["world_size"]
    op = cfg.get("op_name", "all_reduce")
    from procgroup.bench.cases import busbw_factor

    lines = [
        f"### {op} across {cfg['hosts']} hosts x {cfg['per_host']} ranks: procgroup vs Open MPI over TCP",
        "",
        f"`{' '.join(result['argv'])}`, {result['created']}; hosts {', '.join(cfg['host_names'])} "
        f"(network namespaces on one {m['cpu_count']}-CPU machine, {m['cpu_model']}); "
        f"procgroup {m['procgroup']} at {src.get('git_commit', '?')[:10]}"
        f"{' + uncommitted changes in ' + ', '.join(src['git_uncommitted']) if src.get('git_uncommitted') else ''}; "
        f"Python {m['python']}, numpy {m['numpy']}, mpi4py {m['mpi4py']}, {m['mpirun']}.",
        "",
        f"float32 SUM, {cfg['iters']} timed iterations after {cfg['warmup']} warm-up per run; time = slowest "
        f"rank per iteration, median (p90) in ms; result checked against the closed form on every rank; "
        f"busbw = algbw x {busbw_factor(op, n):.3f} (nccl-tests' factor for {op})"
        f"{'; sendrecv: one way, half a ping-pong between ranks 0 and 1' if op == 'sendrecv' else ''}.  "
        f"procgroup: {cfg['procgroup_launch']}.  "
        f"Open MPI: {cfg['mpi_launch']}",
        "",
    ]
    for c in cfg.get("mpi_configs", []):
        lines.append(
            f"* `mpi-{c}`: {MPI_CONFIGS[c]['about']}; extra MCA: "
            f"{' '.join(f'{k}={v}' for k, v in MPI_CONFIGS[c]['mca']) or '(none)'}"
        )
    if cfg.get("pg_force"):
        lines.append(f"* procgroup algorithms pinned (experiment): select.FORCE {cfg['pg_force']}")
    for v, spec in (cfg.get("pg_variants") or {}).items():
        lines.append(f"* `procgroup-{v}` (experiment): procgroup with select.FORCE {spec}")
    if cfg.get("mpi_mca"):
        lines.append(f"* extra MCA on every MPI run: {' '.join(cfg['mpi_mca'])}")
    lines += ["", "#### per round", ""]
    head = "| round | size | order | loadavg 1/5/15 at round start* | other users' CPU** |"
    sep = "|---:|---:|---|---|---:|"
    for s in systems:
        head += f" {s} ms |"
        sep += "---:|"
    for s in systems[1:]:
        head += f" ratio vs {s} |"
        sep += "---:|"
    lines += [head, sep]
    by = {(r["system"], r["round"]): r for r in result["runs"]}
    for rnd in range(cfg["repeat"]):
        order = result["round_order"][rnd]
        first = by.get((order[0], rnd), {})
        la = first.get("loadavg_before") or []
        bgs = [by[(s, rnd)].get("background_cpu") for s in systems if (s, rnd) in by]
        bgs = [b for b in bgs if b is not None]
        for size in sizes:
            recs = {
                s: next((x for x in by.get((s, rnd), {}).get("records", []) if x.get("bytes") == size), None)
                for s in systems
            }
            row = (
                f"| {rnd} | {fmt_size(size)} | {'pg first' if order[0] == 'procgroup' else 'MPI first'} | "
                f"{'/'.join(f'{x:.2f}' for x in la)} | "
                f"{'-' if not bgs else f'{100 * min(bgs):.0f}-{100 * max(bgs):.0f}%'} |"
            )
            for s in systems:
                row += f" {_cell(recs[s]) if (s, rnd) in by and by[(s, rnd)]['status'] == 'ok' else 'FAILED'} |"
            for s in systems[1:]:
                a, b = recs.get("procgroup"), recs.get(s)
                ok = a and b and "median_s" in a and "median_s" in b
                row += f" {a['median_s'] / b['median_s']:.2f} |" if ok else " - |"
            lines.append(row)
    lines += [
        "",
        "\\* /proc/loadavg counts runnable threads of everyone, this benchmark's own ranks and launchers "
        "included (the 1-minute average still carries the previous run).  \\*\\* the share of the CPUs "
        "that processes outside the benchmark took during each system's run (min-max over the round's "
        "runs): /proc/stat busy time minus the CPU time of every process in the hosts' namespaces.",
        "",
        f"#### median over {cfg['repeat']} round(s)",
        "",
        "| system | size | median ms | p90 ms | algbw GB/s | busbw GB/s | procgroup / this (per-round range) "
        "| CPU ms per call, all ranks |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    cpu_by = {}
    for r in result["runs"]:
        if r.get("cpu"):
            cpu_by.setdefault(r["system"], []).append(r["cpu"]["cpu_ms_per_call_all_ranks"])
    comb = result["summary"]["combined"]
    for size in sizes:
        for s in systems:
            rec = next((x for x in comb.get(s, []) if x.get("bytes") == size), None)
            if rec is None or "median_s" not in rec:
                lines.append(f"| {s} | {fmt_size(size)} | FAILED | | | | | |")
                continue
            rr = next((x for x in result["summary"]["ratios"] if x["bytes"] == size and x["other"] == s), None)
            ratio = "-"
            if rr and rr["ratio_of_medians"] is not None:
                ratio = f"{rr['ratio_of_medians']:.2f}"
                if rr["ratio_rounds"]:
                    ratio += f" ({min(rr['ratio_rounds']):.2f}-{max(rr['ratio_rounds']):.2f})"
            cpu = (
                f"{statistics.median(cpu_by[s]):.0f}"
                if len(sizes) == 1 and cpu_by.get(s)
                else ("(all sizes)" if cpu_by.get(s) else "-")
            )
            lines.append(
                f"| {s} | {fmt_size(size)} | {_ms(rec['median_s'])} | {_ms(rec['p90_s'])} | "
                f"{rec['algbw_GBps']:.3f} | {rec['busbw_GBps']:.3f} | {ratio} | {cpu} |"
            )
    if result.get("verdict"):
        lines += ["", f"**Target** ({result['verdict']['target']}): {result['verdict']['text']}"]
    pg_hdr = result.get("procgroup_header") or {}
    if pg_hdr.get("algorithm"):
        lines += [
            "",
            "procgroup's algorithm choices (rank 0, from select.choose_*): "
            + "; ".join(f"{fmt_size(int(k))}: {' / '.join(v)}" for k, v in pg_hdr["algorithm"].items() if k.isdigit()),
        ]
    if pg_hdr.get("peer_transports"):
        pt = pg_hdr["peer_transports"]
        lines.append(
            "procgroup's transports (rank: peers): "
            + "; ".join(f"{r}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for r, d in enumerate(pt))
        )
    for r in result["runs"]:
        if r.get("stage_times"):
            st = r["stage_times"]
            lines.append(
                f"{r['system']} stage times, round {r['round']} (mean ms per call by rank 0..{n - 1}): "
                + "; ".join(
                    f"{k.replace('choose_', '')} [{v['algorithm_rank0']}]: "
                    + " ".join("-" if x is None else f"{x:.1f}" for x in v["mean_ms_per_call_by_rank"])
                    for k, v in st.items()
                )
            )
    for r in result["runs"]:
        for size, row in (r.get("ab") or {}).items():
            lines.append(
                f"{r['system']} A/B in one run (--pg-ab), round {r['round']}, {fmt_size(int(size))}: "
                + "; ".join(
                    f"{name} {v['median_ms']:.3f} ms, x{v['ratio_vs_default']:.2f} of default (median per-call ratio), "
                    f"CPU {v['cpu_ms_per_call_all_ranks']:.2f} ms/call all ranks"
                    + (f" [{v['spec']}]" if v["spec"] else "")
                    for name, v in row.items()
                )
            )
    td = result.get("teardown", {})
    lines += [
        "",
        f"Teardown: {len(td.get('processes_stopped', []))} process(es) had to be stopped, "
        f"{len(td.get('shm_removed', []))} /dev/shm segment(s) removed; left: processes "
        f"{len(td.get('processes_left', []))}, namespaces {len(td.get('namespaces_left', []))}, "
        f"segments {len(td.get('shm_left', []))}.",
    ]
    for note in result.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n".join(lines) + "\n"


def verdict(result: dict) -> Optional[dict]:
    """The issue's target at 64 MiB: procgroup time <= Open MPI's (ratio <= 1), against each MPI variant."""
    target = 64 << 20
    if result["config"].get("op_name", "all_reduce") != "all_reduce" or result["config"].get("world_size") != 6:
        return None
    rows = [r for r in result["summary"]["ratios"] if r["bytes"] == target and r["ratio_of_medians"] is not None]
    if not rows:
        return None
    parts = []
    runs = {(x["system"], x["round"]): x for x in result["runs"]}
    for r in rows:
        if not r["other"].startswith("mpi"):
            continue
        ok = r["ratio_of_medians"] <= 1.0  # median over rounds of each system's median
        rng = f" (rounds {min(r['ratio_rounds']):.2f}-{max(r['ratio_rounds']):.2f})" if r["ratio_rounds"] else ""
        # the round in which the other users' load was lowest for both runs: the fairest single comparison
        calm = []
        for k in range(result["config"]["repeat"]):
            a, b = runs.get(("procgroup", k)), runs.get((r["other"], k))
            if (
                a
                and b
                and a["status"] == b["status"] == "ok"
                and a.get("background_cpu") is not None
                and b.get("background_cpu") is not None
            ):
                ra = next((x for x in a["records"] if x.get("bytes") == target), None)
                rb = next((x for x in b["records"] if x.get("bytes") == target), None)
                if ra and rb:
                    calm.append((max(a["background_cpu"], b["background_cpu"]), k, ra["median_s"] / rb["median_s"]))
        least = ""
        if calm:
            bg, k, ratio = min(calm)
            r["least_loaded_round"] = {"round": k, "others_cpu_max": bg, "ratio": ratio}
            least = f"; least-loaded round ({k}, others' CPU <= {100 * bg:.0f}%): {ratio:.2f}x"
        calm_ok = r.get("least_loaded_round", {}).get("ratio", r["ratio_of_medians"]) <= 1.0
        word = "met" if ok and calm_ok else ("borderline" if ok or calm_ok else "MISSED")
        r["status"] = word
        parts.append(f"vs {r['other']}: {r['ratio_of_medians']:.2f}x{rng}{least} -> {word}")
    return {
        "target": "64 MiB all_reduce, 3 hosts x 2 ranks, procgroup time <= Open MPI over TCP",
        "text": "; ".join(parts),
        "rows": rows,
    }


def finish_report(result: dict) -> str:
    """Fill in the summary, the headers and the verdict of ``result``; returns the markdown."""
    cfg = result["config"]
    result["summary"] = summarize(
        result["runs"], cfg["systems"], cfg["sizes"], cfg["world_size"], cfg.get("op_name", "all_reduce")
    )
    result["procgroup_header"] = next(
        (r["header"] for r in result["runs"] if r["system"] == "procgroup" and r["header"]), None
    )
    result["mpi_headers"] = {
        r["system"]: r["header"] for r in result["runs"] if r["system"].startswith("mpi") and r["header"]
    }
    result["verdict"] = verdict(result)
    # every record that has a time passed the closed-form check on every rank
    result["all_checked"] = all(rec.get("checked") for r in result["runs"] for rec in r["records"])
    return markdown(result)


def render(path: Path) -> int:
    result = json.loads(path.read_text())
    md = finish_report(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(md)
    print(md, flush=True)
    return 0


# ===================================================================================== main
