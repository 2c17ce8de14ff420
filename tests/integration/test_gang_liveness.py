"""Several agents on one host: a killed agent is found by its closed store connection within a second or two,
not by a 10 s heartbeat; a SIGUSR1 to any agent reaches the workers of every node.

(The same on the network-namespace hosts, with the timing table, is tests/infra/test_elastic_node_loss.py.)
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from procgroup.netutil import free_port

pytestmark = pytest.mark.timeout(60)

SRC = Path(__file__).resolve().parents[2] / "src"
#: detect and tear down within this (the targets are 3 s and 5 s; loose for a loaded machine)
BOUND_S = 8.0

SLEEPER = textwrap.dedent(
    """
    import os, signal, time
    signal.signal(signal.SIGUSR1, lambda *a: print(f"usr1 pid={os.getpid()}", flush=True))
    print(f"pid={os.getpid()}", flush=True)
    while True:
        time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


class Agent:
    """One ``procgroup run`` node agent; stdout and stderr lines with their arrival times."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "procgroup", "run", *args],
            cwd=str(cwd),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.lines: "queue.Queue[tuple[str, float]]" = queue.Queue()
        self.all: list[tuple[str, float]] = []
        for pipe in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:  # type: ignore[no-untyped-def]
        for raw in pipe:
            item = (raw.decode("utf-8", "replace").rstrip("\n"), time.time())
            self.all.append(item)
            self.lines.put(item)

    def text(self) -> str:
        return "\n".join(ln for ln, _ in self.all)

    def count(self, pattern: str) -> int:
        return sum(1 for ln, _ in self.all if re.search(pattern, ln))

    def first(self, pattern: str) -> Optional[float]:
        return next((t for ln, t in self.all if re.search(pattern, ln)), None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


@pytest.fixture
def gang(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Agent] = []
    pids: set[int] = set()

    def start(n: int = 3, extra: tuple[str, ...] = ()) -> tuple[list[Agent], set[int]]:
        s = tmp_path / "sleeper.py"
        s.write_text(SLEEPER)
        env = dict(os.environ, PYTHONPATH=str(SRC), PROCGROUP_SECRET="shared-secret")
        port = str(free_port())
        for k in range(n):
            args = ["--nnodes", str(n), "--node-rank", str(k), "--nproc-per-node", "2", "--master-port", port]
            started.append(Agent([*args, *extra, str(s)], tmp_path, env))
        end = time.monotonic() + 40
        while sum(a.count(r"pid=\d+$") for a in started) < 2 * n and time.monotonic() < end:
            time.sleep(0.05)
        for a in started:
            pids.update(int(m) for ln, _ in a.all for m in re.findall(r"^\[[^]]*\] pid=(\d+)$", ln))
        assert len(pids) == 2 * n, "\n".join(a.text() for a in started)
        return started, pids

    yield start
    for a in started:
        a.kill()
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("victim", [1, 2, 0])
def test_a_killed_agent_is_found_by_its_closed_connection(gang, victim: int) -> None:  # type: ignore[no-untyped-def]
    agents, pids = gang()
    t0 = time.time()
    agents[victim].proc.kill()
    survivors = [a for k, a in enumerate(agents) if k != victim]
    for a in survivors:
        assert a.proc.wait(30) == 1, a.text()
    end = time.time()
    while any(_alive(p) for p in pids) and time.time() < end + 5:
        time.sleep(0.02)
    gone = time.time() - t0
    assert not [p for p in pids if _alive(p)], "workers left behind"
    if victim == 0:  # the store's host: the others' connections break at once
        pattern = r"lost the connection to the agents' store"
    else:
        pattern = rf"node {victim} \(.*is lost: its connection to the agents' store closed"
    seen = [a.first(pattern) for a in survivors]
    assert all(t is not None for t in seen), "\n".join(a.text() for a in agents)
    detect = max(t for t in seen if t is not None) - t0
    print(f"victim node {victim}: detected by every agent after {detect:.2f}s, all workers gone after {gone:.2f}s")
    assert detect < BOUND_S and gone < BOUND_S, f"detect {detect:.2f}s, teardown {gone:.2f}s"
    assert "no heartbeat for" not in "\n".join(a.text() for a in survivors)  # the connection told first


def test_sigusr1_to_any_agent_reaches_every_node(gang) -> None:  # type: ignore[no-untyped-def]
    agents, pids = gang()
    os.kill(agents[2].proc.pid, signal.SIGUSR1)
    end = time.monotonic() + 15
    while sum(a.count(r"usr1 pid=") for a in agents) < len(pids) and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.0)  # and only once each
    got = [a.count(r"usr1 pid=") for a in agents]
    assert got == [2, 2, 2], "\n".join(a.text() for a in agents)
    assert all(_alive(p) for p in pids), "SIGUSR1 must not stop anything"


def test_heartbeat_timeout_is_checked() -> None:
    from procgroup.errors import ConfigError
    from procgroup.launcher.cli import parse_args

    assert parse_args(["--heartbeat-timeout", "1.5", "x.py"]).heartbeat_timeout == 1.5  # type: ignore[union-attr]
    env = {"PROCGROUP_HEARTBEAT_TIMEOUT": "2"}
    assert parse_args(["x.py"], env).heartbeat_timeout == 2.0  # type: ignore[union-attr]
    assert parse_args(["--heartbeat-timeout", "4", "x.py"], env).heartbeat_timeout == 4.0  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="--heartbeat-timeout"):
        parse_args(["--heartbeat-timeout", "0", "x.py"])
    with pytest.raises(ConfigError, match="PROCGROUP_HEARTBEAT_TIMEOUT"):
        parse_args(["x.py"], {"PROCGROUP_HEARTBEAT_TIMEOUT": "soon"})
