"""Issue 11 hardening of ``procgroup run`` with real processes: root-cause labels, absurd worker counts,
signals during a slow spawn.  Reuses the ``Launch`` harness of :mod:`tests.integration.test_launcher`."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from procgroup import procfs
from tests.integration import test_launcher as _tl
from tests.integration.test_launcher import assert_gone, script

launch, workdir = _tl.launch, _tl.workdir  # the fixtures
#: Python's and the launcher's own start-up, which the 1 s bound does not count (a loaded CI machine)
_STARTUP_SLACK = 2.0

pytestmark = pytest.mark.timeout(60)


def test_root_cause_is_the_workers_own_error_not_the_teardown_signal(launch, workdir):  # type: ignore[no-untyped-def]
    # rank 0 raises, then hangs while exiting; rank 1's exit makes the launcher SIGTERM it
    s = script(
        workdir,
        "raise_slow_exit.py",
        """
        import atexit, os, sys, time
        rank = int(os.environ["RANK"])
        print(f"pid={os.getpid()}", flush=True)
        if rank == 0:
            atexit.register(time.sleep, 60)
            raise ValueError("bad value on rank 0")
        time.sleep(0.5)
        sys.exit(3)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "2", s)
    ln.wait_lines(r"pid=(?P<pid>\d+)", 2)
    rc = ln.finish()
    assert rc == 1, ln.text()
    head = [x for x in ln.stderr_lines if x.startswith("### Root cause")]
    assert head and head[0].startswith("### Root cause: rank 0 (local 0)"), ln.text()
    assert "raised ValueError, then stopped while exiting by the launcher's SIGTERM" in head[0], head[0]
    assert not re.search(r"signal SIGTERM$", head[0]), head[0]
    assert_gone(ln.pids)


def test_omp_banner_is_one_line_in_our_words(launch, workdir, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    s = script(workdir, "omp.py", "import os\nprint('omp=' + os.environ['OMP_NUM_THREADS'], flush=True)\n")
    ln = launch("--standalone", "--nproc-per-node", "2", s)
    assert ln.finish() == 0, ln.text()
    lines = [x for x in ln.stdout_lines + ln.stderr_lines if "OMP_NUM_THREADS" in x]
    assert len(lines) == 1, ln.text()
    assert "export OMP_NUM_THREADS" in lines[0] and "*****" not in ln.text(), ln.text()
    assert "please further tune" not in ln.text()


# --------------------------------------------------------------------------- absurd counts, signals while spawning


def test_an_absurd_worker_count_is_refused_at_once(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(workdir, "never.py", "raise SystemExit('must not start')\n")
    t0 = time.monotonic()
    ln = launch("--standalone", "--nproc-per-node", "100000", s)
    rc = ln.finish()
    took = time.monotonic() - t0
    assert rc != 0 and took < 1.0 + _STARTUP_SLACK, (took, ln.text())
    err = ln.stderr
    assert "--nproc-per-node 100000" in err and "--oversubscribe" in err, err
    assert re.search(r"RLIMIT_NPROC|pid_max|workers per CPU", err), err
    assert "must not start" not in ln.text()


def _procs_with(marker: str) -> list[int]:
    out = []
    for pid in procfs.pids():
        if marker in procfs.cmdline(pid) and procfs.pid_alive(pid):
            out.append(pid)
    return out


def test_sigterm_while_spawning_ends_the_launcher_promptly(launch, workdir):  # type: ignore[no-untyped-def]
    marker = f"61.{os.getpid()}"  # `sleep 61.<pid>`: finds any worker left behind
    n = 300
    ln = launch(
        "--standalone", "--oversubscribe", "--no-python", "--nproc-per-node", str(n),
        "sh", "-c", f"echo pid=$$; exec sleep {marker}",
    )  # fmt: skip
    ln.wait_lines(r"pid=(?P<pid>\d+)", 1)
    t0 = time.monotonic()
    os.kill(ln.proc.pid, signal.SIGTERM)
    rc = ln.finish(timeout=60)
    took = time.monotonic() - t0
    assert rc == 128 + signal.SIGTERM, ln.text()
    assert took < 3.0, f"the launcher took {took:.2f}s to stop after SIGTERM:\n{ln.text()}"
    started = len(re.findall(r"terminated by launcher", ln.stderr))
    assert started < n, f"every worker was spawned before the signal was honoured ({started})"
    end = time.monotonic() + 3
    while _procs_with(marker) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _procs_with(marker), "workers left behind"


# --------------------------------------------------------------------------- per-node mode and the per-user secret


def _two_agents(launch, workdir, cfg0: str, cfg1: str):  # type: ignore[no-untyped-def]
    """Two `procgroup run --nnodes 2` agents on this host, with no PROCGROUP_SECRET and the given
    XDG_CONFIG_HOME each (where the per-user secret file lives)."""
    from procgroup.netutil import free_port

    s = script(workdir, "mn.py", "import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    common = ("--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(free_port()), "--join-timeout", "10")
    n1 = launch(*common, "--node-rank", "1", s, env={"XDG_CONFIG_HOME": cfg1})
    n0 = launch(*common, "--node-rank", "0", s, env={"XDG_CONFIG_HOME": cfg0})
    return n0, n1


def test_per_node_mode_agrees_via_the_user_secret_file(launch, workdir, tmp_path):  # type: ignore[no-untyped-def]
    cfg = str(tmp_path / "cfg")
    n0, n1 = _two_agents(launch, workdir, cfg, cfg)
    assert n0.finish() == 0, n0.text()
    assert n1.finish() == 0, n1.text()
    assert "2 worker(s) on 2 nodes" in n0.stderr, n0.text()
    f = tmp_path / "cfg" / "procgroup" / "secret"
    assert (f.stat().st_mode & 0o777) == 0o600


def test_per_node_mode_different_secret_files_named(launch, workdir, tmp_path):  # type: ignore[no-untyped-def]
    n0, n1 = _two_agents(launch, workdir, str(tmp_path / "a"), str(tmp_path / "b"))
    t0 = time.monotonic()
    rc1 = n1.finish(timeout=30)
    took = time.monotonic() - t0
    n0.kill()
    assert rc1 != 0, n1.text()
    assert f"the per-user secret file {tmp_path / 'b' / 'procgroup' / 'secret'}" in n1.stderr, n1.text()
    assert took < 10, took
