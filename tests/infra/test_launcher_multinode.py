"""``procgroup run`` across the namespace hosts h1..h3: per-node, head-node (ssh) and srun modes, gang teardown.

Every job is 3 hosts x 2 ranks.  The successful runs start tests/infra/scripts/allreduce_worker.py
(``init_process_group()`` + two all_reduces of rank-dependent data checked against their closed
forms + the layout) and check every rank's ``PGW ... ok`` line with :func:`check_world`.  The
failure runs start a worker that raises on h2 after the group formed, and measure how long the
five others take to disappear.  Every test checks that no process is left in any host's network
namespace afterwards (the hosts share this machine's pid namespace, so their processes are
visible here) and that every ``procgroup run`` exited as expected.

The master address is the *name* h1, which on h1 itself resolves to 127.0.1.1 (the hosts'
/etc/hosts has Debian's self entry), the configuration that makes torch's gloo advertise an
unreachable address.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from .fixtures import NetnsHosts, SlurmCluster, SshHosts, python_for_hosts
from .launch import WORKER, Launch, alive, check_world, clean_env, netns_inodes, new_tag, pids_in_netns

pytestmark = [pytest.mark.infra, pytest.mark.timeout(240, method="signal")]

PER_NODE = 2
RUN_TIMEOUT = 150.0
#: the gang-teardown bound of the issue: every worker on every node gone within this of the failure
TEARDOWN_S = 5.0
PORT = 29400


# ------------------------------------------------------------------------------------ helpers


class Proc:
    """One ``procgroup run`` (or head) process started in its own session; output read in the background."""

    def __init__(self, name: str, cmd: Sequence[str], env: Dict[str, str], cwd: Path) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.p = subprocess.Popen(
            self.cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self.out: List[str] = []
        self.err: List[str] = []
        self.lines: "queue.Queue[tuple[str, float]]" = queue.Queue()
        self._t = [
            threading.Thread(target=self._read, args=(self.p.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.p.stderr, self.err), daemon=True),
        ]
        for t in self._t:
            t.start()

    def _read(self, pipe, into: List[str]) -> None:  # type: ignore[no-untyped-def]
        for raw in pipe:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            into.append(line)
            self.lines.put((line, time.time()))

    def wait(self, timeout: float) -> Optional[int]:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self._t:
            t.join(5)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except OSError:
                pass
            self.p.wait(10)

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def text(self) -> str:
        return (
            f"=== {self.name}: $ {' '.join(self.cmd)}\nexit status {self.p.returncode}\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-8000:]}"
        )


class Job:
    """Several :class:`Proc` (one per host, or one head) plus leftover detection in the hosts' namespaces."""

    def __init__(self, hosts: NetnsHosts) -> None:
        self.hosts = hosts
        self.inodes = netns_inodes(hosts.names)
        self.baseline = pids_in_netns(self.inodes)  # sshd, slurmd...: there before the job
        self.procs: List[Proc] = []

    def start(self, name: str, cmd: Sequence[str], env: Dict[str, str], cwd: Path) -> Proc:
        p = Proc(name, cmd, env, cwd)
        self.procs.append(p)
        return p

    def wait_all(self, timeout: float = RUN_TIMEOUT) -> List[Optional[int]]:
        end = time.monotonic() + timeout
        return [p.wait(max(0.1, end - time.monotonic())) for p in self.procs]

    def leftovers(self, grace: float = 10.0) -> List[str]:
        """Processes that appeared in the hosts' namespaces during the job and are still alive (then killed)."""
        end = time.monotonic() + grace
        while True:
            left = sorted(p for p in pids_in_netns(self.inodes) - self.baseline if alive(p))
            if not left or time.monotonic() > end:
                break
            time.sleep(0.1)
        out = []
        for pid in left:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"pid {pid}: {cmdline[:200]}")
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return out

    def text(self) -> str:
        return "\n".join(p.text() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.leftovers(grace=0.0)

    def as_launch(self, rcs: Sequence[Optional[int]], elapsed: float) -> Launch:
        """One :class:`Launch` with everyone's output, for :func:`check_world`."""
        rc = 0 if all(r == 0 for r in rcs) else next((r for r in rcs if r != 0), None)
        return Launch(
            cmd=[p.name for p in self.procs],
            returncode=rc,
            stdout="\n".join(p.stdout for p in self.procs),
            stderr=self.text(),
            elapsed=elapsed,
            timed_out=any(r is None for r in rcs),
            leftovers=self.leftovers(),
        )


@pytest.fixture
def job(netns_hosts: NetnsHosts):  # type: ignore[no-untyped-def]
    j = Job(netns_hosts)
    yield j
    j.close()


def procgroup_run(*args: str) -> List[str]:
    return [python_for_hosts(), "-m", "procgroup", "run", *args]


def worker_args(tag: str, names: Sequence[str]) -> List[str]:
    return [
        str(WORKER),
        "--tag",
        tag,
        "--world",
        str(len(names) * PER_NODE),
        "--per-node",
        str(PER_NODE),
        "--hosts",
        ",".join(names),
    ]


FAIL_SCRIPT = """
    import os, socket, sys, time
    import procgroup as dist

    dist.init_process_group()
    dist.barrier()  # every rank of every host is up
    rank = dist.get_rank()
    print(f"pid={os.getpid()} rank={rank} host={socket.gethostname()}", flush=True)
    if rank == 3:  # local rank 1 of node 1 = h2
        time.sleep(1.0)
        def explode():
            raise ValueError(f"boom from rank {rank} on {socket.gethostname()}")
        print(f"raising at {time.time():.6f}", flush=True)
        explode()
    time.sleep(120)  # everyone else: only the launcher's teardown ends this
"""


def _fail_script(d: Path) -> str:
    p = d / "fail.py"
    p.write_text(textwrap.dedent(FAIL_SCRIPT))
    return str(p)


def _collect_pids(procs: Sequence[Proc], n: int, timeout: float, raising: bool = True) -> tuple[Dict[int, int], float]:
    """Wait for ``n`` ``pid=`` lines (and the ``raising at`` line); returns ({rank: pid}, raise time)."""
    pids: Dict[int, int] = {}
    raised: Optional[float] = None if raising else 0.0
    end = time.monotonic() + timeout
    rx = re.compile(r"pid=(\d+) rank=(\d+)")
    while (len(pids) < n or raised is None) and time.monotonic() < end:
        got = False
        for p in procs:
            try:
                line, _ = p.lines.get_nowait()
            except queue.Empty:
                continue
            got = True
            m = rx.search(line)
            if m:
                pids[int(m.group(2))] = int(m.group(1))
            m2 = re.search(r"raising at (\d+\.\d+)", line)
            if m2:
                raised = float(m2.group(1))
        if not got:
            time.sleep(0.02)
    assert len(pids) == n and raised is not None, f"saw pids {pids}, raise time {raised}"
    return pids, raised


def _gone_after(pids: Dict[int, int], since: float, timeout: float) -> float:
    """Seconds from ``since`` until none of ``pids`` is alive (polled every 20 ms)."""
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids.values()) and time.monotonic() < end:
        time.sleep(0.02)
    left = {r: p for r, p in pids.items() if alive(p)}
    assert not left, f"workers still alive {timeout:.0f}s after the failure: {left}"
    return time.time() - since


