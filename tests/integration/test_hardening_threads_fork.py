"""Issue 11 items 2, 3 and 11 with real processes: a SIGSTOPped rank and a broken group, fork() after init,
and one group used from two threads at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from procgroup.netutil import free_port

from .harness import worker_env

pytestmark = pytest.mark.timeout(90)


def _spawn(tmp_path: Path, body: str, n: int, extra: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(body))
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, str(path), str(tmp_path)],
            env=worker_env(r, n, port, "hardthr-test-secret", extra),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]


def _collect(procs: List[subprocess.Popen], timeout: float) -> List[subprocess.CompletedProcess]:
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
    return out


def _report(res: List[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- rank {r} rc={p.returncode}\n{p.stdout}\n{p.stderr}" for r, p in enumerate(res))


def _records(p: subprocess.CompletedProcess) -> List[dict]:
    return [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("REC ")]


def _no_shm_left(run_id: str) -> None:
    """No /dev/shm segment of the job (its run id is in every segment's name; other tests' jobs may run beside it)."""
    left = [f for f in os.listdir("/dev/shm") if run_id in f]
    assert not left, f"shared memory segments left behind: {sorted(left)}"


# -- item 11: a SIGSTOPped rank ---------------------------------------------------------------------------
SIGSTOP_BODY = """
import json, os, sys, time
import numpy as np
import procgroup as dist

flag = os.path.join(sys.argv[1], "cont")
dist.init_process_group("cpu")
r = dist.get_rank()
x = np.ones(4, dtype=np.float32)
first = None
t0 = time.monotonic()
while first is None:
    try:
        x[:] = 1
        dist.all_reduce(x, timeout=3)
        assert x[0] == 3, x
    except dist.ProcGroupError as e:
        first = e
    if r == 0 and time.monotonic() - t0 > 1.5 and not os.path.exists(flag + ".ready"):
        open(flag + ".ready", "w").close()
print("REC " + json.dumps({"kind": "first", "type": type(first).__name__, "msg": str(first)}), flush=True)
open(flag + f".first{r}", "w").close()  # the test resumes rank 2 once ranks 0 and 1 have their errors
while not os.path.exists(flag):
    time.sleep(0.01)
t = time.monotonic()
try:
    dist.all_reduce(x, timeout=3)
    rec = {"kind": "next", "type": None, "dt": time.monotonic() - t}
except dist.ProcGroupError as e:
    rec = {"kind": "next", "type": type(e).__name__, "msg": str(e), "dt": time.monotonic() - t}
print("REC " + json.dumps(rec), flush=True)
if r == 2:
    open(flag + ".done2", "w").close()
while not os.path.exists(flag + ".done2"):  # stay alive until rank 2 has seen the group break
    time.sleep(0.01)
dist.destroy_process_group()
"""


def test_sigstopped_rank_is_named_with_its_real_seq_and_the_group_is_broken_after(tmp_path):
    procs = _spawn(tmp_path, SIGSTOP_BODY, 3)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "cont.ready").exists():
            assert time.monotonic() < deadline, "the ranks never got going"
            time.sleep(0.05)
        os.kill(procs[2].pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        while not all((tmp_path / f"cont.first{r}").exists() for r in (0, 1)):  # they hit their 3 s deadline
            assert time.monotonic() < t_stop + 30, "ranks 0 and 1 never reported rank 2"
            time.sleep(0.05)
        os.kill(procs[2].pid, signal.SIGCONT)
        (tmp_path / "cont").write_text("")
        res = _collect(procs, 40)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
    assert time.monotonic() - t_stop < 50
    assert all(p.returncode == 0 for p in res), _report(res)
    for r in (0, 1):
        first, nxt = _records(res[r])
        assert first["type"] == "DistTimeoutError", _report(res)
        msg = first["msg"]
        seq = int(msg.split("(seq ")[1].split(")")[0])
        about2 = msg.split("Roll call:")[1].split("rank 2 ", 1)[1].split(";")[0]
        assert f"seq {seq}" in about2 and "stopped updating its status" in about2, msg
        assert "not in a collective" not in about2, msg
        assert f"ranks [{1 - r}] reached seq {seq}; rank {r} " not in msg, msg  # this rank is in seq too
        assert nxt["type"] == "GroupBrokenError" and nxt["dt"] < 0.05, _report(res)
        assert f"(seq {seq})" in nxt["msg"] and "destroy_process_group" in nxt["msg"], nxt["msg"]
    first, nxt = _records(res[2])
    assert first["type"] in ("DistTimeoutError", "GroupBrokenError"), _report(res)
    assert nxt["type"] == "GroupBrokenError" and nxt["dt"] < 0.05, _report(res)


# -- item 3: fork() after init -------------------------------------------------------------------------------
FORK_BODY = """
import json, multiprocessing, os, sys, time
import numpy as np
import procgroup as dist


