"""Fault injection under the real launcher: one of 4 ranks dies by SIGKILL in a loop of collectives.

``procgroup run --standalone --nproc-per-node 4 fault_workers/kill_loop.py SEED``, 22 times (seeds
0..21, shm for even seeds and tcp for odd ones).  The seed picks the victim (any rank, rank 0 -- the
store's host -- included), the mode (SIGKILL between two collectives, or from a timer thread, usually
mid-collective) and the moment; the plan is printed by the worker and by the test.  Each run checks:

* every surviving rank raises PeerFailureError naming the killed rank (``e.peer`` and the message)
  within 5 s of the kill (wall clock of the ``KILL`` line vs. the ``DETECTED`` line, same machine);
* ``procgroup run`` exits non-zero and its root-cause block names the killed rank and ``signal SIGKILL``;
* no process of the job is left (the launcher's and every worker's pid, recorded from their output);
* no /dev/shm segment of the job is left (listing before / after, the job's run id).

The detection times of all runs are summarised at the end of the session (``fault injection: ...``).

Deterministic scenarios (``fault_workers/scenarios.py``) pin down the failures the loop can only
hit by chance; see each test's docstring.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from procgroup.netutil import free_port

from .harness import ROOT, collect, worker_env

FAULT = Path(__file__).with_name("fault_workers")
KILL_LOOP = FAULT / "kill_loop.py"
SCENARIOS = FAULT / "scenarios.py"
SEEDS = list(range(22))
DETECT_LIMIT = 5.0

#: detection delays (s) of every survivor of every run, for the summary
DELAYS: List[float] = []


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    if not DELAYS:
        return
    d = sorted(DELAYS)
    line = (
        f"fault injection: {len(d)} detections: min {d[0]:.3f}s, median {statistics.median(d):.3f}s, "
        f"max {d[-1]:.3f}s (limit {DETECT_LIMIT}s)"
    )
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("")
        tr.write_line(line)
    else:  # pragma: no cover
        print(line)


def _shm_listing() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _alive(pid: int, marker: str) -> Optional[str]:
    """'<state> <cmdline>' when ``pid`` is still a process of ours (cmdline contains ``marker``), else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return f"{state} {cmd}" if marker in cmd or not cmd else None


def _launch(program: Path, args: List[str], transport: str, run_id: str, timeout: float = 90.0):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        PROCGROUP_TRANSPORT=transport,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PROCGROUP_RUN_ID",
        "PROCGROUP_SECRET",
        "PROCGROUP_STORE_HOSTED",
    ):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "procgroup",
        "run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--run-id",
        run_id,
        "--term-timeout",
        "8",
        str(program),
        *args,
    ]
    p = subprocess.Popen(
        cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the workers die with it (PR_SET_PDEATHSIG)
        out, _ = p.communicate()
        out += f"\n[test] procgroup run killed after {timeout}s"
    return p, out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.timeout(120)
def test_sigkill_in_collective_loop(seed: int) -> None:
    transport = "shm" if seed % 2 == 0 else "tcp"
    run_id = f"fi{seed}x{secrets.token_hex(3)}"
    before = _shm_listing()
    launcher, out = _launch(KILL_LOOP, [str(seed)], transport, run_id)
    shm_left = sorted(n for n in _shm_listing() - before if run_id in n)

    m = re.search(r"^\[0\] PLAN victim=(\d) mode=(\w+) at=(\d+) delay=([\d.]+)", out, re.M)
    assert m, out
    victim = int(m.group(1))
    plan = (
        f"seed {seed} transport {transport}: victim rank {victim}, mode {m.group(2)}, at op {m.group(3)}, "
        f"delay {m.group(4)}s"
    )
    print(plan)
    ctx = f"{plan}\n{out}"
    pids: Dict[int, int] = {int(a): int(b) for a, b in re.findall(r"^\[\d\] PID (\d) (\d+)$", out, re.M)}
    assert sorted(pids) == [0, 1, 2, 3], ctx
    k = re.search(rf"^\[{victim}\] KILL {victim} ([\d.]+)$", out, re.M)
    assert k, ctx
    t_kill = float(k.group(1))
    det = {
        int(r): (float(t), int(p) if p != "None" else None, typ, msg)
        for r, t, p, typ, msg in re.findall(r"^\[\d\] DETECTED (\d) ([\d.]+) [\d.]+ peer=(\w+) (\w+): (.*)$", out, re.M)
    }
    delays = {r: det[r][0] - t_kill for r in det}
    DELAYS.extend(delays.values())
    print("detection delays:", {r: round(d, 3) for r, d in sorted(delays.items())})

    # nothing of the job is left, whatever else went wrong
    assert launcher.returncode is not None
    time.sleep(0.2)
    left = {pid: st for pid in [launcher.pid, *pids.values()] if (st := _alive(pid, str(FAULT))) is not None}
    assert not left, f"processes of the job still alive after procgroup run exited: {left}\n{ctx}"
    assert not shm_left, f"/dev/shm segments of the job left behind: {shm_left}\n{ctx}"

    # the launcher failed, naming the killed rank and the signal as the root cause
    assert launcher.returncode != 0, ctx
    rc_line = re.search(r"^### Root cause: (.*)$", out, re.M)
    assert rc_line, ctx
    assert rc_line.group(1).startswith(f"rank {victim} ") and "signal SIGKILL" in rc_line.group(1), (
        f"root cause should be rank {victim} (signal SIGKILL), got {rc_line.group(1)!r}\n{ctx}"
    )

    # every survivor raised PeerFailureError naming the victim, within 5 s of the kill
    survivors = [r for r in range(4) if r != victim]
    assert sorted(det) == survivors, f"survivors that reported: {sorted(det)}\n{ctx}"
    for r in survivors:
        t, peer, typ, msg = det[r]
        assert typ == "PeerFailureError", ctx
        assert delays[r] < DETECT_LIMIT, f"rank {r} detected after {delays[r]:.2f}s\n{ctx}"
        assert peer == victim and f"rank {victim}" in msg, (
            f"rank {r} names rank {peer}, not the killed rank {victim}: {msg}\n{ctx}"
        )


# ------------------------------------------------------------------------------------------ scenarios
def _scenario(name: str, n: int, transport: str, timeout: float = 40.0):
    port, secret = free_port(), secrets.token_hex(16)
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCENARIOS), name],
            env=worker_env(r, n, port, secret, {"PROCGROUP_TRANSPORT": transport}),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    outs = [(r.returncode, r.stdout, r.stderr) for r in collect(procs, timeout)]
    results: Dict[int, Dict[str, str]] = {}
    for _, so, _ in outs:
        for line in so.splitlines():
            m = re.match(r"RESULT (\d+) (.*)$", line)
            if m:
                d = results.setdefault(int(m.group(1)), {})
                for kv in re.finditer(r"(\w+)=(.*?)(?= \w+=|$)", m.group(2)):
                    d[kv.group(1)] = kv.group(2)
    text = "\n".join(f"--- rank {r} rc={rc}\n{so}\n{se[-2000:]}" for r, (rc, so, se) in enumerate(outs))
    return results, text