def _secret_in_cmdlines(secret: str) -> List[str]:
    hits = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if secret.encode() in f.read():
                        hits.append(d)
            except OSError:
                pass
    return hits


# ------------------------------------------------------------------------------------ per-node mode


def _per_node(
    job: Job,
    names: Sequence[str],
    script: List[str],
    env: Dict[str, str],
    cwd: Path,
    explicit_ranks: bool = True,
    order: Optional[Sequence[int]] = None,
) -> List[Proc]:
    procs: Dict[int, Proc] = {}
    for i in order or range(len(names)):
        h = names[i]
        rank = ["--node-rank", str(i)] if explicit_ranks else []
        cmd = job.hosts.cmd(
            h,
            *procgroup_run(
                "--nnodes",
                str(len(names)),
                *rank,
                "--master-addr",
                names[0],
                "--master-port",
                str(PORT),
                "--nproc-per-node",
                str(PER_NODE),
                *script,
            ),
        )
        procs[i] = job.start(h, cmd, env, cwd)
    return [procs[i] for i in range(len(names))]


@pytest.mark.parametrize("ranks", ["explicit", "by-host-name"])
def test_per_node_mode_three_hosts(job: Job, tmp_path: Path, ranks: str):
    """One `procgroup run` per host; with --node-rank omitted the master host is node 0, then h2, h3
    (started in the order h3, h2, h1 to show that join order does not decide)."""
    names = job.hosts.names
    tag = new_tag()
    env = clean_env({"PROCGROUP_SECRET": secrets.token_hex(16)})
    t0 = time.monotonic()
    procs = _per_node(
        job,
        names,
        worker_args(tag, names),
        env,
        tmp_path,
        explicit_ranks=ranks == "explicit",
        order=None if ranks == "explicit" else [2, 1, 0],
    )
    rcs = job.wait_all()
    r = job.as_launch(rcs, time.monotonic() - t0)
    check_world(r, len(names) * PER_NODE, PER_NODE, names)
    node0 = procs[0].stderr
    assert "6 workers on 3 nodes" in node0, job.text()  # the rank -> host, local rank, pid mapping, once
    assert node0.count("6 workers on 3 nodes") == 1, job.text()
    assert re.search(r"6 worker\(s\) on 3 nodes \(h1, h2, h3\) succeeded", node0), job.text()
    for i, h in enumerate(names):  # every rank in node 0's table, with its host
        for local in range(PER_NODE):
            assert re.search(rf"^\s+{i * PER_NODE + local}\s+{h}\s+\d+\s", node0, re.M), node0


