"""procfs: every /proc read of procgroup, against this process and a child."""

import os
import socket
import subprocess
import sys

import pytest

from procgroup import procfs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_stat_of_self_names_parent_and_group():
    st = procfs.stat(os.getpid())
    assert st is not None
    assert st.ppid == os.getppid() and st.pgid == os.getpgid(0)
    assert st.state in "RS" and st.starttime > 0 and st.rss_pages > 0


def test_dead_and_zombie_children_are_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = 200
    while procfs.stat(p.pid) and procfs.stat(p.pid).state != "Z" and deadline:
        deadline -= 1
        os.sched_yield() if hasattr(os, "sched_yield") else None
        import time

        time.sleep(0.01)
    assert not procfs.pid_alive(p.pid)  # a zombie is not alive
    p.wait()
    assert not procfs.pid_alive(p.pid) and procfs.stat(p.pid) is None
    assert procfs.pid_alive(os.getpid())


def test_cmdline_and_table():
    assert "pytest" in procfs.cmdline(os.getpid()) or "python" in procfs.cmdline(os.getpid())
    assert len(procfs.cmdline(os.getpid(), limit=10)) <= 10
    assert procfs.cmdline(2**22 + 12345) == "?"
    table = procfs.proc_table()
    assert table[os.getpid()][1] == os.getppid()


def test_host_identity_pieces():
    assert procfs.boot_id()
    assert procfs.namespace_inode("net") == os.stat("/proc/self/ns/net").st_ino
    assert procfs.namespace_inode("nope") is None


def test_port_holder_is_this_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert procfs.port_holder_pid(s.getsockname()[1]) == os.getpid()


def test_machine_figures():
    busy, total = procfs.cpu_jiffies()
    assert 0 <= busy <= total
    assert procfs.mem_total_gib() > 0


def test_argv_session_namespace_members_and_load():
    assert procfs.argv(os.getpid())[0].endswith(("python", "python3")) or "python" in procfs.argv(os.getpid())[0]
    assert procfs.argv(2**22 + 12345) == []
    assert procfs.stat(os.getpid()).session == os.getsid(0)
    mine = procfs.namespace_inode("net")
    members = procfs.pids_in_namespace("net", {mine})
    assert os.getpid() in members and os.getppid() in members
    assert procfs.pids_in_namespace("net", set()) == set()
    assert len(procfs.loadavg()) == 3


def test_status_fields_in_bytes():
    got = procfs.status_fields()
    assert got["VmRSS"] >= got["RssAnon"] > 0 and got["VmRSS"] % 1024 == 0
    assert procfs.status_fields(str(2**22 + 12345)) == {}
