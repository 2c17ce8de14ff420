"""The command line and the round loop."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from .common import BASE_MCA, DEFAULT_MPI_CONFIGS, DEFAULT_OUT, EPILOG, MPI_CONFIGS
from .infra import Infra, Terminated, _watchdog, log
from .procs import loadavg
from .report import finish_report, fmt_size, render
from .runner import Runner
from .worker import _worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/multihost.py",
        description="all_reduce across network-namespace hosts (default 3 hosts x 2 ranks): procgroup (procgroup run "
        "per node) vs Open MPI (mpirun, mpi4py) over TCP, interleaved rounds, JSON + markdown report.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        default="64M",
        help="comma-separated per-rank buffer sizes, e.g. 64M or 1M,16M,64M (binary units; default 64M)",
    )
    p.add_argument(
        "--op",
        default="all_reduce",
        choices=("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv"),
        help="the collective (default all_reduce; sendrecv = ping-pong between ranks 0 and 1, e.g. with "
        "--per-host 1 to measure one TCP hop)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size and run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per size and run (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; systems alternate who goes first (default 3)")
    p.add_argument(
        "--mpi-configs",
        default=DEFAULT_MPI_CONFIGS,
        help=f"Open MPI variants to time, comma-separated from {','.join(MPI_CONFIGS)}, or 'none' "
        f"(default {DEFAULT_MPI_CONFIGS})",
    )
    p.add_argument(
        "--mpi-mca", action="append", default=[], metavar="KEY=VALUE", help="extra --mca for every MPI run (repeatable)"
    )
    p.add_argument(
        "--transport",
        choices=("auto", "tcp"),
        default="auto",
        help="procgroup's PROCGROUP_TRANSPORT: auto = shm within a host, tcp across (default); tcp = tcp everywhere",
    )
    p.add_argument("--hosts", type=int, default=3, help="namespace hosts (default 3)")
    p.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument(
        "--prefix",
        default="pgb",
        help="host-name prefix: hosts PREFIX1..N (default pgb, private to this benchmark; 'h' = the test "
        "suite's h1..h3, taken under its lock /run/procgroup-infra.lock)",
    )
    p.add_argument(
        "--net", default=None, help="first three octets of the hosts' subnet (default 10.78.0; 10.77.0 for h)"
    )
    p.add_argument(
        "--state",
        default=None,
        help="infra state directory (default /run/procgroup-PREFIX-infra; /run/procgroup-infra for h)",
    )
    p.add_argument("--keep-hosts", action="store_true", help="leave hosts this run made up (a later run reuses them)")
    p.add_argument(
        "--no-lock",
        action="store_true",
        help="do not take the hosts' lock (the caller holds it, e.g. a pytest session)",
    )
    p.add_argument("--lock-wait", type=float, default=600.0, help="seconds to wait for the hosts' lock (default 600)")
    p.add_argument("--port", type=int, default=29500, help="procgroup's --master-port base (default 29500)")
    p.add_argument("--timeout", type=float, default=120.0, help="procgroup's collective/init timeout, s (default 120)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="wall-clock limit of one run, s (default 300)")
    p.add_argument(
        "--pg-force",
        default="",
        metavar="COLL=ALG,...",
        help="experiments: pin procgroup algorithms through procgroup.algorithms.select.FORCE in every rank, "
        "e.g. all_reduce=ring (flat ring over all ranks instead of the hierarchical all_reduce) or "
        "all_reduce=multileader; an upper-case name sets that integer threshold of select instead, e.g. "
        "INTER_DIRECT_SMALL=0",
    )
    p.add_argument(
        "--pg-variant",
        action="append",
        default=[],
        metavar="NAME=COLL=ALG[,COLL=ALG]",
        help="experiments: also time procgroup with these algorithms pinned, as system procgroup-NAME, in "
        "every round (repeatable), e.g. --pg-variant ml=all_reduce=multileader",
    )
    p.add_argument(
        "--pg-ab",
        action="store_true",
        help="experiments: time the --pg-variant settings inside the default procgroup run instead of in runs of "
        "their own, alternating with the default per iteration (each call after a barrier; time = slowest rank, "
        "CPU = all ranks and threads): load that drifts between runs cannot bias this comparison",
    )
    p.add_argument(
        "--pg-stage-times",
        action="store_true",
        help="experiments: time the stages of procgroup's all_reduce in every rank (intra-host reduce, "
        "inter-host all_reduce, intra-host broadcast) and report them",
    )
    p.add_argument(
        "--calm",
        type=float,
        default=None,
        metavar="FRACTION",
        help="before each round wait until the CPUs are at most this busy (e.g. 0.3), for up to "
        "--calm-wait s (the machine is shared)",
    )
    p.add_argument("--calm-wait", type=float, default=300.0, metavar="SECONDS", help="see --calm (default 300)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT), help=f"where JSON + markdown go (default {DEFAULT_OUT})")
    p.add_argument("--name", default=None, help="file name stem (default multihost-<UTC timestamp>)")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="only rewrite the markdown report (and the summary in the JSON) "
        "of an earlier run's JSON file; starts nothing, needs no root",
    )
    # internal modes
    p.add_argument("--worker", choices=("procgroup", "mpi"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--pg-ab-variants", default="", help=argparse.SUPPRESS)
    p.add_argument("--_watchdog", dest="watchdog", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.watchdog:
        return _watchdog(ns.watchdog)
    if ns.worker:
        return _worker(ns)
    if ns.render:
        return render(Path(ns.render))

    from procgroup.bench.cases import parse_size

    try:
        ns.size_list = [parse_size(s) for s in ns.sizes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    n = ns.hosts * ns.per_host
    if not ns.size_list or any(s < 4 for s in ns.size_list):
        p.error("--sizes: give sizes of at least 4 bytes (one float32)")
    if ns.iters < 1 or ns.warmup < 0 or ns.repeat < 1 or ns.hosts < 2 or ns.per_host < 1:
        p.error("--iters/--repeat >= 1, --warmup >= 0, --hosts >= 2, --per-host >= 1")
    configs = [c.strip() for c in ns.mpi_configs.split(",") if c.strip() and c.strip() != "none"]
    bad = [c for c in configs if c not in MPI_CONFIGS]
    if bad:
        p.error(f"--mpi-configs: unknown {bad}; choose from {','.join(MPI_CONFIGS)} or none")
    ns.variants = {}
    for v in ns.pg_variant:
        name, _, spec = v.partition("=")
        if not name.isidentifier() or "=" not in spec:
            p.error(f"--pg-variant {v!r}: write NAME=COLL=ALG, e.g. ml=all_reduce=multileader")
        ns.variants[name] = spec
    if any("=" not in kv for kv in ns.mpi_mca):
        p.error("--mpi-mca takes KEY=VALUE")
    why = Infra.unavailable()
    if why:
        log(f"cannot run: {why}")
        return 2
    notes: List[str] = []
    if configs:
        from procgroup.bench.cli import mpi_unavailable

        why = mpi_unavailable() or (None if shutil.which("orted") else "orted is not on PATH")
        if why:
            log(f"cannot run the Open MPI side: {why} (use --mpi-configs none to time procgroup alone)")
            return 2

    from procgroup.bench.cli import machine_info

    def on_signal(signum, frame):  # type: ignore[no-untyped-def]
        raise Terminated(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C tears down too, even when started from a shell that ignores SIGINT in background jobs
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    if ns.pg_ab and not ns.variants:
        p.error("--pg-ab compares --pg-variant settings with the default: give at least one --pg-variant")
    solo = [] if ns.pg_ab else [f"procgroup-{v}" for v in ns.variants]  # --pg-ab: inside the default run
    systems = ["procgroup"] + solo + [f"mpi-{c}" for c in configs]
    started = datetime.datetime.now(datetime.timezone.utc)
    result: dict = {
        "tool": "benchmarks/multihost.py",
        "created": started.isoformat(timespec="seconds"),
        "argv": ["benchmarks/multihost.py", *(sys.argv[1:] if argv is None else argv)],
        "config": {
            "sizes": ns.size_list,
            "iters": ns.iters,
            "warmup": ns.warmup,
            "repeat": ns.repeat,
            "hosts": ns.hosts,
            "per_host": ns.per_host,
            "world_size": n,
            "systems": systems,
            "mpi_configs": configs,
            "mpi_mca": ns.mpi_mca,
            "procgroup_transport": ns.transport,
            "mpi_base_mca": [f"{k}={v}" for k, v in BASE_MCA],
            "op": f"{ns.op} float32" + (" SUM" if "reduce" in ns.op else ""),
            "op_name": ns.op,
            "pg_force": ns.pg_force,
            "pg_variants": ns.variants,
            "pg_stage_times": ns.pg_stage_times,
            "pg_ab": ns.pg_ab,
            "calm": ns.calm,
        },
        "machine": machine_info(),
        "notes": notes,
        "runs": [],
        "round_order": [],
    }
    infra = Infra(ns)
    cfg = result["config"]
    cfg["host_names"] = infra.names
    cfg["procgroup_launch"] = (
        f"one `procgroup run --nnodes {ns.hosts} --node-rank K --master-addr {infra.names[0]} "
        f"--nproc-per-node {ns.per_host}` per host via infra/hostexec.sh; shm within a host, "
        f"TCP across (PROCGROUP_TRANSPORT={ns.transport})"
    )
    cfg["mpi_launch"] = (
        f"`mpirun -H {','.join(f'{h}:{ns.per_host}' for h in infra.names)} --mca plm_rsh_agent "
        f"infra/rsh_hostexec.sh {' '.join(f'--mca {k} {v}' for k, v in BASE_MCA)}` from "
        f"{infra.names[0]}: tcp btl between hosts, vader (shared memory) within a host."
    )
    rc = 1
    runner: Optional[Runner] = None
    with tempfile.TemporaryDirectory(prefix="multihost-") as td:
        work = Path(td)
        os.chmod(work, 0o755)
        try:
            infra.acquire(work)
            msg = infra.up()
            log(msg)
            notes.append(msg)
            runner = Runner(ns, infra, work)
            t_all = time.monotonic()
            for rnd in range(ns.repeat):
                order = systems if rnd % 2 == 0 else systems[1:] + systems[:1]
                result["round_order"].append(order)
                if ns.calm is not None:
                    from procgroup.bench.cli import wait_calm

                    result.setdefault("calm", []).append(wait_calm(ns.calm, ns.calm_wait, False))
                log(
                    f"round {rnd + 1}/{ns.repeat}: loadavg {' '.join(f'{x:.2f}' for x in loadavg())}; order "
                    f"{', '.join(order)}"
                )
                for s in order:
                    kind, _, conf = s.partition("-")
                    r = runner.run(kind, conf or None, rnd)
                    result["runs"].append(r)
                    if r["status"] == "ok":
                        meds = ", ".join(
                            f"{fmt_size(x['bytes'])} {x['median_s'] * 1e3:.1f} ms (p90 {x['p90_s'] * 1e3:.1f})"
                            for x in r["records"]
                        )
                        log(
                            f"  {s:<12} {meds}   [{r['wall_s']:.1f}s wall, load {r['loadavg_before'][0]:.2f}, "
                            f"others' CPU {100 * (r['background_cpu'] or 0):.0f}%"
                            + (
                                f", CPU {r['cpu']['cpu_ms_per_call_all_ranks']:.0f} ms/call all ranks"
                                if r.get("cpu")
                                else ""
                            )
                            + "]"
                        )
            result["wall_s"] = time.monotonic() - t_all
            rc = 0 if all(r["status"] == "ok" for r in result["runs"]) else 1
        except (KeyboardInterrupt, Terminated) as e:
            log(f"interrupted ({type(e).__name__} {e}); tearing down")
            notes.append(f"interrupted: {type(e).__name__} {e}")
            rc = 130
        except Exception as e:  # noqa: BLE001 - reported, then the teardown runs
            log(f"error: {type(e).__name__}: {e}")
            notes.append(f"error: {type(e).__name__}: {e}")
            rc = 1
        finally:
            # teardown must not be cut short by a second Ctrl-C or SIGTERM
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            if runner is not None:
                runner.kill_all()
            result["teardown"] = infra.teardown()
            infra.release()
            result["infra_timings"] = infra.timings
            for s, h in old.items():
                signal.signal(s, h)
    td_rep = result["teardown"]
    log(
        f"teardown: {len(td_rep['processes_stopped'])} process(es) stopped, {len(td_rep['shm_removed'])} /dev/shm "
        f"segment(s) removed, hosts removed: {', '.join(td_rep['hosts_removed']) or 'none (not ours)'}"
    )
    if td_rep.get("processes_left") or td_rep.get("namespaces_left") or td_rep.get("shm_left"):
        log(f"teardown left something behind: {json.dumps(td_rep)}")
        rc = rc or 1
    if not result["runs"]:
        return rc
    result["machine"]["loadavg_end"] = loadavg()
    md = finish_report(result)
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = ns.name or f"multihost-{started.strftime('%Y%m%dT%H%M%SZ')}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(md)
    print(md, flush=True)
    log(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
