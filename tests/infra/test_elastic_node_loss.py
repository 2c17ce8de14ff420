"""Node loss on the namespace hosts h1..h3: how fast the other agents notice a SIGKILLed agent and stop everything.

Each test starts 3 hosts x 2 workers (``init_process_group`` + barrier, then they sleep), SIGKILLs the agent of
one node and measures

* **detect**: until every surviving agent has said why it stops (``stopping this node's workers: ...``);
* **teardown**: until every worker of every host is gone.

The issue's targets are 3 s and 5 s; before, a non-zero agent was found only by a fixed 10 s heartbeat and the
teardown took about 12 s.  The timings are printed (``pytest -s``) as rows of the table in the report.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from .fixtures import SshHosts
from .launch import alive, clean_env, netns_inodes, pids_in_netns
from .test_launcher_multinode import PER_NODE, Job, Proc, _collect_pids, _gone_after, _head, _per_node, job

pytestmark = [pytest.mark.infra, pytest.mark.timeout(240, method="signal")]
__all__ = ["job"]  # the fixture, re-exported for this module's tests

DETECT_S = 3.0
TEARDOWN_S = 5.0
#: loose bounds the assertions use (the targets above are printed; a loaded machine must not flake)
DETECT_BOUND = 6.0
TEARDOWN_BOUND = 8.0

SLEEPER = """
    import os, socket, time
    import procgroup as dist
    dist.init_process_group()
    dist.barrier()
    print(f"pid={os.getpid()} rank={dist.get_rank()} host={socket.gethostname()}", flush=True)
    time.sleep(120)
"""

STOP = re.compile(r"stopping this node's workers: (.*)")


def _sleeper(d: Path) -> str:
    p = d / "sleeper.py"
    p.write_text(textwrap.dedent(SLEEPER))
    return str(p)


def _agent_pid(host: str, node: int) -> int:
    """The pid of the ``procgroup run`` agent of ``node`` in ``host``'s network namespace."""
    for pid in pids_in_netns(netns_inodes([host])):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"procgroup" in argv and b"run" in argv and b"--node-rank" in argv:
            if argv[argv.index(b"--node-rank") + 1] == str(node).encode():
                return pid
    raise AssertionError(f"no agent of node {node} on {host}")


def _stop_times(procs: List[Proc], since: float, expect: int, timeout: float) -> List[float]:
    """Seconds from ``since`` to each ``stopping this node's workers`` line (waits for ``expect`` of them)."""
    end = time.monotonic() + timeout
    seen: List[tuple[str, float]] = []
    while len(seen) < expect and time.monotonic() < end:
        for p in procs:
            while not p.lines.empty():
                line, t = p.lines.get_nowait()
                if STOP.search(line):
                    seen.append((line, t))
        time.sleep(0.01)
    assert len(seen) >= expect, f"only {len(seen)} of {expect} agents said why they stop"
    return [t - since for _, t in seen]


def _report(mode: str, victim: int, detect: float, teardown: float, why: str, event: str = "agent SIGKILLed") -> None:
    print(f"\nNODE-LOSS | {mode} | node {victim} {event} | detect {detect:.2f}s | teardown {teardown:.2f}s")
    print(f"    ({why})")


@pytest.mark.parametrize("victim", [1, 2, 0])
def test_per_node_mode_a_killed_agent_stops_every_host(job: Job, tmp_path: Path, victim: int) -> None:
    names = job.hosts.names
    env = clean_env({"PROCGROUP_SECRET": "node-loss-" + str(victim)})
    procs = _per_node(job, names, [_sleeper(tmp_path)], env, tmp_path)
    pids, _ = _collect_pids(procs, len(names) * PER_NODE, timeout=90, raising=False)
    agent = procs[victim].p.pid
    t0 = time.time()
    os.kill(agent, signal.SIGKILL)
    survivors = [p for k, p in enumerate(procs) if k != victim]
    stops = _stop_times(survivors, t0, len(survivors), timeout=TEARDOWN_BOUND + 10)
    teardown = _gone_after(pids, t0, timeout=TEARDOWN_BOUND + 10)
    rcs = [p.wait(30) for p in survivors]
    why = STOP.search(next(ln for ln in survivors[0].err if STOP.search(ln))).group(1)  # type: ignore[union-attr]
    _report("per-node", victim, max(stops), teardown, why[:90])
    assert all(rc == 1 for rc in rcs), f"exit statuses {rcs}\n{job.text()}"
    assert max(stops) < DETECT_BOUND, f"detected after {max(stops):.2f}s\n{job.text()}"
    assert teardown < TEARDOWN_BOUND, f"teardown took {teardown:.2f}s\n{job.text()}"
    if victim:
        assert f"node {victim} ({names[victim]}" in why and "connection to the agents' store closed" in why, why
    else:
        assert "lost the connection to the agents' store" in why, why
    assert not job.leftovers(grace=5.0), job.text()