@pytest.mark.timeout(60)
def test_store_host_killed_every_survivor_names_it() -> None:
    """Rank 0 (hosting the store) dies; rank 2 waits on rank 0, rank 1 only on rank 2.

    Rank 1 sees rank 2 leave, and with the store gone it cannot look up the first failure: it must still
    name rank 0.  (Known bug: it names rank 2, the survivor that left -- see the report.)
    """
    res, text = _scenario("store_host_dies", 3, "shm")
    assert res.get(2, {}).get("peer") == "0", text
    assert res.get(1, {}).get("type") == "PeerFailureError", text
    assert res[1].get("peer") == "0", f"rank 1 should name rank 0 (dead), it names rank {res[1].get('peer')}\n{text}"


@pytest.mark.timeout(60)
def test_p2p_chain_every_survivor_names_the_dead_rank() -> None:
    """Rank 3 dies; rank 2 is in recv from 3, rank 1 in recv from 2, rank 0 in recv from 1; the store is up.

    Every survivor must name rank 3.  (Known bug: a point-to-point failure is neither recorded in the store
    nor looked up there, so ranks 1 and 0 name the neighbour that left; and rank 0 then waits at exit
    for 'all_left' until its deadline.)
    """
    res, text = _scenario("p2p_chain", 4, "tcp")
    assert res.get(2, {}).get("peer") == "3", text
    for r in (1, 0):
        assert res.get(r, {}).get("type") == "PeerFailureError", text
        assert res[r].get("peer") == "3", (
            f"rank {r} should name rank 3 (dead), it names rank {res[r].get('peer')}\n{text}"
        )


@pytest.mark.timeout(60)
def test_store_host_leaves_promptly_after_a_peer_failure() -> None:
    """Rank 1 dies; rank 0 (hosting the store) catches the error and calls destroy_process_group().

    No other rank is connected any more, so leaving must not take the whole 5 s linger.  (Known bug:
    ``api._linger`` counts rank 0's own two store connections, so it always waits the full grace.)
    """
    res, text = _scenario("host_exit_after_failure", 2, "shm")
    assert res.get(0, {}).get("type") == "PeerFailureError" and res[0].get("peer") == "1", text
    assert float(res[0]["destroy"]) < 2.5, f"destroy_process_group took {res[0]['destroy']}s on rank 0\n{text}"


def test_root_cause_is_the_killed_rank_not_a_faster_survivor() -> None:
    """The launcher's report, on the data of a real run: rank 0 was SIGKILLed; rank 1 raised PeerFailureError
    (naming rank 0) 30 ms later, but the agent reaped rank 0 only 60 ms after the kill (a loaded host).

    The root cause must be rank 0 (signal SIGKILL).  (Known bug: the report sorts failures by time, and a
    signal death's time is when the agent *noticed* it, so the survivor's error-file time comes first.)
    """
    from procgroup.launcher.report import RunResult, WorkerResult, format_root_cause

    t = 1_000_000.0
    err = {
        "rank": 1,
        "exc_type": "procgroup.errors.PeerFailureError",
        "timestamp": t + 0.03,
        "traceback": "...",
        "message": "all_to_all (seq 182) in group WORLD on rank 1 after 0.03s [all_to_all(int16)]: rank 1: recv "
        "from rank 0 (tag 7) cannot complete: rank 0 at 127.0.0.1:5 closed the connection",
    }
    workers = (
        WorkerResult(rank=0, local_rank=0, host="h", pid=10, returncode=-9, start_time=t - 2, end_time=t + 0.06),
        WorkerResult(
            rank=1,
            local_rank=1,
            host="h",
            pid=11,
            returncode=-15,
            start_time=t - 2,
            end_time=t + 0.3,
            signaled_by_agent=15,
            signaled_at=t + 0.07,
            error=err,
        ),
        WorkerResult(
            rank=2,
            local_rank=2,
            host="h",
            pid=12,
            returncode=-15,
            start_time=t - 2,
            end_time=t + 0.3,
            signaled_by_agent=15,
            signaled_at=t + 0.07,
        ),
    )
    run = RunResult(workers=workers, run_id="x", host="h")
    assert run.root_cause is not None
    assert run.root_cause.rank == 0, format_root_cause(run)
    assert run.exit_code == 137