def test_per_node_mode_needs_a_shared_secret(job: Job, tmp_path: Path):
    names = job.hosts.names
    cmd = job.hosts.cmd(
        names[1],
        *procgroup_run(
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--master-addr",
            names[0],
            "--master-port",
            str(PORT),
            str(WORKER),
            "--tag",
            new_tag(),
        ),
    )
    # with a home directory the per-user secret file is shared (next test); without one there is no way:
    env = {k: v for k, v in clean_env().items() if k not in ("HOME", "XDG_CONFIG_HOME")}
    p = job.start(names[1], cmd, env, tmp_path)
    assert p.wait(60) == 1, p.text()
    assert "PROCGROUP_SECRET" in p.stderr and "--secret-file" in p.stderr, p.text()
    assert not job.leftovers()


def test_per_node_mode_agrees_through_the_shared_per_user_secret(job: Job, tmp_path: Path):
    """No PROCGROUP_SECRET, no --secret-file: hosts sharing a home directory (here one XDG_CONFIG_HOME) agree
    through the per-user secret file, created 0600 by whichever node needs it first."""
    names = job.hosts.names
    tag = new_tag()
    env = clean_env({"XDG_CONFIG_HOME": str(tmp_path / "cfg")})
    t0 = time.monotonic()
    _per_node(job, names, worker_args(tag, names), env, tmp_path, order=[2, 1, 0])
    rcs = job.wait_all()
    r = job.as_launch(rcs, time.monotonic() - t0)
    check_world(r, len(names) * PER_NODE, PER_NODE, names)
    assert ((tmp_path / "cfg" / "procgroup" / "secret").stat().st_mode & 0o777) == 0o600


def test_failure_on_h2_stops_all_six_workers_within_5s(job: Job, tmp_path: Path):
    names = job.hosts.names
    env = clean_env({"PROCGROUP_SECRET": secrets.token_hex(16)})
    procs = _per_node(job, names, [_fail_script(tmp_path)], env, tmp_path)
    pids, raised = _collect_pids(procs, len(names) * PER_NODE, timeout=90)
    lag = _gone_after(pids, raised, timeout=TEARDOWN_S + 10)
    rcs = job.wait_all(60)
    print(f"gang teardown (per-node mode): all {len(pids)} workers gone {lag:.2f}s after rank 3 raised on h2")
    assert lag < TEARDOWN_S, f"teardown took {lag:.2f}s\n{job.text()}"
    assert all(rc is not None and rc != 0 for rc in rcs), f"exit statuses {rcs}\n{job.text()}"
    for p in procs:  # every agent prints the root cause with host, rank, pid, exit code and the traceback
        err = p.stderr
        assert re.search(rf"### Root cause: rank 3 \(local 1\) on host h2, pid {pids[3]}, exit code 1", err), p.text()
        assert "in explode" in err and "ValueError: boom from rank 3 on h2" in err, p.text()
        assert re.search(r"the launcher stopped 5 worker\(s\) on 3 host\(s\) \d+\.\d+s after the root cause", err), (
            p.text()
        )
    assert re.search(r"^\s+3\s+h2\s+\d+\s+\S+\s+FAILED exit code 1\s+<- root cause", procs[0].stderr, re.M), procs[
        0
    ].text()
    left = job.leftovers(grace=2.0)
    assert not left, f"left behind: {left}\n{job.text()}"


