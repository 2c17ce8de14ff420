"""``procgroup bench``: measure procgroup's collectives on this machine, optionally beside gloo and MPI.

The command starts the worker processes itself, one run per system, each
through its own launcher:

* procgroup: ``python -m procgroup run --standalone --nproc-per-node N -m procgroup.bench.worker``
* gloo:      the same launcher, ``-m procgroup.bench.torch_worker`` (torch.distributed, backend gloo)
* MPI:       ``mpirun --allow-run-as-root --oversubscribe -np N python -m procgroup.bench.mpi_worker`` (mpi4py)

``--backend mpi`` measures procgroup on its mpi backend instead, started by the same ``mpirun`` as the raw
mpi4py worker; ``--compare cpu`` then adds procgroup's cpu backend (``procgroup run``) as a column, so
``procgroup bench --backend mpi --compare cpu,mpi`` puts the cpu backend, the mpi backend and raw mpi4py
side by side (ratios: mpi backend / other).

Every system runs the same cases (:mod:`procgroup.bench.cases`); rank 0 of
each run appends one JSON line per case to a file this process follows to
show progress.  The runs are sequential, never concurrent.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from . import report
from ._env import PKG_PARENT, child_env, mpirun_cmd
from ._load import BackgroundMeter, busy_fraction
from .cases import DEFAULT_MAX_BYTES, DEFAULT_MIN_BYTES, OPS, fmt_size, parse_size, sizes_between
from .startup import format_startup, measure_startup

__all__ = ["main", "build_parser"]

COMPARE = ("gloo", "mpi", "cpu")
BACKENDS = ("cpu", "mpi")

EPILOG = """\
examples:
  procgroup bench --nproc 4                                  every op, 4 B .. 64 MiB, procgroup only
  procgroup bench --nproc 2 --compare gloo,mpi --json r.json --plot r.png --markdown r.md
  procgroup bench --nproc 4 --ops all_reduce,barrier --max-bytes 1M --iters 50
  procgroup bench --nproc 2 --backend mpi --compare cpu,mpi  procgroup on MPI vs its cpu backend vs raw mpi4py
  procgroup bench --startup                                  wall time of a 4-process init + barrier job
  procgroup bench --store-clients 4096                       one StoreServer, 4096 clients rendezvous

