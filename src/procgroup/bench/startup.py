"""``procgroup bench --startup``: the wall time of launching N processes that init, pass a barrier and exit."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from . import report
from ._env import child_env, mpirun_cmd
from ._load import BackgroundMeter

__all__ = ["STARTUP_SCRIPTS", "measure_startup", "format_startup"]


STARTUP_SCRIPTS = {
    "procgroup": "import procgroup as dist\ndist.init_process_group()\ndist.barrier()\ndist.destroy_process_group()\n",
    "gloo": (
        "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
        "dist.destroy_process_group()\n"
    ),
    "mpi": "from mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n",
}


def measure_startup(n: int, runs: int, systems: Sequence[str], workdir: Path, quiet: bool) -> dict:
    """Wall time of launching n processes that init, pass a barrier and exit (1 warm-up run, then ``runs``)."""
    res: dict = {"nproc": n, "runs": runs}
    for s in systems:
        script = workdir / f"startup_{s}.py"
        script.write_text(STARTUP_SCRIPTS[s])
        if s == "procgroup":
            cmd = [sys.executable, "-m", "procgroup", "run", "--standalone", "--nproc-per-node", str(n), str(script)]
            what = f"procgroup run --standalone --nproc-per-node {n}"
        elif s == "gloo":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(n),
                str(script),
            ]
            what = f"torchrun --standalone --nproc-per-node {n}"
        else:
            cmd = mpirun_cmd(n) + [sys.executable, str(script)]
            what = f"mpirun -np {n}"
        times, err = [], None
        meter = BackgroundMeter()
        for i in range(runs + 1):
            t0 = time.perf_counter()
            r = subprocess.run(
                cmd, capture_output=True, text=True, env=child_env(), timeout=300, stdin=subprocess.DEVNULL
            )
            dt = time.perf_counter() - t0
            if r.returncode != 0:
                err = f"exit code {r.returncode}: {(r.stdout + r.stderr)[-1500:]}"
                break
            if i > 0:  # the first run warms the page cache
                times.append(dt)
        entry = {"command": what, "times_s": times, "background_cpu": meter.fraction()}
        if err:
            entry["error"] = err
        if times:
            entry["median_s"] = statistics.median(times)
            entry["min_s"] = min(times)
        res[s] = entry
        if not quiet:
            msg = f"{entry['median_s']:.3f} s median of {len(times)}" if times else f"FAILED {err}"
            sys.stderr.write(f"procgroup bench: startup {what}: {msg}\n")
    return res


def format_startup(st: dict) -> str:
    """The startup measurement as text lines, one per system."""
    lines = [
        f"startup: launch {st['nproc']} processes that init, pass a barrier and exit "
        f"(wall time, median of {st['runs']} after 1 warm-up)"
    ]
    for s in report.SYSTEMS:
        e = st.get(s)
        if not e:
            continue
        v = f"{e['median_s']:.3f} s  (min {e['min_s']:.3f} s)" if "median_s" in e else f"FAILED: {e.get('error')}"
        if e.get("background_cpu") is not None:
            v += f"  [other users' CPU load {100 * e['background_cpu']:.0f}%]"
        lines.append(f"  {e['command']:<45} {v}")
    return "\n".join(lines)