def test_head_node_mode_a_killed_agent_stops_every_host(job: Job, sshd_hosts: SshHosts, tmp_path: Path) -> None:
    names = job.hosts.names
    victim = 1
    head = _head(job, sshd_hosts, tmp_path, [_sleeper(tmp_path)], clean_env())
    pids, _ = _collect_pids([head], len(names) * PER_NODE, timeout=90, raising=False)
    agent = _agent_pid(names[victim], victim)
    t0 = time.time()
    os.kill(agent, signal.SIGKILL)
    stops = _stop_times([head], t0, len(names) - 1, timeout=TEARDOWN_BOUND + 10)
    teardown = _gone_after(pids, t0, timeout=TEARDOWN_BOUND + 10)
    rc: Optional[int] = head.wait(60)
    why = STOP.search(next(ln for ln in head.err if STOP.search(ln))).group(1)  # type: ignore[union-attr]
    _report("head-node", victim, max(stops), teardown, why[:90])
    assert rc not in (0, None), head.text()
    assert max(stops) < DETECT_BOUND, f"detected after {max(stops):.2f}s\n{head.text()}"
    assert teardown < TEARDOWN_BOUND, f"teardown took {teardown:.2f}s\n{head.text()}"
    assert f"node {victim} ({names[victim]}" in why, why
    assert not job.leftovers(grace=10.0), job.text()


def test_sigusr1_to_one_agent_reaches_every_host(job: Job, tmp_path: Path) -> None:
    """Per-node mode: SIGUSR1 to node 2's agent reaches the workers of all three hosts (through the store)."""
    names = job.hosts.names
    s = tmp_path / "usr1.py"
    s.write_text(
        textwrap.dedent("""
        import os, signal, socket, time
        import procgroup as dist
        dist.init_process_group()
        signal.signal(signal.SIGUSR1, lambda *a: print(f"usr1 rank={dist.get_rank()}", flush=True))
        dist.barrier()
        print(f"pid={os.getpid()} rank={dist.get_rank()} host={socket.gethostname()}", flush=True)
        time.sleep(120)
    """)
    )
    env = clean_env({"PROCGROUP_SECRET": "usr1-relay"})
    procs = _per_node(job, names, [str(s)], env, tmp_path)
    pids, _ = _collect_pids(procs, len(names) * PER_NODE, timeout=90, raising=False)
    os.kill(procs[2].p.pid, signal.SIGUSR1)
    end = time.monotonic() + 15
    got: Dict[int, int] = {}
    while len(got) < len(pids) and time.monotonic() < end:
        got = {}
        for p in procs:
            for ln in list(p.out):
                m = re.search(r"usr1 rank=(\d+)", ln)
                if m:
                    got[int(m.group(1))] = got.get(int(m.group(1)), 0) + 1
        time.sleep(0.05)
    assert sorted(got) == sorted(pids), f"SIGUSR1 reached ranks {sorted(got)}\n{job.text()}"
    assert all(alive(p) for p in pids.values()), "SIGUSR1 must not stop anything"
    for p in procs:
        os.kill(p.p.pid, signal.SIGTERM)
    assert all(p.wait(30) is not None for p in procs), job.text()
    assert not job.leftovers(grace=5.0), job.text()


def _link(host_index: int, up: bool) -> None:
    """Take host ``host_index``'s switch port (``v{K}`` in the bridge namespace ``hsw``) down or up: a silent
    link, no FIN and no RST, as a pulled cable."""
    subprocess.run(
        ["ip", "-n", "hsw", "link", "set", f"v{host_index}", "up" if up else "down"],
        check=True,
        capture_output=True,
        timeout=10,
    )


def test_per_node_mode_a_silent_link_is_found_by_the_heartbeat(job: Job, tmp_path: Path) -> None:
    """h2's switch port goes down: no connection closes, so the heartbeat limit (default 2.5 s) decides."""
    names = job.hosts.names
    env = clean_env({"PROCGROUP_SECRET": "silent-link"})
    procs = _per_node(job, names, [_sleeper(tmp_path)], env, tmp_path)
    pids, _ = _collect_pids(procs, len(names) * PER_NODE, timeout=90, raising=False)
    survivors = [procs[0], procs[2]]
    t0 = time.time()
    _link(2, up=False)
    try:
        stops = _stop_times(survivors, t0, len(survivors), timeout=TEARDOWN_BOUND + 10)
        gone = _gone_after({r: p for r, p in pids.items() if r // PER_NODE != 1}, t0, timeout=TEARDOWN_BOUND + 10)
        rcs = [p.wait(30) for p in survivors]
    finally:
        _link(2, up=True)  # h2's agent then gets a reset from h1 and stops its own workers
    why = STOP.search(next(ln for ln in survivors[0].err if STOP.search(ln))).group(1)  # type: ignore[union-attr]
    _report("per-node", 1, max(stops), gone, why[:90], event="link down (switch port)")
    assert all(rc == 1 for rc in rcs), f"exit statuses {rcs}\n{job.text()}"
    assert "node 1 (h2" in why and "no heartbeat for 2.5s" in why, why
    assert max(stops) < DETECT_BOUND and gone < TEARDOWN_BOUND, f"detect {max(stops):.2f}s, teardown {gone:.2f}s"
    assert procs[1].wait(90) is not None, procs[1].text()
    assert not job.leftovers(grace=10.0), job.text()