Time per case is the median (and p90) over iterations of the slowest rank's
iteration time; ratio = procgroup median / other median (< 1: procgroup faster).
busbw follows nccl-tests: all_reduce x 2(n-1)/n; all_gather, reduce_scatter,
all_to_all x (n-1)/n; broadcast, reduce, sendrecv x 1.  Every case's result is
checked against its closed form before it is timed.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="procgroup bench",
        description="Measure procgroup's collectives on this machine, optionally beside gloo and MPI.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="world size: processes on this machine (default 2)")
    p.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(OPS)} (default all)")
    p.add_argument("--min-bytes", default=str(DEFAULT_MIN_BYTES), help="smallest size, e.g. 4, 1K (default 4)")
    p.add_argument(
        "--sizes",
        default=None,
        help="only these sizes of the series 4, 16, 64, ..., e.g. 4,64K,1M,64M (overrides the range)",
    )
    p.add_argument("--max-bytes", default=fmt_size(DEFAULT_MAX_BYTES), help="largest size, e.g. 1K, 64M (default 64M)")
    p.add_argument(
        "--iters",
        default="auto",
        help="timed iterations per case, or 'auto' "
        "(200 for small sizes down to 20 at 64 MiB, and at most about 1.5 s per case)",
    )
    p.add_argument(
        "--compare",
        default="",
        help="also run the same cases through: gloo (torch.distributed), mpi (mpi4py + mpirun), "
        "cpu (procgroup's cpu backend, with --backend mpi)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="cpu",
        help="procgroup's backend under test: cpu (procgroup run, default) or mpi (mpirun, mpi4py)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default="auto",
        help="procgroup's transport (PROCGROUP_TRANSPORT), default auto; tcp: mpi runs over its tcp btl too",
    )
    p.add_argument("--json", metavar="PATH", help="write every number, the configuration and machine info here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (latency and busbw vs size; needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as markdown")
    p.add_argument(
        "--startup",
        action="store_true",
        help="measure the wall time of `procgroup run` of an init + barrier script (with --compare: "
        "torchrun and mpirun of the equivalent too)",
    )
    p.add_argument("--startup-nproc", type=int, default=4, help="processes for --startup (default 4)")
    p.add_argument(
        "--startup-runs", type=int, default=5, help="timed runs for --startup; the median is reported (default 5)"
    )
    p.add_argument(
        "--store-clients",
        type=int,
        default=0,
        metavar="N",
        help="also measure a store rendezvous of N TCPStore clients against one StoreServer",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="run the collective sweep even with --startup/--store-clients (it is skipped when those "
        "are given without --ops)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="profile every rank of every system with cProfile into DIR (slows the Python parts: "
        "use for where the time goes, not for the numbers)",
    )
    p.add_argument(
        "--calm",
        type=float,
        default=None,
        metavar="FRACTION",
        help="on a shared machine: before each run wait until the CPUs are at most this busy "
        "(e.g. 0.15), for up to --calm-wait seconds",
    )
    p.add_argument("--calm-wait", type=float, default=120.0, metavar="SECONDS", help="see --calm (default 120)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="R",
        help="run the sweep R times (rounds interleaved); report the median over rounds of each "
        "case's median, and each ratio's range over rounds (default 1)",
    )
    p.add_argument(
        "--no-interleave",
        action="store_true",
        help="with --compare: run each system's whole sweep in one go (default: systems take turns op by op)",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one system's whole run may take (default 1800)"
    )
    p.add_argument("--quiet", action="store_true", help="no per-case progress lines")
    return p


# ----------------------------------------------------------------------------- environment


def _version_of(mod: str) -> Optional[str]:
    if importlib.util.find_spec(mod) is None:
        return None
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001
        return "?"


def machine_info() -> dict:
    import numpy as np

    from .. import __version__, procfs

    cpu_model = procfs.cpu_model()
    mem = procfs.mem_total_gib()
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "procgroup": __version__,
        "torch": _version_of("torch"),
        "mpi4py": _version_of("mpi4py"),
        "mpirun": None,
        "loadavg_start": list(os.getloadavg()),
    }
    info["procgroup_source"] = _source_state()
    mpirun = shutil.which("mpirun")
    if mpirun:
        try:
            out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20).stdout
            info["mpirun"] = out.strip().splitlines()[0] if out.strip() else mpirun
        except (OSError, subprocess.SubprocessError):
            info["mpirun"] = mpirun
    return info


def _source_state() -> dict:
    """Where the measured procgroup came from: its path and, in a git checkout, the commit and local edits."""
    st: dict = {"path": PKG_PARENT}
    git = shutil.which("git")
    if git is None:
        return st
    try:
        head = subprocess.run([git, "rev-parse", "HEAD"], cwd=PKG_PARENT, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return st
        st["git_commit"] = head.stdout.strip()
        dirty = subprocess.run(
            [git, "status", "--porcelain", "--", "."], cwd=PKG_PARENT, capture_output=True, text=True, timeout=10
        )
        st["git_uncommitted"] = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return st


def mpi_unavailable() -> Optional[str]:
    """Why the MPI comparison cannot run (None when it can)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (MPICC=mpicc pip install mpi4py, against Open MPI)"
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"mpirun --version failed: {e}"
    if "Open MPI" not in out:
        version = out.strip().splitlines()[0] if out.strip() else "no version"
        return f"mpirun is not Open MPI ({version}); the comparison needs Open MPI's mpirun"
    return None


# ----------------------------------------------------------------------------- running one system


def _commands(system: str, n: int, worker_args: list[str], backend: str = "cpu") -> list[str]:
    """The command line of one system's run (``backend``: procgroup's backend under test)."""
    if system == "mpi" or (system == "procgroup" and backend == "mpi"):
        if system == "mpi":
            worker = [sys.executable, "-m", "procgroup.bench.mpi_worker", *worker_args]
        else:
            worker = [sys.executable, "-m", "procgroup.bench.worker", "--backend", "mpi", *worker_args]
        return mpirun_cmd(n, "OMP_NUM_THREADS", "PYTHONUNBUFFERED") + worker
    if system == "gloo":
        mod, extra = "procgroup.bench.torch_worker", []
    else:  # procgroup on the cpu backend: the system under test, or the "cpu" column beside the mpi backend
        mod, extra = "procgroup.bench.worker", ([] if system == "procgroup" else ["--name", system])
    return [
        sys.executable,
        "-m",
        "procgroup",
        "run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        mod,
        *extra,
        *worker_args,
    ]


def _progress(rec: dict) -> str:
    head = f"  [{rec['system']:>9}] {rec['op']:<15}"
    size = "" if rec["op"] == "barrier" else fmt_size(rec.get("bytes", rec.get("nominal_bytes", 0)))
    head += f"{size:>5}  "
    if rec.get("skipped"):
        return head + f"skipped: {rec['skipped']}"
    if "error" in rec:
        return head + f"FAILED: {rec['error']}"
    return head + f"median {rec['median_s'] * 1e6:10.1f} us  p90 {rec['p90_s'] * 1e6:10.1f} us  ({rec['iters']} iters)"


def _merge_run(acc: dict, r: dict) -> None:
    """Fold one run of a system (one op group) into that system's summary."""
    if not acc:
        acc.update({"status": "ok", "records": [], "header": r.get("header"), "runs": []})
    acc["records"].extend(r["records"])
    acc["header"] = acc["header"] or r.get("header")
    run = {k: v for k, v in r.items() if k not in ("records", "header", "status")}
    run["status"] = r["status"]
    acc["runs"].append(run)
    acc["wall_s"] = acc.get("wall_s", 0.0) + r.get("wall_s", 0.0)
    if r["status"] != "ok":
        acc["status"] = "failed"
        acc.setdefault("error", r.get("error"))


