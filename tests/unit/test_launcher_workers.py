"""procgroup.launcher.workers: the /proc scan the agent's teardown relies on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from procgroup.launcher.workers import proc_table, reap_adopted_zombies, scan_leftovers


def test_scan_leftovers_from_a_given_table():
    agent = 500
    table = {
        agent: ("S", 1, agent),
        501: ("S", agent, 501),  # a worker
        502: ("S", 501, 501),  # its child
        503: ("Z", agent, 503),  # an exited (zombie) child: not left over
        504: ("S", 1, 504),  # someone else's
        505: ("S", 504, 504),
    }
    assert [p.pid for p in scan_leftovers(agent, table=table)] == [501, 502]
    assert [p.pid for p in scan_leftovers(agent, exclude=[502], table=table)] == [501]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_one_table_answers_reap_and_scan():
    """A live grandchild is found and an exited child is not, from a single read of /proc."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)",
        ],
    )
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the child has started its grandchild
            if any(p.ppid == child.pid for p in scan_leftovers(os.getpid())):
                break
            time.sleep(0.05)
        done.wait()
        table = proc_table()
        assert table[os.getpid()][1] == os.getppid()
        reap_adopted_zombies(os.getpid(), [child.pid, done.pid], table)  # nothing adopted: a no-op
        found = scan_leftovers(os.getpid(), table=table)
        assert child.pid in {p.pid for p in found} and done.pid not in {p.pid for p in found}
        assert any(p.ppid == child.pid for p in found)  # the grandchild too
    finally:
        for p in scan_leftovers(os.getpid()):
            if p.pid == child.pid or p.ppid == child.pid:  # only what this test started
                try:
                    os.kill(p.pid, 9)
                except ProcessLookupError:
                    pass
        child.wait()
