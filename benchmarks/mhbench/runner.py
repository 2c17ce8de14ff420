"""One run of one system (procgroup per node, or mpirun) across the hosts."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .common import BASE_MCA, INFRA, MPI_CONFIGS, SCRIPT
from .infra import Infra, child_env, log
from .procs import OthersMeter, loadavg, netns_inodes


class Runner:
    def __init__(self, ns: argparse.Namespace, infra: Infra, work: Path) -> None:
        self.ns = ns
        self.infra = infra
        self.work = work
        self.session = secrets.token_hex(4)
        self.count = 0
        self.procs: List[subprocess.Popen] = []
        infra.add_shm_prefix(f"mhb-{self.session}")

    def _worker_args(self, system: str, out: Path, force: str = "") -> List[str]:
        return [
            str(SCRIPT),
            "--worker",
            system,
            "--out",
            str(out),
            "--op",
            self.ns.op,
            "--sizes",
            ",".join(str(s) for s in self.ns.size_list),
            "--iters",
            str(self.ns.iters),
            "--warmup",
            str(self.ns.warmup),
            "--timeout",
            str(self.ns.timeout),
            *(["--pg-force", force] if system == "procgroup" and force else []),
            *(["--pg-stage-times"] if system == "procgroup" and self.ns.pg_stage_times else []),
            *(
                ["--pg-ab-variants", json.dumps(self.ns.variants)]
                if system == "procgroup" and self.ns.pg_ab and not force
                else []
            ),
        ]

    def _start(self, cmd: List[str], env: dict, logf) -> subprocess.Popen:  # type: ignore[no-untyped-def]
        p = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(self.work),
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in self.procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except OSError:
                    pass
            end = time.monotonic() + 5
            while time.monotonic() < end and any(p.poll() is None for p in live):
                time.sleep(0.1)
        self.procs = []

    def commands(self, system: str, config: Optional[str], out: Path) -> tuple[List[List[str]], dict]:
        ns, names, per = self.ns, self.infra.names, self.ns.per_host
        py = sys.executable
        if system == "procgroup":
            force = ns.pg_force if config is None else ns.variants[config]
            port = str(ns.port + self.count % 500)
            run_id = f"mhb-{self.session}-{self.count}"
            env = child_env(
                {**self.infra.env, "PROCGROUP_SECRET": secrets.token_hex(16), "PROCGROUP_TIMEOUT": str(ns.timeout)}
            )
            if ns.transport != "auto":
                env["PROCGROUP_TRANSPORT"] = ns.transport
            cmds = [
                self.infra.hostexec(
                    h,
                    py,
                    "-m",
                    "procgroup",
                    "run",
                    "--nnodes",
                    str(len(names)),
                    "--node-rank",
                    str(i),
                    "--master-addr",
                    names[0],
                    "--master-port",
                    port,
                    "--nproc-per-node",
                    str(per),
                    "--run-id",
                    run_id,
                    *self._worker_args("procgroup", out, force),
                )
                for i, h in enumerate(names)
            ]
            return cmds, env
        assert config is not None
        mca = BASE_MCA + MPI_CONFIGS[config]["mca"] + [tuple(kv.split("=", 1)) for kv in ns.mpi_mca]
        env = child_env({**self.infra.env})
        fwd = ["PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"]
        cmd = self.infra.hostexec(
            names[0],
            shutil.which("mpirun") or "mpirun",
            "--allow-run-as-root",
            "-H",
            ",".join(f"{h}:{per}" for h in names),
            "--mca",
            "plm_rsh_agent",
            str(INFRA / "rsh_hostexec.sh"),
            *[a for k, v in mca for a in ("--mca", k, v)],
            *[a for v in fwd for a in ("-x", v)],
            py,
            *self._worker_args("mpi", out),
        )
        return [cmd], env

    def run(self, system: str, config: Optional[str], rnd: int) -> dict:
        self.count += 1
        label = "procgroup" if system == "procgroup" and config is None else f"{system}-{config}"
        out = self.work / f"{label}-r{rnd}.jsonl"
        logp = self.work / f"{label}-r{rnd}.log"
        cmds, env = self.commands(system, config, out)
        info: dict = {
            "system": label,
            "round": rnd,
            "commands": cmds,
            "status": "failed",
            "records": [],
            "loadavg_before": loadavg(),
        }
        if config is not None:
            info["mpi_config" if system == "mpi" else "pg_variant"] = config
        meter = OthersMeter(netns_inodes(self.infra.names))
        t0 = time.monotonic()
        with open(logp, "w") as logf:
            procs = [self._start(c, env, logf) for c in cmds]
            end = t0 + self.ns.run_timeout
            try:
                while any(p.poll() is None for p in procs):
                    if time.monotonic() > end:
                        info["error"] = f"did not finish within {self.ns.run_timeout:.0f}s (--run-timeout); killed"
                        break
                    # one node's launcher failing brings the others down by itself; give them a moment
                    time.sleep(0.2)
            finally:
                self.kill_all()
        info["wall_s"] = time.monotonic() - t0
        info["background_cpu"] = meter.fraction()
        info["loadavg_after"] = loadavg()
        info["returncodes"] = [p.returncode for p in procs]
        left = self.infra.sweep()
        if left:
            info["leftover_processes_stopped"] = left
        recs = []
        if out.exists():
            for line in out.read_text().splitlines():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
        info["header"] = next((r for r in recs if r.get("kind") == "header"), None)
        cpu = next((r for r in recs if r.get("kind") == "cpu"), None)
        if cpu:
            info["cpu"] = {k: v for k, v in cpu.items() if k != "kind"}
        ab = next((r for r in recs if r.get("kind") == "ab"), None)
        if ab:
            info["ab"] = ab.get("ab")
        st = next((r for r in recs if r.get("kind") == "stages"), None)
        if st:
            info["stage_times"] = st.get("stage_times")
        for r in recs:
            if r.get("kind") == "case":
                r = {k: v for k, v in r.items() if k != "kind"}
                r.update(
                    system=label,
                    round=rnd,
                    background_cpu=info["background_cpu"],
                    loadavg_before=info["loadavg_before"],
                )
                info["records"].append(r)
        ended = any(r.get("kind") == "end" for r in recs)
        if all(rc == 0 for rc in info["returncodes"]) and ended and "error" not in info:
            info["status"] = "ok"
        else:
            info.setdefault("error", f"exit status(es) {info['returncodes']}")
            tail = logp.read_text(errors="replace")[-4000:] if logp.exists() else ""
            info["log_tail"] = tail
            log(f"{label} round {rnd} FAILED ({info['error']}); last output:\n{tail}")
        bad = [r for r in info["records"] if "error" in r]
        if bad:
            info["status"] = "failed"
            info.setdefault("error", bad[0]["error"])
        return info


# ===================================================================================== report