# ------------------------------------------------------------------------------------ head node over ssh


def _hostfile(d: Path, names: Sequence[str]) -> Path:
    p = d / "hostfile"
    p.write_text("# the namespace hosts\n" + "".join(f"{h} slots={PER_NODE}   # {h}\n\n" for h in names))
    return p


def _head(job: Job, sshd: SshHosts, tmp_path: Path, script: List[str], env: Dict[str, str]) -> Proc:
    names = job.hosts.names
    cmd = job.hosts.cmd(
        names[0], *procgroup_run("--hostfile", str(_hostfile(tmp_path, names)), "--ssh-command", str(sshd.ssh), *script)
    )
    return job.start("head", cmd, env, tmp_path)


def test_head_node_mode_over_ssh(job: Job, sshd_hosts: SshHosts, tmp_path: Path):
    names = job.hosts.names
    tag = new_tag()
    t0 = time.monotonic()
    head = _head(job, sshd_hosts, tmp_path, worker_args(tag, names), clean_env())
    rcs = job.wait_all()
    r = job.as_launch(rcs, time.monotonic() - t0)
    check_world(r, len(names) * PER_NODE, PER_NODE, names)
    err = head.stderr
    fwd = next((ln for ln in head.err if "forwarding to every host" in ln), "")
    assert fwd and "PYTHONPATH" in fwd and "PROCGROUP_TIMEOUT" in fwd and "OMP_NUM_THREADS" in fwd, err
    assert "PROCGROUP_SECRET goes over each ssh session's stdin" in fwd, fwd
    assert err.count("forwarding to every host") == 1, err
    assert re.search(r"6 worker\(s\) on 3 nodes \(h1, h2, h3\) succeeded", err), err
    assert err.count("6 workers on 3 nodes") == 1, err  # node 0's mapping, relayed once
    assert "#procgroup-ctl" not in head.stdout + err, "control lines must not reach the console"
    for rank in range(len(names) * PER_NODE):  # every host's output streams back, prefixed [host:rank]
        assert re.search(rf"^\[{names[rank // PER_NODE]}:{rank}\] PGW rank={rank} ", head.stdout, re.M), head.stdout