# ----------------------------------------------------------------------------- the machine's other load


def wait_calm(threshold: float, max_wait: float, quiet: bool) -> dict:
    """Wait (up to ``max_wait`` s) until the machine's CPU use over 1 s is at most ``threshold``."""
    t0 = time.monotonic()
    b = busy_fraction()
    while b is not None and b > threshold and time.monotonic() - t0 < max_wait:
        if not quiet:
            sys.stderr.write(
                f"procgroup bench: the machine is {100 * b:.0f}% busy; waiting for <= "
                f"{100 * threshold:.0f}% (--calm) ...\n"
            )
        b = busy_fraction(2.0)
    return {"busy_at_start": b, "waited_s": round(time.monotonic() - t0, 1)}


def run_system(
    system: str,
    n: int,
    worker_args: list[str],
    workdir: Path,
    env_extra: dict,
    timeout: float,
    quiet: bool,
    tag: str = "",
    calm: Optional[tuple[float, float]] = None,
    backend: str = "cpu",
) -> dict:
    """Run one system's sweep; returns {"status", "records", "header", "wall_s", "command", ...}."""
    out = workdir / f"{tag or system}.jsonl"
    log = workdir / f"{tag or system}.log"
    cmd = _commands(system, n, ["--out", str(out), *worker_args], backend)
    env = child_env(env_extra)
    info: dict = {
        "command": cmd,
        "status": "failed",
        "records": [],
        "header": None,
        "loadavg_before": list(os.getloadavg()),
    }
    if calm is not None:
        info["calm"] = wait_calm(calm[0], calm[1], quiet)
    if not quiet:
        sys.stderr.write(f"procgroup bench: running {system} at N={n} (ops {worker_args[1]})\n")
    meter = BackgroundMeter()
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        seen = 0
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    rc = None
                seen = _follow(out, seen, info, quiet)
                if rc is not None:
                    break
                if time.monotonic() - t0 > timeout:
                    _kill(proc)
                    info["error"] = f"did not finish within {timeout:.0f}s (--timeout); killed"
                    break
        except KeyboardInterrupt:
            _kill(proc)
            raise
    info["wall_s"] = time.monotonic() - t0
    info["background_cpu"] = meter.fraction()
    info["returncode"] = proc.returncode
    info["loadavg_after"] = list(os.getloadavg())
    ended = any(r.get("kind") == "end" for r in info.pop("_all", []))
    if proc.returncode == 0 and ended:
        info["status"] = "ok"
    else:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        info.setdefault("error", f"exit code {proc.returncode}")
        info["log_tail"] = tail
        sys.stderr.write(f"procgroup bench: {system} run failed ({info['error']}); last output:\n{tail}\n")
    return info