def square(v):
    return v * v


dist.init_process_group("cpu")
r = dist.get_rank()
x = np.full(2, r + 1, dtype=np.float32)
dist.all_reduce(x)
assert x.tolist() == [3, 3], x

# a child that runs one all_reduce: it must raise, and the parent's next all_reduce must be right
pid = os.fork()
if pid == 0:
    t = time.monotonic()
    try:
        dist.all_reduce(np.ones(2, dtype=np.float32), timeout=5)
        rec = {"kind": "child", "type": None}
    except Exception as e:
        rec = {"kind": "child", "type": type(e).__name__, "msg": str(e), "dt": time.monotonic() - t}
    print("REC " + json.dumps(rec), flush=True)
    sys.exit(0)  # runs atexit: must not tear the parent's world down
os.waitpid(pid, 0)
x[:] = r + 1
dist.all_reduce(x, timeout=10)
print("REC " + json.dumps({"kind": "after_child", "value": x.tolist()}), flush=True)

# a child that only exits: the parent's rank must not be reported dead
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
time.sleep(1.5)  # a watchdog interval or two: a failure record would abort the next call
x[:] = r + 1
dist.all_reduce(x, timeout=10)
dist.barrier(timeout=10)
print("REC " + json.dumps({"kind": "after_exit", "value": x.tolist()}), flush=True)

# a Pool whose workers never touch procgroup keeps working
with multiprocessing.get_context("fork").Pool(2) as pool:
    got = pool.map(square, range(6))
print("REC " + json.dumps({"kind": "pool", "value": got}), flush=True)

# a child may make a group of its own after init in the parent (here a world of one, on a file store)
pid = os.fork()
if pid == 0:
    dist.init_process_group("cpu", init_method="file://" + os.path.join(sys.argv[1], f"child{r}"), rank=0, world_size=1)
    y = np.ones(2)
    dist.all_reduce(y)
    dist.destroy_process_group()
    os._exit(0 if y.tolist() == [1, 1] else 3)
_, status = os.waitpid(pid, 0)
print("REC " + json.dumps({"kind": "child_init", "status": status}), flush=True)
x[:] = r + 1
dist.all_reduce(x, timeout=10)
assert x.tolist() == [3, 3], x
dist.destroy_process_group()
"""


def test_fork_after_init_child_raises_and_parent_stays_correct(tmp_path):
    run_id = f"hardthr-fork-{os.urandom(4).hex()}"  # names the job's segments, and the children's groups'
    res = _collect(_spawn(tmp_path, FORK_BODY, 2, {"PROCGROUP_RUN_ID": run_id}), 60)
    assert all(p.returncode == 0 for p in res), _report(res)
    for p in res:
        recs = {rec["kind"]: rec for rec in _records(p)}
        child = recs["child"]
        assert child["type"] == "ForkedProcessError", _report(res)
        assert "this process was forked after init_process_group" in child["msg"], child["msg"]
        assert child["dt"] < 0.01, child
        assert recs["after_child"]["value"] == [3, 3], _report(res)
        assert recs["after_exit"]["value"] == [3, 3], _report(res)
        assert recs["pool"]["value"] == [0, 1, 4, 9, 16, 25], _report(res)
        assert recs["child_init"]["status"] == 0, _report(res)
        assert "died" not in p.stderr and "PeerFailure" not in p.stderr, _report(res)
    _no_shm_left(run_id)


# -- item 2: one group, two threads ----------------------------------------------------------------------
THREADS_BODY = """
import json, sys, threading, time
import numpy as np
import procgroup as dist

dist.init_process_group("cpu")
r = dist.get_rank()
out = {}


def work(name, value, delay):
    time.sleep(delay)
    x = np.full(2, value, dtype=np.float32)
    t = time.monotonic()
    try:
        dist.all_reduce(x, timeout=20)
        out[name] = {"value": x.tolist()}
    except dist.ProcGroupError as e:
        out[name] = {"type": type(e).__name__, "msg": str(e), "dt": time.monotonic() - t}


seq_before = dist.group.WORLD.seq
# worker-A is inside the all_reduce on ranks 0 and 1 (rank 2 joins after 1.5 s) when worker-B calls
if r == 2:
    threads = [threading.Thread(target=work, args=(1, 1, 1.5), name="worker-A")]