def test_head_node_failure_on_h2_and_secret_not_in_ps(job: Job, sshd_hosts: SshHosts, tmp_path: Path):
    names = job.hosts.names
    secret = secrets.token_hex(16)
    head = _head(job, sshd_hosts, tmp_path, [_fail_script(tmp_path)], clean_env({"PROCGROUP_SECRET": secret}))
    pids, raised = _collect_pids([head], len(names) * PER_NODE, timeout=90)
    hits = _secret_in_cmdlines(secret)
    lag = _gone_after(pids, raised, timeout=TEARDOWN_S + 10)
    rc = head.wait(60)
    print(f"gang teardown (head-node mode): all {len(pids)} workers gone {lag:.2f}s after rank 3 raised on h2")
    assert not hits, f"the job secret is visible in the command line of pid(s) {hits}"
    assert lag < TEARDOWN_S, f"teardown took {lag:.2f}s\n{job.text()}"
    assert rc == 1, head.text()
    err = head.stderr
    assert err.count("### Root cause:") == 1, err  # the head prints it once (agents report to the head)
    assert re.search(rf"### Root cause: rank 3 \(local 1\) on host h2, pid {pids[3]}, exit code 1", err), err
    assert "in explode" in err and "ValueError: boom from rank 3 on h2" in err, err
    assert not job.leftovers(grace=5.0), job.text()


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_stopping_the_head_stops_every_host(job: Job, sshd_hosts: SshHosts, tmp_path: Path, how: str):
    """Ctrl-C on the head tears down everywhere (exit 130); even a SIGKILLed head does: its ssh clients see
    their stdin close, the remote agents see EOF on theirs and stop their workers.  (First, SIGUSR1 on the
    head reaches every worker on every host and stops nothing.)"""
    names = job.hosts.names
    s = tmp_path / "sleep.py"
    s.write_text(
        textwrap.dedent("""
        import os, signal, socket, time
        import procgroup as dist
        dist.init_process_group()
        signal.signal(signal.SIGUSR1, lambda *a: print(f"usr1 rank={dist.get_rank()}", flush=True))
        dist.barrier()
        print(f"pid={os.getpid()} rank={dist.get_rank()} host={socket.gethostname()}", flush=True)
        while True:
            time.sleep(120)
    """)
    )
    head = _head(job, sshd_hosts, tmp_path, [str(s)], clean_env())
    pids, _ = _collect_pids([head], len(names) * PER_NODE, timeout=90, raising=False)
    if how == "SIGINT":
        os.kill(head.p.pid, signal.SIGUSR1)
        end = time.monotonic() + 20
        while sum("usr1 rank=" in ln for ln in head.out) < len(pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert sum("usr1 rank=" in ln for ln in head.out) == len(pids), head.text()
        assert all(alive(p) for p in pids.values()), "SIGUSR1 must not stop anything"
    t0 = time.time()
    os.kill(head.p.pid, signal.SIGINT if how == "SIGINT" else signal.SIGKILL)
    lag = _gone_after(pids, t0, timeout=TEARDOWN_S + 10)
    rc = head.wait(60)
    print(f"head {how}: all {len(pids)} workers gone {lag:.2f}s later")
    assert lag < TEARDOWN_S, f"teardown took {lag:.2f}s\n{job.text()}"
    if how == "SIGINT":
        assert rc == 128 + signal.SIGINT, head.text()
        assert "received SIGINT" in head.stderr, head.text()
    assert not job.leftovers(grace=10.0), job.text()


# ------------------------------------------------------------------------------------ srun


def test_srun_one_agent_per_node(slurm_cluster: SlurmCluster, job: Job, tmp_path: Path):
    """srun -N3 --ntasks-per-node=1 procgroup run --nproc-per-node 2: node rank, node count, master and port
    from Slurm; the job secret shared through a 0600 file in the (shared) working directory."""
    names = job.hosts.names
    tag = new_tag()
    cmd = slurm_cluster.cmd(
        "srun",
        f"--chdir={tmp_path}",
        f"-N{len(names)}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        *procgroup_run("--nproc-per-node", str(PER_NODE), *worker_args(tag, names)),
    )
    t0 = time.monotonic()
    job.start("srun", cmd, slurm_cluster.env(clean_env()), tmp_path)
    rcs = job.wait_all()
    r = job.as_launch(rcs, time.monotonic() - t0)
    check_world(r, len(names) * PER_NODE, PER_NODE, names)
    err = job.procs[0].stderr
    assert re.search(r"6 worker\(s\) on 3 nodes \(h1, h2, h3\) succeeded", err), err
    assert "first host of SLURM_STEP_NODELIST" in err, err
    assert not list(tmp_path.glob(".procgroup-secret-*")), "node 0 must remove the secret file"


def test_remote_agent_dies_with_its_ssh_session(job: Job, sshd_hosts: SshHosts, tmp_path: Path):
    """Kill the sshd session process serving h2's agent: the agent gets its parent-death signal (SIGTERM),
    stops its workers and aborts the gang, so every host stops."""
    names = job.hosts.names
    s = tmp_path / "sleep.py"
    s.write_text(
        textwrap.dedent("""
        import os, socket, time
        import procgroup as dist
        dist.init_process_group()
        dist.barrier()
        print(f"pid={os.getpid()} rank={dist.get_rank()} host={socket.gethostname()}", flush=True)
        time.sleep(120)
    """)
    )
    head = _head(job, sshd_hosts, tmp_path, [str(s)], clean_env())
    pids, _ = _collect_pids([head], len(names) * PER_NODE, timeout=90, raising=False)
    agent = None
    for pid in pids_in_netns(netns_inodes([names[1]])):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--from-head" in argv and argv[argv.index(b"--node-rank") + 1] == b"1":
            agent = pid
    assert agent is not None, "no agent for node 1 on h2"
    with open(f"/proc/{agent}/stat", "rb") as f:
        sshd_session = int(f.read().rsplit(b")", 1)[1].split()[1])
    t0 = time.time()
    os.kill(sshd_session, signal.SIGKILL)
    lag = _gone_after(pids, t0, timeout=TEARDOWN_S + 10)
    rc = head.wait(60)
    print(f"sshd session of h2's agent killed: all {len(pids)} workers gone {lag:.2f}s later")
    assert lag < TEARDOWN_S, f"teardown took {lag:.2f}s\n{job.text()}"
    assert rc not in (0, None), head.text()
    assert not job.leftovers(grace=10.0), job.text()
