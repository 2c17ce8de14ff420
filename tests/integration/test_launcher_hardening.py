"""Issue 11 hardening of ``procgroup run`` with real processes: root-cause labels, absurd worker counts,
signals during a slow spawn.  Reuses the ``Launch`` harness of :mod:`tests.integration.test_launcher`."""

from __future__ import annotations

import re

import pytest

from tests.integration import test_launcher as _tl
from tests.integration.test_launcher import assert_gone, script

launch, workdir = _tl.launch, _tl.workdir  # the fixtures

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
