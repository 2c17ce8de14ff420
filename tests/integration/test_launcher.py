"""``procgroup run`` with real processes.

Every test starts ``python -m procgroup run`` (PYTHONPATH=src), uses
--standalone unless it tests ports, and checks by pid that no process of the
job is left.  Worker scripts live in a directory with a space and a
non-ASCII character in its name.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"


def _alive(pid: int) -> bool:
    """Running (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


class Launch:
    """A running ``procgroup run`` whose output is read line by line in the background."""

    def __init__(
        self, args: list[str], cwd: Path, env: Optional[dict[str, str]] = None, cpus: Optional[list[int]] = None
    ) -> None:
        e = dict(os.environ)
        e["PYTHONPATH"] = str(SRC) + os.pathsep + e.get("PYTHONPATH", "")
        e.pop("PROCGROUP_SECRET", None)
        e.update(env or {})
        run = [sys.executable, "-m", "procgroup", "run"]
        if cpus is not None:  # the launcher itself bound to these CPUs, as srun or taskset would leave it
            bind = f"import os, sys; os.sched_setaffinity(0, {set(cpus)!r}); os.execv(sys.executable, sys.argv[1:])"
            run = [sys.executable, "-c", bind, *run]
        self.proc = subprocess.Popen(
            [*run, *args],
            cwd=str(cwd),
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.out: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout_lines, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr_lines, False), daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.pids: set[int] = set()

    def _read(self, pipe, into: list[str], notify: bool) -> None:  # type: ignore[no-untyped-def]
        for raw in pipe:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            into.append(line)
            if notify:
                self.out.put(line)
        if notify:
            self.out.put(None)

    def wait_lines(self, pattern: str, count: int, timeout: float = 10.0) -> list[re.Match]:
        """Wait for ``count`` stdout lines matching ``pattern``; records ``pid=N`` groups."""
        rx = re.compile(pattern)
        found: list[re.Match] = []
        end = time.monotonic() + timeout
        while len(found) < count:
            try:
                line = self.out.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            m = rx.search(line)
            if m:
                found.append(m)
                if "pid" in rx.groupindex:
                    self.pids.add(int(m.group("pid")))
        assert len(found) == count, f"saw {len(found)}/{count} lines matching {pattern!r}:\n{self.text()}"
        return found

    def finish(self, timeout: float = 15.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(5)
        return rc

    @property
    def stdout(self) -> str:
        return "\n".join(self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    def text(self) -> str:
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        for pid in self.pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "job dir é"
    d.mkdir()
    return d


@pytest.fixture
def launch(workdir: Path):  # type: ignore[no-untyped-def]
    started: list[Launch] = []

    def start(
        *args: str, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None, cpus: Optional[list[int]] = None
    ) -> Launch:
        ln = Launch(list(args), cwd or workdir, env, cpus)
        started.append(ln)
        return ln

    yield start
    for ln in started:
        ln.kill()


def script(d: Path, name: str, body: str) -> str:
    p = d / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def assert_gone(pids: set[int], within: float = 2.0) -> None:
    end = time.monotonic() + within
    left = {p for p in pids if _alive(p)}
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = {p for p in left if _alive(p)}
    assert not left, f"processes of the job still alive: {sorted(left)}"


# --------------------------------------------------------------------------- tests


def test_four_workers_get_the_env_contract(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "env.py",
        """
        import hashlib, os
        e = os.environ
        print("pid=%d" % os.getpid(), *(e[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "NODE_RANK", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_STORE_HOSTED",
              "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")),
              hashlib.sha256(e["PROCGROUP_SECRET"].encode()).hexdigest()[:12],
              e["PROCGROUP_ERROR_FILE"] == e["TORCHELASTIC_ERROR_FILE"])
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "4", s)
    rc = ln.finish()
    assert rc == 0, ln.text()
    lines = [l for l in ln.stdout_lines if l]
    assert len(lines) == 4, ln.text()
    seen = {}
    for line in lines:
        m = re.fullmatch(r"\[(\d)\] pid=(\d+) (.*)", line)
        assert m, line
        f = m.group(3).split()
        rank = int(m.group(1))
        assert f[:7] == [str(rank), str(rank), "4", "4", "0", "0", "default"], line
        assert f[7] == "127.0.0.1" and f[9:12] == ["0", "0", "1"] and f[13] == "True", line
        seen[rank] = (f[8], f[12])
        ln.pids.add(int(m.group(2)))
    assert sorted(seen) == [0, 1, 2, 3]
    assert len(set(seen.values())) == 1, "every rank must get the same port and secret"
    assert "succeeded" in ln.stderr and "exit code 0" in ln.stderr
    assert_gone(ln.pids)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind workers round-robin")
def test_workers_that_outnumber_the_cpus_are_bound_round_robin(launch, workdir):  # type: ignore[no-untyped-def]
    """--cpu-bind auto (the default): 3 workers on the launcher's 2 CPUs get one CPU each, round-robin; 2 workers,
    or --cpu-bind none / PROCGROUP_CPU_BIND=none, stay on both; an unknown mode is refused before anything starts."""
    two = sorted(os.sched_getaffinity(0))[-2:]  # the launcher gets these two, whatever this machine has
    s = script(workdir, "aff.py", "import os\nprint('pid=%d' % os.getpid(), sorted(os.sched_getaffinity(0)))\n")

    def cpus_of(*args: str, env: Optional[dict[str, str]] = None) -> tuple[dict[int, list[int]], str]:
        ln = launch("--standalone", *args, s, env=env, cpus=two)
        rc = ln.finish()
        assert rc == 0, ln.text()
        got = {}
        for line in ln.stdout_lines:
            m = re.fullmatch(r"\[(\d)\] pid=(\d+) \[([\d, ]+)\]", line)
            assert m, line
            got[int(m.group(1))] = [int(c) for c in m.group(3).split(",")]
        return got, ln.stderr

    got, err = cpus_of("--nproc-per-node", "3")
    assert got == {0: [two[0]], 1: [two[1]], 2: [two[0]]}, err
    assert "3 workers on this node's 2 CPUs: each bound to one, round-robin" in err
    got, err = cpus_of("--nproc-per-node", "2")
    assert got == {0: two, 1: two} and "bound" not in err
    got, err = cpus_of("--nproc-per-node", "3", "--cpu-bind", "none")
    assert got == {0: two, 1: two, 2: two} and "bound" not in err
    got, _ = cpus_of("--nproc-per-node", "3", env={"PROCGROUP_CPU_BIND": "none"})
    assert got == {0: two, 1: two, 2: two}
    ln = launch("--standalone", "--nproc-per-node", "3", s, env={"PROCGROUP_CPU_BIND": "cores"})
    assert ln.finish() != 0 and "PROCGROUP_CPU_BIND" in ln.stderr and not ln.stdout_lines, ln.text()


def test_script_args_argv_and_sys_path_pass_through(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "args.py",
        """
        import os, sys
        print(repr(sys.argv[1:]), __name__, sys.path[0] == os.path.dirname(os.path.realpath(__file__)),
              os.path.basename(sys.argv[0]))
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "1", s, "--nproc-per-node", "9", "-m", "x y", "--")
    assert ln.finish() == 0, ln.text()
    assert ln.stdout_lines == ["[0] ['--nproc-per-node', '9', '-m', 'x y', '--'] __main__ True args.py"], ln.text()


def test_module_mode(launch, workdir):  # type: ignore[no-untyped-def]
    pkg = workdir / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import os, sys\nprint('module', os.environ['RANK'], __name__, sys.argv[1:], sys.path[0] == os.getcwd())\n"
    )
    ln = launch("--standalone", "--nproc-per-node", "2", "-m", "mypkg", "--flag", "1")
    assert ln.finish() == 0, ln.text()
    assert sorted(ln.stdout_lines) == [
        "[0] module 0 __main__ ['--flag', '1'] True",
        "[1] module 1 __main__ ['--flag', '1'] True",
    ], ln.text()


def test_worker_exception_is_root_cause_and_peers_are_torn_down(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "fail.py",
        """
        import os, sys, time
        rank = int(os.environ["RANK"])
        print(f"pid={os.getpid()}", flush=True)
        def explode():
            raise ValueError(f"boom from rank {rank}")
        if rank == 2:
            time.sleep(0.3)
            explode()
        time.sleep(60)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "4", s)
    ln.wait_lines(r"pid=(?P<pid>\d+)", 4)
    t0 = time.monotonic()
    rc = ln.finish()
    assert time.monotonic() - t0 < 5.0, "teardown took too long"
    assert rc == 1, ln.text()
    err = ln.stderr
    block = err[err.index("### Root cause") :]
    assert block.startswith("### Root cause: rank 2 (local 2) on host "), block
    assert "exit code 1" in block.splitlines()[0]
    assert "in explode" in block and "ValueError: boom from rank 2" in block
    assert "bootstrap.py" not in block and "runpy" not in block, "launcher frames must be hidden"
    for r in (0, 1, 3):
        assert re.search(rf"rank {r} \(local {r}\) pid \d+: terminated by the launcher \(SIGTERM\)", block), block
    assert re.search(r"^\s+2 .*FAILED exit code 1\s+<- root cause", err, re.M), err
    assert_gone(ln.pids)


def test_worker_killed_by_sigkill_is_reported_as_signal(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "kill.py",
        """
        import os, signal, time
        print(f"pid={os.getpid()}", flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "3", s)
    ln.wait_lines(r"pid=(?P<pid>\d+)", 3)
    rc = ln.finish()
    assert rc == 128 + signal.SIGKILL, ln.text()
    assert re.search(r"### Root cause: rank 1 \(local 1\) on host \S+, pid \d+, signal SIGKILL", ln.stderr), ln.text()
    assert_gone(ln.pids)


def test_segfault_root_cause_shows_stderr_tail(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "segv.py",
        """
        import ctypes, os
        def crash_here():
            ctypes.string_at(0)
        if os.environ["RANK"] == "0":
            crash_here()
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "2", s)
    rc = ln.finish()
    assert rc == 128 + signal.SIGSEGV, ln.text()
    block = ln.stderr[ln.stderr.index("### Root cause") :]
    assert "signal SIGSEGV" in block.splitlines()[0]
    assert "of its stderr" in block and "crash_here" in block, block  # faulthandler's stack


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_tears_everything_down(launch, workdir, sig):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "sleep.py",
        """
        import os, time
        print(f"pid={os.getpid()}", flush=True)
        time.sleep(60)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "3", s)
    ln.wait_lines(r"pid=(?P<pid>\d+)", 3)
    t0 = time.monotonic()
    ln.proc.send_signal(sig)
    rc = ln.finish()
    assert time.monotonic() - t0 < 5.0
    assert rc == 128 + sig, ln.text()
    assert f"received {signal.Signals(sig).name}" in ln.stderr, ln.text()
    assert_gone(ln.pids)


def test_sigterm_ignored_then_sigkill_and_grandchildren_reaped(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "stubborn.py",
        """
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # one grandchild in the worker's group, one that escapes into its own session
        a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        b = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"])
        print(f"pid={os.getpid()}", f"pid={a.pid}", f"pid={b.pid}", flush=True)
        if os.environ["RANK"] == "0":
            time.sleep(0.5)
            sys.exit(3)
        time.sleep(60)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "2", "--term-timeout", "0.5", s)
    for m in ln.wait_lines(r"pid=(\d+) pid=(\d+) pid=(\d+)", 2):
        ln.pids.update(int(g) for g in m.groups())
    rc = ln.finish()
    assert rc == 3, ln.text()
    assert "leftover process" in ln.stderr, ln.text()
    assert "survived SIGKILL" not in ln.stderr, ln.text()
    assert_gone(ln.pids, within=0.5)


def test_workers_die_with_a_sigkilled_launcher(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "orphan.py",
        """
        import os, time
        print(f"pid={os.getpid()}", flush=True)
        time.sleep(60)
    """,
    )
    tmp = workdir / "tmp"
    tmp.mkdir()  # the killed launcher cannot remove its temporary directory: keep it inside tmp_path
    ln = launch("--standalone", "--nproc-per-node", "2", s, env={"TMPDIR": str(tmp)})
    ln.wait_lines(r"pid=(?P<pid>\d+)", 2)
    ln.proc.kill()  # no teardown possible: PR_SET_PDEATHSIG must do it
    ln.proc.wait(5)
    assert_gone(ln.pids, within=3.0)


def test_busy_port_is_an_error_naming_addr_port_and_holder(launch, workdir):  # type: ignore[no-untyped-def]
    marker = workdir / "started"
    s = script(workdir, "never.py", f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ln = launch("--nproc-per-node", "2", "--master-port", str(port), s)
        rc = ln.finish()
    assert rc == 1, ln.text()
    assert f"127.0.0.1:{port}" in ln.stderr and "already in use" in ln.stderr, ln.text()
    assert f"pid {os.getpid()}" in ln.stderr, "the message should name the process holding the port"
    assert not marker.exists(), "no worker may start when the port is taken"
    assert ln.stdout == ""


def test_log_dir_one_file_per_rank(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "logs.py",
        """
        import os, sys
        print("out of", os.environ["RANK"])
        print("err of", os.environ["RANK"], file=sys.stderr)
    """,
    )
    logs = workdir / "logs"
    ln = launch("--standalone", "--nproc-per-node", "3", "--log-dir", str(logs), s)
    assert ln.finish() == 0, ln.text()
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log", "rank2.log"]
    for r in range(3):
        assert sorted((logs / f"rank{r}.log").read_text().splitlines()) == [f"err of {r}", f"out of {r}"]
    assert "out of" not in ln.stdout and "err of" not in ln.stderr, "without --tee logs stay off the console"


def test_ranks_filter_and_prefix_format(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(workdir, "hi.py", "import os; print('hi', os.environ['RANK'])\n")
    ln = launch(
        "--standalone", "--nproc-per-node", "4", "--ranks-filter", "0,3", "--prefix-format", "<{rank}/{world_size}> ", s
    )
    assert ln.finish() == 0, ln.text()
    assert sorted(ln.stdout_lines) == ["<0/4> hi 0", "<3/4> hi 3"], ln.text()


def test_gang_restart_increments_restart_count(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "flaky.py",
        """
        import os, sys
        n = os.environ["PROCGROUP_RESTART_COUNT"]
        assert n == os.environ["TORCHELASTIC_RESTART_COUNT"]
        print("attempt", n, "rank", os.environ["RANK"])
        if n == "0" and os.environ["RANK"] == "1":
            raise RuntimeError("first attempt fails")
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "2", s)
    assert ln.finish() == 0, ln.text()
    assert "restarting all 2 workers (restart 1 of max 2)" in ln.stderr, ln.text()
    assert "[0] attempt 1 rank 0" in ln.stdout_lines and "[1] attempt 1 rank 1" in ln.stdout_lines


def test_no_python_runs_an_executable(launch, workdir):  # type: ignore[no-untyped-def]
    ln = launch("--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "sh $RANK of $WORLD_SIZE"')
    assert ln.finish() == 0, ln.text()
    assert sorted(ln.stdout_lines) == ["[0] sh 0 of 2", "[1] sh 1 of 2"]


def test_two_nodes_on_one_host_share_one_store(launch, workdir):  # type: ignore[no-untyped-def]
    """Node 0's agent hosts the agents' store on --master-port; the workers get another port node 0 picked
    (their rank 0 hosts its own store there, as torch's would)."""
    from procgroup.netutil import free_port

    s = script(
        workdir,
        "mn.py",
        """
        import os
        e = os.environ
        print(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["NODE_RANK"], e["GROUP_WORLD_SIZE"], e["MASTER_PORT"])
    """,
    )
    port = str(free_port())
    env = {"PROCGROUP_SECRET": "shared-secret"}
    common = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        "--prefix-format",
        "[n{node_rank}:{rank}] ",
    )
    n1 = launch(*common, "--node-rank", "1", s, env=env)  # before node 0: it waits for node 0's store
    n0 = launch(*common, "--node-rank", "0", s, env=env)
    assert n0.finish() == 0, n0.text()
    assert n1.finish() == 0, n1.text()
    wport = n0.stdout_lines[0].split()[-1]
    assert wport != port
    assert sorted(n0.stdout_lines) == [f"[n0:0] 0 0 4 0 2 {wport}", f"[n0:1] 1 1 4 0 2 {wport}"]
    assert sorted(n1.stdout_lines) == [f"[n1:2] 2 0 4 1 2 {wport}", f"[n1:3] 3 1 4 1 2 {wport}"]
    assert "4 worker(s) on 2 nodes" in n0.stderr and "node 0's agent prints the table" in n1.stderr


def _gang(launch, workdir, body: str, n: int = 3, extra=()):  # type: ignore[no-untyped-def]
    from procgroup.netutil import free_port

    s = script(workdir, "gang.py", body)
    port = str(free_port())
    env = {"PROCGROUP_SECRET": "shared-secret"}
    return [
        launch(
            "--nnodes",
            str(n),
            "--node-rank",
            str(k),
            "--nproc-per-node",
            "2",
            "--master-port",
            port,
            *extra,
            s,
            env=env,
        )
        for k in range(n)
    ]


GANG_SLEEPER = """
    import os, time
    print(f"pid={os.getpid()}", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_agent_stops_every_node(launch, workdir, victim):  # type: ignore[no-untyped-def]
    """SIGKILL one node's agent: its workers die with it (parent-death signal); the others notice -- node 0's
    store closing at once, another node's silence within gang.LOST_AFTER -- and stop theirs."""
    nodes = _gang(launch, workdir, GANG_SLEEPER)
    for ln in nodes:
        ln.wait_lines(r"pid=(?P<pid>\d+)", 2, timeout=20)
    t0 = time.monotonic()
    nodes[victim].proc.kill()
    for k, ln in enumerate(nodes):
        if k != victim:
            assert ln.finish(timeout=30) == 1, ln.text()
    lag = time.monotonic() - t0
    assert lag < (5.0 if victim == 0 else 15.0), f"took {lag:.1f}s"
    survivors = [ln for k, ln in enumerate(nodes) if k != victim]
    for ln in survivors:
        if victim == 0:
            assert "lost the connection to the agents' store" in ln.stderr, ln.text()
        else:
            assert "node 2 (" in ln.stderr and "no heartbeat" in ln.stderr, ln.text()
    assert_gone(set().union(*(ln.pids for ln in nodes)), within=3.0)


def test_signal_to_one_agent_stops_the_whole_gang(launch, workdir):  # type: ignore[no-untyped-def]
    nodes = _gang(launch, workdir, GANG_SLEEPER)
    for ln in nodes:
        ln.wait_lines(r"pid=(?P<pid>\d+)", 2, timeout=20)
    nodes[1].proc.send_signal(signal.SIGINT)
    for ln in nodes:
        assert ln.finish(timeout=20) == 130, ln.text()
    assert "the agent on" in nodes[0].stderr and "received SIGINT" in nodes[0].stderr, nodes[0].text()
    assert_gone(set().union(*(ln.pids for ln in nodes)))


def test_gang_restart_across_nodes(launch, workdir):  # type: ignore[no-untyped-def]
    nodes = _gang(
        launch,
        workdir,
        """
        import os
        import numpy as np
        import procgroup as dist
        n = os.environ["PROCGROUP_RESTART_COUNT"]
        assert n == os.environ["TORCHELASTIC_RESTART_COUNT"]
        if n == "0" and os.environ["RANK"] == "4":
            raise RuntimeError("first attempt fails")
        dist.init_process_group()
        x = np.ones(2) * (dist.get_rank() + 1)
        dist.all_reduce(x)
        print("attempt", n, "sum", int(x[0]))
        dist.destroy_process_group()
    """,
        extra=("--max-restarts", "1"),
    )
    for ln in nodes:
        assert ln.finish(timeout=60) == 0, ln.text()
    assert "restarting all 6 workers on 3 nodes (restart 1 of max 1)" in nodes[0].stderr, nodes[0].text()
    assert "RuntimeError: first attempt fails" in nodes[2].stderr
    assert sum(ln.stdout.count("attempt 1 sum 21") for ln in nodes) == 6, "\n".join(ln.text() for ln in nodes)


def test_missing_script_fails_fast(launch, workdir):  # type: ignore[no-untyped-def]
    ln = launch("--standalone", "--nproc-per-node", "2", "nope.py")
    assert ln.finish() == 1
    assert "nope.py" in ln.stderr and "no such file" in ln.stderr and "-m for a module" in ln.stderr


def test_hello_example_end_to_end(launch):  # type: ignore[no-untyped-def]
    """examples/hello.py: init_process_group against the launcher-hosted store, barrier, destroy."""
    ln = launch("--standalone", "--nproc-per-node", "2", str(REPO / "examples" / "hello.py"), cwd=REPO)
    assert ln.finish() == 0, ln.text()
    assert sorted(l.split(" says")[0] for l in ln.stdout_lines if "says hello" in l) == ["[0] rank 0/2", "[1] rank 1/2"]
    assert "[0] all 2 ranks reached the barrier" in ln.stdout_lines, ln.text()


def test_log_dir_ranks_filter_and_uneven_nodes(launch, workdir):  # type: ignore[no-untyped-def]
    """Two nodes with 1 and 3 workers: ranks numbered node by node; --ranks-filter picks global ranks on
    both consoles; --log-dir gets every rank's file (from both nodes) and --tee keeps the console."""
    from procgroup.netutil import free_port

    s = script(
        workdir,
        "hi.py",
        """
        import os
        print("hi", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"],
              os.environ["LOCAL_WORLD_SIZE"])
    """,
    )
    logs = workdir / "logs"
    port = str(free_port())
    env = {"PROCGROUP_SECRET": "shared-secret"}
    common = ("--nnodes", "2", "--master-port", port, "--log-dir", str(logs), "--tee", "--ranks-filter", "0,2")
    n0 = launch(*common, "--node-rank", "0", "--nproc-per-node", "1", s, env=env)
    n1 = launch(*common, "--node-rank", "1", "--nproc-per-node", "3", s, env=env)
    assert n0.finish() == 0, n0.text()
    assert n1.finish() == 0, n1.text()
    host = socket.gethostname()
    assert n0.stdout_lines == [f"[{host}:0] hi 0 0 4 1"], n0.text()
    assert n1.stdout_lines == [f"[{host}:2] hi 2 1 4 3"], n1.text()
    assert sorted(p.name for p in logs.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    assert (logs / "rank3.log").read_text() == "hi 3 2 4 3\n"
    assert "4 worker(s) on 2 nodes" in n0.stderr, n0.text()


def test_sigusr1_is_passed_on_to_the_workers_not_a_stop(launch, workdir):  # type: ignore[no-untyped-def]
    s = script(
        workdir,
        "usr1.py",
        """
        import os, signal, threading
        got = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *a: got.set())
        print(f"pid={os.getpid()}", "tty" if os.environ.get("PROCGROUP_TTY") else "notty", flush=True)
        assert got.wait(20), "no SIGUSR1"
        print("got SIGUSR1", flush=True)
    """,
    )
    ln = launch("--standalone", "--nproc-per-node", "2", s)
    ln.wait_lines(r"pid=(?P<pid>\d+) notty", 2)  # no terminal here: PROCGROUP_TTY is not set
    ln.proc.send_signal(signal.SIGUSR1)
    assert ln.finish() == 0, ln.text()
    assert sorted(l for l in ln.stdout_lines if "got" in l) == ["[0] got SIGUSR1", "[1] got SIGUSR1"], ln.text()
