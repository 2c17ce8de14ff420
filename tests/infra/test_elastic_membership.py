"""Elastic membership on the namespace hosts: ``--nnodes 2:3`` starts on h1 and h2, takes h3 when it arrives,
and carries on with h1 and h3 when h2's agent is SIGKILLed -- each time a new generation with ranks reassigned,
the workers (examples/elastic_train.py) resuming from the shared checkpoint, and every generation's all_reduce
checked against its closed form on every rank.  Below MIN the job ends with an error naming the lost node.

The timings (arrival -> the larger job running, loss -> the smaller job running) are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Callable, List

import pytest

from .launch import clean_env
from .test_launcher_multinode import Job, Proc, job, procgroup_run

pytestmark = [pytest.mark.infra, pytest.mark.timeout(240, method="signal")]
__all__ = ["job"]  # the fixture, re-exported for this module's tests

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"
PORT = 29450


def _start(job: Job, host: str, tmp: Path, env: dict, nnodes: str = "2:3") -> Proc:
    args = procgroup_run(
        "--nnodes",
        nnodes,
        "--master-addr",
        job.hosts.names[0],
        "--master-port",
        str(PORT),
        "--nproc-per-node",
        "2",
        "--join-window",
        "2",
        "--max-restarts",
        "3",
        str(EXAMPLE),
        "--checkpoint",
        str(tmp / "ckpt.json"),
        "--steps",
        "1000000",
        "--stop-file",
        str(tmp / "stop"),
    )
    return job.start(host, job.hosts.cmd(host, *args), env, tmp)


def _wait(procs: List[Proc], pred: Callable[[str], bool], count: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sum(1 for p in procs for ln in list(p.out) if pred(ln)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} matching lines\n" + "\n".join(p.text() for p in procs))


def _ok(gen: int, world: int) -> Callable[[str], bool]:
    rx = re.compile(rf"ELASTIC gen={gen} world={world} rank=\d+ allreduce_ok sum=(\d+)$")
    return lambda ln: bool((m := rx.search(ln)) and int(m.group(1)) == world * (world + 1) // 2)


def test_two_of_three_then_three_then_two(job: Job, tmp_path: Path) -> None:
    h1, h2, h3 = job.hosts.names
    env = clean_env({"PROCGROUP_SECRET": secrets.token_hex(16)})
    a = _start(job, h1, tmp_path, env)
    b = _start(job, h2, tmp_path, env)
    _wait([a, b], _ok(0, 4), 4)
    t0 = time.monotonic()
    c = _start(job, h3, tmp_path, env)
    _wait([a, b, c], _ok(1, 6), 6)
    grow = time.monotonic() - t0
    t0 = time.monotonic()
    os.kill(b.p.pid, signal.SIGKILL)
    _wait([a, c], _ok(2, 4), 4)
    shrink = time.monotonic() - t0
    (tmp_path / "stop").write_text("")
    assert a.wait(60) == 0, job.text()
    assert c.wait(60) == 0, job.text()
    print(
        f"\nELASTIC | h3 arrives: 6 ranks running after {grow:.2f}s (join window 2 s) | h2's agent SIGKILLed: "
        f"4 ranks running after {shrink:.2f}s"
    )
    err = a.stderr
    for n, nodes, gen in ((4, 2, 0), (6, 3, 1), (4, 2, 2)):  # the mapping of every generation, by node 0
        assert f"{n} workers on {nodes} nodes (run id none, restart {gen})" in err, err
    # ranks reassigned deterministically: h1 is node 0, then by host name
    assert re.search(r"^\s+4\s+2\s+h3\s+0\s+\d+$", err, re.M), err  # generation 1: h3 is node 2, ranks 4-5
    assert re.search(r"^\s+2\s+1\s+h3\s+0\s+\d+$", err, re.M), err  # generation 2: h3 is node 1, ranks 2-3
    out = a.stdout + "\n" + c.stdout
    assert len(re.findall(r"ELASTIC done gen=2 world=4", out)) == 4, out
    resumed = [int(x) for x in re.findall(r"ELASTIC gen=[12] world=\d rank=\d+ host=\S+ resume_step=(\d+)", out)]
    assert len(resumed) == 8 and all(r > 0 for r in resumed), out  # h1 and h3: 2 ranks x generations 1, 2
    assert "joined: re-forming the job as generation 1" in err, err
    assert re.search(r"node 1 \(h2, agent pid \d+\) is lost: its connection to the agents' store closed", err), err
    assert not job.leftovers(grace=5.0), job.text()


def test_below_min_ends_with_the_lost_node_named(job: Job, tmp_path: Path) -> None:
    h1, h2, _ = job.hosts.names
    env = clean_env({"PROCGROUP_SECRET": secrets.token_hex(16)})
    a = _start(job, h1, tmp_path, env)
    b = _start(job, h2, tmp_path, env)
    _wait([a, b], _ok(0, 4), 4)
    os.kill(b.p.pid, signal.SIGKILL)
    assert a.wait(60) == 1, a.text()
    assert re.search(r"below the minimum of 2 \(--nnodes 2:3\); lost: node 1 \(h2, agent pid \d+\)", a.stderr), a.text()
    assert not job.leftovers(grace=5.0), job.text()
