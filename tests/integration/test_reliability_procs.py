"""Mismatched collectives and deadlines across real processes: errors in seconds, naming both sides."""

from __future__ import annotations

import pytest

from .harness import collect, report, spawn_world


@pytest.mark.parametrize(
    "kind, calls",
    [
        ("op", ["all_reduce(float32, 4, SUM)", "broadcast(float32, 4, root=0)"]),
        ("dtype", ["all_reduce(float32, 4, SUM)", "all_reduce(float64, 4, SUM)"]),
        ("shape", ["all_reduce(float32, 4, SUM)", "all_reduce(float32, 8, SUM)"]),
        ("root", ["broadcast(float32, 4, root=0)", "broadcast(float32, 4, root=1)"]),
        ("roots", ["broadcast(float32, 4, root=0)", "broadcast(float32, 4, root=1)"]),
    ],
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.timeout(60)
def test_mismatched_collectives_raise_on_every_rank(kind, calls, transport):
    results = collect(spawn_world(2, "mismatch", [kind], env={"PROCGROUP_TRANSPORT": transport}), 45)
    for r in results:
        assert r.returncode == 3, report(results)
        assert "collective mismatch in group WORLD at seq" in r.stdout, report(results)
        for c in calls:
            assert c in r.stdout, report(results)
        secs = float(r.stdout.split("mismatch after ")[1].split("s")[0])
        assert secs < 10, report(results)


@pytest.mark.parametrize("kind", ["op", "dtype", "shape", "root", "roots"])
@pytest.mark.timeout(60)
def test_mismatch_is_found_when_every_call_runs_from_a_warm_plan(kind):
    """Issue 14 item 2: planned calls keep the fingerprint, chain and flight record the detection reads."""
    results = collect(spawn_world(2, "mismatch", [kind, "1"], env={"PROCGROUP_TRANSPORT": "shm"}), 45)
    for r in results:
        assert r.returncode == 3, report(results)
        assert "collective mismatch in group WORLD at seq" in r.stdout, report(results)
        secs = float(r.stdout.split("mismatch after ")[1].split("s")[0])
        assert secs < 10, report(results)


@pytest.mark.timeout(60)
def test_deadline_error_names_op_seq_and_roll_call():
    results = collect(spawn_world(2, "timeout_rollcall"), 45)
    r0 = results[0]
    assert r0.returncode == 4, report(results)
    out = r0.stdout
    assert "all_reduce (seq 1) in group WORLD on rank 0" in out, out
    assert "Roll call: ranks [0] reached seq 1" in out, out
    assert "rank 1 last completed seq 0" in out, out
    assert "PROCGROUP_TIMEOUT" in out, out


@pytest.mark.timeout(60)
def test_monitored_barrier_names_the_late_rank():
    results = collect(spawn_world(3, "monitored"), 45)
    for r in results[:2]:
        assert r.returncode == 5, report(results)
        assert "rank [2] did not reach monitored_barrier in group WORLD within 2.0s" in r.stdout, report(results)
    assert "(ranks [0, 1] did)" in results[0].stdout


@pytest.mark.timeout(60)
def test_sigusr1_dumps_stacks_and_flight_recorder(tmp_path):
    """Rank 1 holds rank 0 in an all_reduce until the dump that SIGUSR1 asks of rank 0 has come out (it slept
    5 s before; now the test reads rank 0's stderr up to the dump's last line, then lets rank 1 go)."""
    import os
    import signal
    import threading
    import time

    go = tmp_path / "go"
    procs = spawn_world(2, "stuck_for_dump", [str(go)])
    line = procs[0].stdout.readline()
    assert "ready pid" in line, line
    early = bytearray()  # rank 0's stderr up to the end of the dump: read raw, so collect() gets the rest
    dumped = threading.Event()

    def read_dump() -> None:
        fd = procs[0].stderr.fileno()
        while b"seq 1 all_reduce(float32, 4, SUM) running" not in early:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            early.extend(chunk)
        dumped.set()

    reader = threading.Thread(target=read_dump, daemon=True)
    reader.start()
    time.sleep(1.0)
    os.kill(procs[0].pid, signal.SIGUSR1)
    dumped.wait(20)
    go.write_text("")
    reader.join(40)
    results = collect(procs, 40)
    assert all(r.returncode == 0 for r in results), report(results)
    err = early.decode() + results[0].stderr
    assert "=== procgroup state: rank 0/2" in err, err
    assert "--- thread MainThread ---" in err and "stuck_for_dump" in err, err
    assert "seq 1 all_reduce(float32, 4, SUM) running" in err, err
    assert "seq 0 all_reduce(float32, 4, SUM) completed" in err, err


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.timeout(90)
def test_sigkilled_rank_is_named_by_every_survivor(transport):
    import re

    results = collect(spawn_world(4, "kill_loop", ["2", "25"], env={"PROCGROUP_TRANSPORT": transport}), 60)
    assert results[2].returncode == -9, report(results)
    for r in (0, 1, 3):
        res = results[r]
        assert res.returncode == 7, report(results)
        m = re.search(r"survivor \d: ([\d.]+)s (\w+): (.*)", res.stdout)
        assert m, report(results)
        assert float(m.group(1)) < 5.0, report(results)
        assert m.group(2) == "PeerFailureError", report(results)
        assert "rank 2" in m.group(3), report(results)
