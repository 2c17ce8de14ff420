"""Start a real launcher (srun, mpirun, mpiexec) and make sure nothing it started outlives the test.

:func:`launch` runs one launcher command in a new session, with a deadline, and afterwards looks
for leftovers three ways: processes still in the launcher's session (local ranks, hostexec-started
daemons), processes whose command line carries the test's tag (ranks), and -- given network
namespaces -- processes that appeared in those namespaces during the launch (orted,
hydra_pmi_proxy, slurmstepd, ssh sessions).  Anything still alive after a grace period is killed
and reported in :attr:`Launch.leftovers`.  :func:`check_world` checks the worker's ``PGW`` lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set

from procgroup import procfs

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
INFRA = REPO / "infra"
SCRIPTS = Path(__file__).with_name("scripts")
WORKER = SCRIPTS / "allreduce_worker.py"
HIDE_MPI4PY = SCRIPTS / "hide_mpi4py"

#: variables that would tell procgroup (or a nested launcher) who it is: never inherited from pytest
_LAUNCHER_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|NODE_RANK|ROLE_.*|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_.*|PROCGROUP_.*|SLURM_.*|SLURMD_.*|OMPI_.*|PMIX_.*|PMI_.*|MPI_LOCAL.*|HYDI_.*|"
    r"HYDRA_.*|I_MPI_.*|PET_.*|KUBERNETES_SERVICE_HOST)$"
)

#: how long leftovers may take to go away by themselves (launchers tear down asynchronously)
GRACE_S = 15.0


def new_tag() -> str:
    return f"pgtest-{uuid.uuid4().hex[:12]}"


def clean_env(extra: Optional[Mapping[str, str]] = None, *, hide_mpi4py: bool = False) -> Dict[str, str]:
    """os.environ without launcher/identity variables, with procgroup importable from src/.

    ``hide_mpi4py``: ranks cannot import mpi4py (see scripts/hide_mpi4py), whether or not it is installed.
    """
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}
    path = [str(HIDE_MPI4PY)] if hide_mpi4py else []
    path += [str(SRC), os.environ.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PROCGROUP_TIMEOUT="60",
    )
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------------------ /proc


def alive(pid: int) -> bool:
    """Running: exists and is not a zombie (orphans are reaped late on this machine)."""
    st = procfs.stat(pid)
    return st is not None and st.state not in ("Z", "X")


def describe(pid: int) -> str:
    return f"pid {pid}: {' '.join(procfs.argv(pid))[:200] or '?'}"


def netns_inodes(names: Iterable[str]) -> Set[int]:
    out = set()
    for n in names:
        try:
            out.add(os.stat(f"/run/netns/{n}").st_ino)
        except OSError:
            pass
    return out


def pids_in_netns(inodes: Set[int]) -> Set[int]:
    return procfs.pids_in_namespace("net", inodes)


def related_pids(session: Optional[int], tag: Optional[str], netns: Set[int], baseline: Set[int]) -> Set[int]:
    """Live pids that belong to one launch (see the module docstring)."""
    me = os.getpid()
    found = set()
    for pid in procfs.pids():
        st = procfs.stat(pid)
        if pid == me or st is None or st.state in ("Z", "X"):
            continue
        if session is not None and st.session == session:
            found.add(pid)
        elif tag is not None and tag in procfs.argv(pid):
            found.add(pid)
    found |= {p for p in pids_in_netns(netns) - baseline if alive(p)}
    return found


def reap(
    session: Optional[int], tag: Optional[str], netns: Set[int], baseline: Set[int], grace: float = GRACE_S
) -> List[str]:
    """Wait up to ``grace`` s for the launch's processes to go; SIGKILL and describe the rest."""
    deadline = time.monotonic() + grace
    left = related_pids(session, tag, netns, baseline)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = related_pids(session, tag, netns, baseline)
    if not left:
        return []
    described = [describe(p) for p in sorted(left)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    # SIGKILL is delivered asynchronously: wait (bounded) until the killed processes are gone, so a
    # caller that checks right after sees what is really left (a loaded machine takes a moment)
    gone_by = time.monotonic() + 10.0
    while any(alive(p) for p in left) and time.monotonic() < gone_by:
        time.sleep(0.05)
    return described


# ------------------------------------------------------------------------------------ launch


@dataclass
class Launch:
    cmd: List[str]
    returncode: Optional[int]
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool = False
    leftovers: List[str] = field(default_factory=list)

    def report(self) -> str:
        head = f"$ {' '.join(self.cmd)}\nexit status {self.returncode} after {self.elapsed:.1f}s"
        if self.timed_out:
            head += " (TIMED OUT: killed)"
        if self.leftovers:
            head += "\nprocesses left behind (killed):\n  " + "\n  ".join(self.leftovers)
        return f"{head}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"


def launch(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    tag: Optional[str] = None,
    netns: Sequence[str] = (),
    grace: float = GRACE_S,
) -> Launch:
    """Run ``cmd`` in a new session; kill it at ``timeout``; reap what it left behind after ``grace`` s."""
    inodes = netns_inodes(netns)
    baseline = pids_in_netns(inodes)
    t0 = time.monotonic()
    p = subprocess.Popen(
        list(cmd),
        env=dict(env),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    timed_out = False
    out = err = ""
    try:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_session(p, signal.SIGTERM)  # srun cancels its step, mpirun its daemons
            try:
                out, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                _kill_session(p, signal.SIGKILL)
                for pid in related_pids(p.pid, tag, inodes, baseline):  # remote ranks may hold the pipes
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    out, err = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    out, err = "", "[launch] output lost: the pipes stayed open"
    finally:
        if p.poll() is None:
            _kill_session(p, signal.SIGKILL)
            p.wait()
        leftovers = reap(p.pid, tag, inodes, baseline, grace)
    return Launch(list(cmd), p.returncode, out or "", err or "", time.monotonic() - t0, timed_out, leftovers)


def mpi4py_library() -> Optional[str]:
    """``MPI.Get_library_version()`` of the installed mpi4py (read without initializing MPI), or None."""
    code = (
        "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; from mpi4py import MPI; "
        "print(MPI.Get_library_version().splitlines()[0])"
    )
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    except subprocess.TimeoutExpired:
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def _kill_session(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass


# ------------------------------------------------------------------------------------ checks

_LINE = re.compile(r"PGW rank=(\d+) world=(\d+) local=(\d+)/(\d+) node=(\d+) host=(\S+?) ok")


def check_world(r: Launch, world: int, per_node: int, hosts: Optional[Sequence[str]] = None) -> None:
    """Every rank printed its ``PGW ... ok`` line with the expected layout, exit status 0, no leftovers."""
    ctx = r.report()
    assert not r.timed_out, f"launch timed out\n{ctx}"
    assert r.returncode == 0, f"launcher exited with {r.returncode}\n{ctx}"
    assert not r.leftovers, f"processes were left behind\n{ctx}"
    seen: Dict[int, tuple] = {}
    fails = [line for line in r.stdout.splitlines() if "PGW-FAIL" in line]
    assert not fails, f"a rank reported a failure: {fails[0]}\n{ctx}"
    # finditer, not per line: a launcher that merges its ranks' output may glue two lines together
    for m in _LINE.finditer(r.stdout):
        rank = int(m.group(1))
        assert rank not in seen, f"rank {rank} printed twice\n{ctx}"
        seen[rank] = (int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), m.group(6))
    assert sorted(seen) == list(range(world)), f"ranks that reported: {sorted(seen)}, expected 0..{world - 1}\n{ctx}"
    for rank, (w, local, lws, node, host) in sorted(seen.items()):
        want = (world, rank % per_node, per_node, rank // per_node)
        assert (w, local, lws, node) == want, (
            f"rank {rank}: (world, local, local_world, node)={(w, local, lws, node)}, expected {want}\n{ctx}"
        )
        if hosts is not None:
            assert host == hosts[rank // per_node], (
                f"rank {rank} ran on {host}, expected {hosts[rank // per_node]}\n{ctx}"
            )


def worker_cmd(python: str, tag: str, world: int, per_node: int, hosts: Optional[Sequence[str]] = None) -> List[str]:
    cmd = [python, str(WORKER), "--tag", tag, "--world", str(world), "--per-node", str(per_node)]
    if hosts:
        cmd += ["--hosts", ",".join(hosts)]
    return cmd
