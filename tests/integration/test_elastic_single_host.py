"""Elastic membership (``--nnodes MIN:MAX``) with several agents on this one host, running examples/elastic_train.py.

Start 2 of at most 3 nodes, add the third, SIGKILL one: the job re-forms each time (a new generation with ranks
reassigned and printed), the workers resume from the checkpoint, and every generation's all_reduce is checked
against its closed form.  Below MIN the job ends with an error that names the lost node.
(The same on the network-namespace hosts: tests/infra/test_elastic_membership.py.)
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from procgroup.netutil import free_port

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "elastic_train.py"


class Agent:
    """One ``procgroup run`` node agent; its output lines kept in order."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "procgroup", "run", *args],
            cwd=str(cwd),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.q: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


def wait_for(agents: list[Agent], pred: Callable[[str], bool], count: int, timeout: float = 40.0) -> list[str]:
    """Wait until ``count`` lines over all agents satisfy ``pred``; returns them."""
    end = time.monotonic() + timeout
    while True:
        got = [ln for a in agents for ln in list(a.lines) if pred(ln)]
        if len(got) >= count or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert len(got) >= count, f"saw {len(got)}/{count} lines\n" + "\n=====\n".join(a.text() for a in agents)
    return got


def ok_lines(gen: int, world: int) -> Callable[[str], bool]:
    """The first-step line of every rank of generation ``gen`` with the closed-form sum 1 + ... + world."""
    rx = re.compile(rf"ELASTIC gen={gen} world={world} rank=\d+ allreduce_ok sum=(\d+)$")

    def pred(ln: str) -> bool:
        m = rx.search(ln)
        return m is not None and int(m.group(1)) == world * (world + 1) // 2

    return pred


@pytest.fixture
def elastic(tmp_path: Path):  # type: ignore[no-untyped-def]
    started: list[Agent] = []
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PROCGROUP_SECRET="elastic-test")

    def start(*extra: str, nnodes: str = "2:3", stop: Optional[Path] = None) -> Agent:
        args = [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--master-port",
            port,
            "--join-window",
            "1.5",
            "--max-restarts",
            "3",
            *extra,
            str(EXAMPLE),
            "--checkpoint",
            str(tmp_path / "ckpt.json"),
            "--steps",
            "1000000",
            "--stop-file",
            str(stop or tmp_path / "stop"),
        ]
        a = Agent(args, tmp_path, env)
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()


def test_start_with_two_add_a_third_lose_one(elastic, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a = elastic()
    time.sleep(0.5)  # a hosts the store (first on the port); b joins it
    b = elastic()
    wait_for([a, b], ok_lines(0, 4), 4)
    c = elastic()
    wait_for([a, b, c], ok_lines(1, 6), 6)
    t0 = time.monotonic()
    b.proc.kill()  # SIGKILL the agent; its workers die with it
    wait_for([a, c], ok_lines(2, 4), 4)
    reform = time.monotonic() - t0
    (tmp_path / "stop").write_text("")
    assert a.proc.wait(40) == 0, a.text()
    assert c.proc.wait(40) == 0, c.text()
    out = a.text() + "\n" + c.text()
    print(f"elastic on one host: lost node to generation 2 running in {reform:.2f}s")
    # the coordinator printed each generation's mapping: 4, 6, then 4 workers
    for n, nodes, gen in ((4, 2, 0), (6, 3, 1), (4, 2, 2)):
        assert f"{n} workers on {nodes} nodes (run id none, restart {gen})" in a.text(), a.text()
    assert re.search(r"joined: re-forming the job as generation 1", out), out
    assert re.search(r"node \d \(.*is lost: its connection to the agents' store closed", out), out
    # the workers resumed from the checkpoint in every later generation
    resumed = [int(m) for m in re.findall(r"ELASTIC gen=[12] world=\d rank=\d+ host=\S+ resume_step=(\d+)", out)]
    assert resumed and all(r > 0 for r in resumed), out
    assert len(re.findall(r"ELASTIC done gen=2 world=4", out)) == 4, out


def test_below_min_ends_the_job_naming_the_lost_node(elastic) -> None:  # type: ignore[no-untyped-def]
    a = elastic()
    time.sleep(0.5)
    b = elastic()
    wait_for([a, b], ok_lines(0, 4), 4)
    b.proc.kill()
    assert a.proc.wait(40) == 1, a.text()
    err = a.text()
    assert re.search(r"below the minimum of 2 \(--nnodes 2:3\); lost: node 1 \(\S+, agent pid \d+\)", err), err