else:
    threads = [
        threading.Thread(target=work, args=(1, 1, 0.0), name="worker-A"),
        threading.Thread(target=work, args=(2, 1000, 0.5), name="worker-B"),
    ]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("REC " + json.dumps({"kind": "threads", "out": out, "seqs": dist.group.WORLD.seq - seq_before}), flush=True)
x = np.full(2, r + 1, dtype=np.float32)
dist.all_reduce(x, timeout=20)  # the group is still in step
print("REC " + json.dumps({"kind": "after", "value": x.tolist()}), flush=True)
dist.destroy_process_group()
"""


def test_two_threads_on_one_group_second_gets_error_naming_both(tmp_path):
    res = _collect(_spawn(tmp_path, THREADS_BODY, 3), 60)
    assert all(p.returncode == 0 for p in res), _report(res)
    for r, p in enumerate(res):
        recs = {rec["kind"]: rec for rec in _records(p)}
        out = recs["threads"]["out"]
        assert out["1"] == {"value": [3.0, 3.0]}, _report(res)
        if r < 2:
            b = out["2"]
            assert b.get("type") == "ConcurrentUseError", _report(res)
            assert "'worker-B'" in b["msg"] and "'worker-A'" in b["msg"] and "all_reduce (seq" in b["msg"], b
            assert b["dt"] < 0.01, b
        assert recs["threads"]["seqs"] == 1, _report(res)  # the refused call took no sequence number
        assert recs["after"]["value"] == [6.0, 6.0], _report(res)


HOME_BODY = """
import json, threading, time
import numpy as np
import procgroup as dist

dist.init_process_group("cpu")
r = dist.get_rank()
x = np.ones(1, dtype=np.float32)
for _ in range(3):
    dist.all_reduce(x)  # planned from here on: the home thread's calls take ProcessGroup.run_plan
out = {}


def other():
    time.sleep(0.3)  # the home thread is inside its planned all_reduce (rank 1 joins after 1.5 s)
    t = time.monotonic()
    try:
        dist.barrier()
        out["msg"] = "no error"
    except dist.ProcGroupError as e:
        out.update(type=type(e).__name__, msg=str(e), dt=time.monotonic() - t)


th = threading.Thread(target=other, name="worker-B")
if r == 0:
    th.start()
else:
    time.sleep(1.5)
x[:] = 1
seq = dist.group.WORLD.seq
dist.all_reduce(x)
if r == 0:
    th.join()
seqs = dist.group.WORLD.seq - seq
print("REC " + json.dumps({"kind": "home", "out": out, "value": x.tolist(), "seqs": seqs}), flush=True)
dist.destroy_process_group()
"""


def test_a_thread_beside_the_home_threads_planned_call_gets_an_error_naming_both(tmp_path):
    """run_plan (a planned call of the home thread) leaves the owner unset: the error still names the home thread."""
    res = _collect(_spawn(tmp_path, HOME_BODY, 2), 60)
    assert all(p.returncode == 0 for p in res), _report(res)
    for r, p in enumerate(res):
        rec = {rec["kind"]: rec for rec in _records(p)}["home"]
        assert rec["value"] == [2.0] and rec["seqs"] == 1, _report(res)
        if r == 0:
            b = rec["out"]
            assert b.get("type") == "ConcurrentUseError", b
            assert "'worker-B'" in b["msg"] and "'MainThread'" in b["msg"] and "all_reduce (seq" in b["msg"], b
            assert b["dt"] < 0.01, b


RACE_BODY = """
import json, threading
import numpy as np
import procgroup as dist

dist.init_process_group("cpu")
out = {}
go = threading.Barrier(2)


def work(name, value):
    x = np.full(2, value, dtype=np.float32)
    go.wait()
    for i in range(3):
        try:
            x[:] = value
            dist.all_reduce(x, timeout=8)
            out.setdefault(name, []).append(x.tolist())
        except dist.ProcGroupError as e:
            out.setdefault(name, []).append(type(e).__name__)


threads = [threading.Thread(target=work, args=(n, v), name=n) for n, v in (("A", 1), ("B", 1000))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("REC " + json.dumps({"kind": "race", "out": out}), flush=True)
dist.destroy_process_group()
"""


def test_two_threads_racing_on_one_group_never_give_a_wrong_sum(tmp_path):
    res = _collect(_spawn(tmp_path, RACE_BODY, 2, {"PROCGROUP_TIMEOUT": "10"}), 80)
    assert all(p.returncode == 0 for p in res), _report(res)
    for p in res:
        (rec,) = _records(p)
        for name, want in (("A", [2.0, 2.0]), ("B", [2000.0, 2000.0])):
            for got in rec["out"][name]:
                assert got == want or isinstance(got, str), _report(res)  # a right sum or an error, never 1001