def _follow(path: Path, seen: int, info: dict, quiet: bool) -> int:
    if not path.exists():
        return seen
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    complete = lines if text.endswith("\n") else lines[:-1]
    for line in complete[seen:]:
        rec = json.loads(line)
        info.setdefault("_all", []).append(rec)
        if rec.get("kind") == "header":
            info["header"] = rec
        elif rec.get("kind") == "case":
            rec.pop("kind", None)
            info["records"].append(rec)
            if not quiet:
                sys.stderr.write(_progress(rec) + "\n")
    return len(complete)


def _kill(proc: subprocess.Popen) -> None:
    """Stop the run we started: its own session, TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- main


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.nproc < 1:
        p.error("--nproc must be >= 1")
    if ns.repeat < 1:
        p.error("--repeat must be >= 1")
    ops = OPS if ns.ops is None else tuple(o.strip() for o in ns.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        p.error(f"--ops: unknown op(s) {bad}; choose from {','.join(OPS)}")
    try:
        lo, hi = parse_size(ns.min_bytes), parse_size(ns.max_bytes)
    except ValueError as e:
        p.error(str(e))
    if ns.iters != "auto":
        try:
            if int(ns.iters) < 1:
                raise ValueError
        except ValueError:
            p.error(f"--iters {ns.iters!r}: give a positive number or 'auto'")
    compare = [c.strip() for c in ns.compare.split(",") if c.strip()]
    bad = [c for c in compare if c not in COMPARE]
    if bad:
        p.error(f"--compare: unknown system(s) {bad}; choose from {','.join(COMPARE)}")
    if "cpu" in compare and ns.backend == "cpu":
        p.error("--compare cpu compares the cpu backend with another one: pass --backend mpi too")
    sizes = sizes_between(lo, hi)
    if ns.sizes:
        try:
            sizes = sorted({parse_size(x) for x in ns.sizes.split(",") if x.strip()})
        except ValueError as e:
            p.error(f"--sizes: {e}")
        series = sizes_between(4, max(sizes))
        if any(x not in series for x in sizes):
            p.error(f"--sizes: every size must be one of the series 4, 16, 64, ... (got {ns.sizes})")
    sweep = ns.sweep or ns.ops is not None or not (ns.startup or ns.store_clients)
    if sweep and not sizes and any(o != "barrier" for o in ops):
        p.error(f"no size of the series 4, 16, 64, ... lies in [{lo}, {hi}]")

    started = datetime.datetime.now(datetime.timezone.utc)
    t_all = time.monotonic()
    result: dict = {
        "tool": "procgroup bench",
        "created": started.isoformat(timespec="seconds"),
        "argv": ["procgroup", "bench", *(sys.argv[1:] if argv is None else argv)],
        "config": {
            "nproc": ns.nproc,
            "ops": list(ops),
            "sizes": sizes,
            "iters": ns.iters,
            "compare": compare,
            "transport": ns.transport,
            "backend": ns.backend,
            "dtype": "float32",
        },
        "machine": machine_info(),
        "notes": [],
    }
    systems = ["procgroup"]
    if ns.backend == "mpi":
        why = mpi_unavailable()
        if why:
            p.error(f"--backend mpi needs Open MPI's mpirun and mpi4py: {why}")
    for c in compare:
        why = None
        if c == "gloo" and importlib.util.find_spec("torch") is None:
            why = "torch is not installed (pip install torch): gloo comparison skipped"
        elif c == "mpi":
            why = mpi_unavailable()
            if why:
                why = f"{why}: MPI comparison skipped"
        if why:
            result["notes"].append(why)
            sys.stderr.write(f"procgroup bench: note: {why}\n")
        else:
            systems.append(c)
    result["config"]["systems"] = systems

    out_text: list[str] = []
    with tempfile.TemporaryDirectory(prefix="procgroup-bench-") as td:
        work = Path(td)
        if sweep:
            # with a comparison, the systems take turns op by op, so that a change in the machine's
            # background load hits all of them alike instead of one system's whole sweep
            interleave = len(systems) > 1 and not ns.no_interleave
            groups = [[op] for op in ops] if interleave else [list(ops)]
            result["config"]["interleaved"] = interleave
            result["config"]["repeat"] = ns.repeat
            runs: dict[str, dict] = {}
            for rnd in range(ns.repeat):
                for gi, group in enumerate(groups):
                    wargs = [
                        "--ops",
                        ",".join(group),
                        "--min-bytes",
                        str(lo),
                        *(["--sizes", ",".join(map(str, sizes))] if ns.sizes else []),
                        "--max-bytes",
                        str(hi),
                        "--iters",
                        ns.iters,
                    ]
                    if ns.profile:
                        wargs += ["--profile", os.path.abspath(ns.profile)]
                    for pos, s in enumerate(run_order(systems, rnd * len(groups) + gi)):
                        extra = {"PROCGROUP_TRANSPORT": ns.transport} if s in ("procgroup", "cpu") else {}
                        if s == "mpi" and ns.transport == "tcp":  # TCP against TCP: Open MPI's tcp btl, no vader
                            extra["OMPI_MCA_btl"] = "tcp,self"
                        r = run_system(
                            s,
                            ns.nproc,
                            wargs,
                            work,
                            extra,
                            ns.timeout,
                            ns.quiet,
                            tag=f"{s}-{rnd}-{gi}",
                            calm=(ns.calm, ns.calm_wait) if ns.calm is not None else None,
                            backend=ns.backend,
                        )
                        for rec in r["records"]:
                            rec["background_cpu"] = r.get("background_cpu")
                            rec["round"] = rnd
                            rec["position"] = pos
                        _merge_run(runs.setdefault(s, {}), r)
            result["systems"] = {s: {k: v for k, v in r.items() if k != "records"} for s, r in runs.items()}
            if ns.repeat > 1:
                result["rounds"] = {s: r["records"] for s, r in runs.items()}
                result["results"] = {s: report.combine_rounds(r["records"]) for s, r in runs.items()}
            else:
                result["results"] = {s: r["records"] for s, r in runs.items()}
            by_op = report.rows_by_op(result["results"])
            if ns.repeat > 1:
                report.add_round_ratios(by_op, result["rounds"], systems)
            result["table"] = report.compact_table(by_op, systems)
            out_text.append(report.console_tables(by_op, systems, ns.nproc))
        else:
            by_op = {}
        if ns.startup:
            st_sys = [s for s in systems]
            result["startup"] = measure_startup(ns.startup_nproc, ns.startup_runs, st_sys, work, ns.quiet)
            out_text.append(format_startup(result["startup"]))
        if ns.store_clients:
            from .store_scale import format_result, run_store_scale

            if not ns.quiet:
                sys.stderr.write(f"procgroup bench: store rendezvous of {ns.store_clients} clients\n")
            result["store_scale"] = run_store_scale(ns.store_clients)
            out_text.append(format_result(result["store_scale"]))
    if ns.backend == "mpi":
        verdicts = report.evaluate_mpi_backend_targets(by_op)
    else:
        verdicts = report.evaluate_targets(by_op, ns.nproc, result.get("startup"), result.get("store_scale"))
    result["targets"] = verdicts
    if verdicts:
        out_text.append(
            "targets (from the performance issue; ratios from this run):\n" + report.format_targets(verdicts)
        )
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.monotonic() - t_all
    out_text.append(
        f"machine: {result['machine']['cpu_count']} CPUs ({result['machine']['cpu_model']}), "
        f"load average at start {result['machine']['loadavg_start'][0]:.2f}, at end "
        f"{result['machine']['loadavg_end'][0]:.2f}; total wall time {result['wall_s']:.1f} s"
    )
    for note in result["notes"]:
        out_text.append(f"note: {note}")
    print("\n".join(out_text), flush=True)

    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if ns.markdown:
        Path(ns.markdown).write_text(_markdown(result, by_op, systems, ns.nproc), encoding="utf-8")
    if ns.plot:
        if by_op:
            note = report.plot(
                by_op,
                systems,
                ns.nproc,
                ns.plot,
                result.get("startup"),
                title=f"procgroup bench, N={ns.nproc}, {result['machine']['cpu_count']} CPUs",
            )
            if note:
                sys.stderr.write(f"procgroup bench: note: {note}\n")
        else:
            sys.stderr.write("procgroup bench: note: no collective sweep ran, so there is nothing to plot\n")
    failed = [s for s, r in result.get("systems", {}).items() if r["status"] != "ok"]
    errors = [rec for recs in result.get("results", {}).values() for rec in recs if "error" in rec]
    pg_errors = [rec for rec in result.get("results", {}).get("procgroup", []) if "error" in rec]
    if errors and not ns.quiet:
        sys.stderr.write(f"procgroup bench: {len(errors)} case(s) failed their check or raised; see the tables\n")
    if "procgroup" in failed or pg_errors:
        return 1
    if result.get("store_scale") and not result["store_scale"].get("ok"):
        return 1
    return 0


def run_order(systems: Sequence[str], step: int) -> list[str]:
    """The order in which ``systems`` run the ``step``-th op group of a sweep (counted across rounds): every
    permutation in turn, so that over a cycle every system runs in every position and after every other one.

    A fixed order is biased where a run's conditions depend on the run before it: on a VM with free page
    reporting, the memory a finished run frees comes back slow for seconds (a 4 MiB broadcast measured 5x slower
    right after an Open MPI run than 10 s later), and procgroup always followed Open MPI.  A rotation would keep
    that: it keeps every system's predecessor.
    """
    perms = list(itertools.permutations(systems))
    return list(perms[step % len(perms)]) if perms else []


def _markdown(result: dict, by_op: dict, systems: Sequence[str], n: int) -> str:
    m = result["machine"]
    src = m.get("procgroup_source", {})
    commit = src.get("git_commit", "")[:10]
    lines = [
        f"### procgroup bench{f', N={n}' if by_op else ''}",
        "",
        f"`{' '.join(result['argv'])}` on {m['cpu_count']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB; "
        f"Python {m['python']}, numpy {m['numpy']}, torch {m['torch']}, mpi4py {m['mpi4py']}, {m['mpirun']}; "
        f"procgroup {m['procgroup']}{f' at {commit}' if commit else ''}"
        f"{' with uncommitted changes' if src.get('git_uncommitted') else ''}; "
        f"load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end; "
        f"{result['created']}.",
        "",
    ]
    if by_op:
        lines += [
            "Times in microseconds: median and p90 over iterations of the slowest rank's time; "
            "ratio = procgroup median / other median (< 1: procgroup faster); "
            "busbw in the nccl-tests convention; sendrecv is one-way (half a ping-pong).",
            "",
        ]
        lines.append(report.markdown(by_op, systems, n))
    if result.get("startup"):
        st = result["startup"]
        lines += [
            f"#### startup (N={st['nproc']}, median of {st['runs']})",
            "",
            "| command | median s | min s | other users' CPU load |",
            "|---|---:|---:|---:|",
        ]
        for s in report.SYSTEMS:
            e = st.get(s)
            if e and "median_s" in e:
                bg = e.get("background_cpu")
                lines.append(
                    f"| `{e['command']}` | {e['median_s']:.3f} | {e['min_s']:.3f} | "
                    f"{'-' if bg is None else f'{100 * bg:.0f}%'} |"
                )
        lines.append("")
    if result.get("store_scale"):
        from .store_scale import format_result

        lines += ["#### store rendezvous", "", format_result(result["store_scale"]), ""]
    if result.get("targets"):
        lines += ["#### targets", "", "| target | measured | status |", "|---|---:|---|"]
        for v in result["targets"]:
            if "value_us" in v:
                val = f"{v['value_us']:+.1f} us"
            else:
                val = ("-" if v["ratio"] is None else f"{v['ratio']:.3f}x") if "ratio" in v else f"{v['value_s']:.3f} s"
            if v.get("ratio_rounds") and len(v["ratio_rounds"]) > 1:
                val += f" (rounds {min(v['ratio_rounds']):.3f}-{max(v['ratio_rounds']):.3f})"
            lines.append(f"| {v['target']} | {val} | {v['status']} |")
        lines.append("")
    for note in result["notes"]:
        lines.append(f"Note: {note}")
    return "\n".join(lines) + "\n"
