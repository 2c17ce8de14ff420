"""``procgroup top`` against a real 4-rank ``procgroup run`` job whose rank 2 stalls before an all_reduce,
and ``procgroup run --local-rank-arg`` with a torch.distributed.launch-style script.

The top tests attach by run id (the run-info file the launcher leaves in a private PROCGROUP_RUNTIME_DIR)
and by store address; the tmux test types ``procgroup top RUN_ID`` into a real terminal and reads the screen
back with ``capture-pane``.  Every test stops the job (and the tmux server) in a finally and checks that no
worker is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from procgroup import procfs

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
STALL = ROOT / "tests" / "integration" / "scripts" / "top_stall.py"
RESTART = ROOT / "tests" / "integration" / "scripts" / "top_restart.py"
STALLED_RANK = 2


def _env(runtime: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_SECRET", "PROCGROUP_TOP_INTERVAL"):
        env.pop(k, None)
    env.update(PROCGROUP_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", **extra)
    return env


class Job:
    """A ``procgroup run`` of the stalling script, in a session of its own."""

    def __init__(self, runtime: Path, log: Path, script: Path = STALL, *flags: str) -> None:
        self.run_id = "top-" + uuid.uuid4().hex[:8]
        self.pids: set[int] = set()  # the workers' pids, as procgroup top showed them
        self.runtime = runtime
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "procgroup", "run", "--standalone", "--nproc-per-node", "4"]
            + ["--run-id", self.run_id, *flags, str(script)],
            env=_env(runtime, STALL_RANK=str(STALLED_RANK), STALL_SECS="120", PROCGROUP_TIMEOUT="180"),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def info(self, timeout: float = 60.0) -> dict:
        """The run-info file, once the launcher wrote it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p in self.runtime.glob(f"{self.run_id}.*.json"):
                return json.loads(p.read_text())
            assert self.proc.poll() is None, f"the job ended early: {self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"no run-info file in {self.runtime}: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM the launcher (it tears the workers down), SIGKILL the session if it lingers."""
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        finally:
            self.log.close()
        assert not list(self.runtime.glob(f"{self.run_id}.*.json")), "the run-info file outlived the job"
        left = [p for p in self.pids if procfs.pid_alive(p)]
        assert not left, f"workers {left} outlived the job"


def _top(runtime: Path, *args: str, timeout: float = 30.0, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "procgroup", "top", *args],
        env=_env(runtime, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    runtime = tmp_path / "runtime"
    j = Job(runtime, tmp_path / "job.log")
    try:
        yield j
    finally:
        j.stop()


def _until_stalled_rank_named(job: Job, *args: str, deadline_s: float = 60.0) -> dict:
    """``procgroup top --json`` until it names the stalled rank; that snapshot."""
    end = time.monotonic() + deadline_s
    doc: dict = {}
    while time.monotonic() < end:
        p = _top(job.runtime, *args, "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        job.pids |= {r["pid"] for r in doc["ranks"] if r["pid"]}
        if doc["stuck"]:
            return doc
        time.sleep(0.5)
    raise AssertionError(f"procgroup top never named a stalled rank: {json.dumps(doc, indent=1)}\n{job.output()}")


@pytest.mark.timeout(150)
def test_top_once_and_json_name_the_stalled_rank(job: Job) -> None:
    info = job.info()
    assert info["run_id"] == job.run_id and info["world_size"] == 4
    doc = _until_stalled_rank_named(job, job.run_id)
    assert [s["rank"] for s in doc["stuck"]] == [STALLED_RANK], doc
    assert "have waited" in doc["stuck"][0]["why"] and "all_reduce(float32, 1024, SUM)" in doc["stuck"][0]["why"]
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[STALLED_RANK]["state"] == "compute" and ranks[STALLED_RANK]["stuck"]
    for r in (0, 1, 3):
        assert ranks[r]["state"] == "op" and ranks[r]["op"] == "all_reduce(float32, 1024, SUM)", ranks[r]
        assert ranks[r]["group"] == "WORLD" and ranks[r]["seq"] == 3 and not ranks[r]["stuck"]
    assert all(r["rss_bytes"] > 1 << 20 and r["pid"] > 0 for r in doc["ranks"])
    assert {r["pid"] for r in doc["ranks"]} <= {p for p in procfs.pids()}

    # --once: plain text, a row per rank, the stalled one marked, and why
    p = _top(job.runtime, job.run_id, "--once")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"procgroup top - run {job.run_id} - store 127.0.0.1:")
    rows = [line for line in lines if re.match(r"^[! ] +\d+ ", line)]
    assert len(rows) == 4, p.stdout
    assert [line.split()[1] for line in rows if line.startswith("!")] == [str(STALLED_RANK)], p.stdout
    assert f"! rank {STALLED_RANK}: ranks 0, 1, 3 have waited" in p.stdout, p.stdout
    assert "\x1b" not in p.stdout

    # the only job of this user: no run id needed; and by store address with the secret in a file
    p = _top(job.runtime, "--once")
    assert p.returncode == 0 and f"! rank {STALLED_RANK}:" in p.stdout, p.stderr
    secret = job.runtime.parent / "secret"
    secret.write_text(info["secret"])
    store = f"{info['store_addr']}:{info['store_port']}"
    p = _top(job.runtime, "--store", store, "--secret-file", str(secret), "--json")
    assert p.returncode == 0, p.stderr
    assert [s["rank"] for s in json.loads(p.stdout)["stuck"]] == [STALLED_RANK]
    p = _top(job.runtime, "--store", store, "--once", "--timeout", "3", PROCGROUP_SECRET="wrong")
    assert p.returncode == 1 and "procgroup top: error:" in p.stderr, p.stdout + p.stderr


def _sgr(prefix: str) -> set[str]:
    """The SGR parameters set by the escape sequences in ``prefix``."""
    return {p for seq in re.findall(r"\x1b\[([0-9;]*)m", prefix) for p in seq.split(";") if p}


@pytest.mark.timeout(150)
def test_top_live_view_in_tmux(job: Job) -> None:
    tmux = shutil.which("tmux")
    if tmux is None:
        pytest.skip("tmux is not installed: the live view is tested in a tmux terminal")
    job.info()
    _until_stalled_rank_named(job, job.run_id)
    sock = f"pgtop-{uuid.uuid4().hex[:8]}"
    t = [tmux, "-L", sock, "-f", os.devnull]
    env = _env(job.runtime)
    try:
        subprocess.run(t + ["new-session", "-d", "-s", "top", "-x", "160", "-y", "40"], env=env, check=True)
        cmd = f"{sys.executable} -m procgroup top {job.run_id}"
        subprocess.run(t + ["send-keys", "-t", "top", cmd, "Enter"], check=True)
        end = time.monotonic() + 30
        screen = ""
        while time.monotonic() < end:
            time.sleep(0.5)
            screen = subprocess.run(t + ["capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout
            if f"! rank {STALLED_RANK}:" in screen:
                break
        rows = [line for line in screen.splitlines() if re.match(r"^[! ] +\d+ ", line)]
        assert len(rows) == 4, screen
        assert screen.splitlines()[0].startswith(f"procgroup top - run {job.run_id}"), screen
        assert [line.split()[1] for line in rows if line.startswith("!")] == [str(STALLED_RANK)], screen
        colored = subprocess.run(t + ["capture-pane", "-p", "-e", "-t", "top"], capture_output=True, text=True).stdout
        by_rank = {}
        for line in colored.splitlines():
            m = re.match(r"^((?:\x1b\[[0-9;]*m)*)[! ] +(\d+) ", line)
            if m:
                by_rank[int(m.group(2))] = _sgr(m.group(1))
        assert sorted(by_rank) == [0, 1, 2, 3], colored
        assert {"7", "31"} <= by_rank[STALLED_RANK], colored  # reverse video, red
        assert all("7" not in by_rank[r] for r in (0, 1, 3)), colored
        subprocess.run(t + ["send-keys", "-t", "top", "q"], check=True)
        end = time.monotonic() + 10
        while time.monotonic() < end and "RANK" in screen:
            time.sleep(0.2)
            screen = subprocess.run(t + ["capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout
        assert "RANK" not in screen, f"q did not leave the live view:\n{screen}"
    finally:
        subprocess.run(t + ["kill-server"], capture_output=True)


@pytest.mark.timeout(150)
def test_top_follows_the_job_into_its_next_generation(tmp_path: Path) -> None:
    from procgroup.launcher import top  # noqa: PLC0415

    job = Job(tmp_path / "runtime", tmp_path / "job.log", RESTART, "--max-restarts", "1")
    env = _env(job.runtime)
    try:
        job.info()
        target = top.resolve_target(top.build_parser().parse_args([job.run_id]), env)
        assert target.agent_pid == job.proc.pid
        reader = top.Reader(target, 30.0)
        first = reader.wait_complete(top.Deadline.after(30), 2.0)
        gen0 = {r.pid for r in first.rows}
        assert len(gen0) == 4 and None not in gen0, first
        (tmp_path / "top_restart.go").write_text("")  # generation 0 read: its rank 1 may fail now
        end = time.monotonic() + 60
        with pytest.raises(top.ProcGroupError):  # generation 0 ends: its store goes away
            while time.monotonic() < end:
                reader.snapshot(2.0)
                time.sleep(0.2)
        reader.close()
        nxt = top.reattach(target, env, 60.0)
        assert nxt is not None, job.output()
        try:
            snap = nxt.wait_complete(top.Deadline.after(30), 2.0)
            gen1 = {r.pid for r in snap.rows}
            assert len(gen1) == 4 and not gen1 & gen0, (gen0, snap)
        finally:
            nxt.close()
        job.pids |= gen0 | gen1
    finally:
        job.stop()
    assert top.reattach(target, env, 5.0) is None  # the job is over: nothing to follow


# ------------------------------------------------------------------------------------------------ --local-rank-arg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--local-rank-arg", "--local-rank-arg=underscore", None])
def test_launch_style_script_gets_its_local_rank(tmp_path: Path, flag: str) -> None:
    args = ["--standalone", "--nproc-per-node", "3"] + ([flag] if flag else [])
    p = subprocess.run(
        [sys.executable, "-m", "procgroup", "run", *args, str(ROOT / "examples" / "launch_style.py"), "--steps", "2"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(3):
        if flag:  # one node: local rank == rank; 0 + 1 + 2
            assert f"[{r}] rank {r}: local rank {r}, sum of local ranks 3" in p.stdout, p.stdout
        else:  # the convention is opt-in: without it the script sees its default, as under torchrun
            assert f"[{r}] rank {r}: local rank -1, sum of local ranks -3" in p.stdout, p.stdout
