"""Start N real worker processes with the env:// contract and collect their results.

``run_world(n, "func", ...)`` runs ``tests/integration/workers.py func`` in n
processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT, PROCGROUP_SECRET set as
``procgroup run`` would), waits with a deadline, kills the whole lot on
timeout, and raises with every rank's output when any rank failed.  Ranks are forked from a warm
interpreter (``zygote.py``: numpy already imported) where their environment allows, else exec'd;
``PROCGROUP_TEST_ZYGOTE=0`` exec's every one.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from procgroup.config import SHM_DIR
from procgroup.netutil import free_port

from . import zygote

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).with_name("workers.py")
_JOBS = itertools.count()
#: a rank: exec'd, or forked from the zygote (``zygote.Forked``: the part of Popen's interface used here)
Proc = Union[subprocess.Popen, zygote.Forked]


@dataclass
class Result:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def worker_env(rank: int, n: int, port: int, secret: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PROCGROUP_SECRET=secret,
        PROCGROUP_TIMEOUT="30",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    for k in (
        "TORCHELASTIC_RUN_ID",
        "PROCGROUP_RUN_ID",
        "PROCGROUP_STORE_HOSTED",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ):
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def shell_env(
    rank: object,
    n: object,
    port: int,
    extra: Optional[Dict[str, Optional[str]]] = None,
    *,
    timeout: str = "20",
    secret: Optional[str] = None,
) -> Dict[str, str]:
    """What a user types in one shell: ``WORLD_SIZE=n RANK=r MASTER_ADDR=... MASTER_PORT=... python x.py``
    (no launcher's variables, no PROCGROUP_SECRET unless ``secret``); ``extra`` values of None unset a name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROCGROUP_", "TORCHELASTIC_", "SLURM_"))}
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        env.pop(k, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PROCGROUP_TIMEOUT=timeout,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        PYTHONUNBUFFERED="1",
    )
    if secret is not None:
        env["PROCGROUP_SECRET"] = secret
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def spawn_world(
    n: int,
    func: str,
    args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    ranks: Optional[Sequence[int]] = None,
    script: Optional[Path] = None,
) -> List[Proc]:
    """Start ranks ``ranks`` (default all ``n``) of ``script func *args`` (default tests/integration/workers.py)
    with the env:// contract of :func:`worker_env` on a fresh port and secret, each in its own session."""
    port = free_port()
    secret = secrets.token_hex(16)
    procs: List[Proc] = []
    argv = [sys.executable, str(script or WORKERS), func, *args]
    for r in range(n) if ranks is None else ranks:
        wenv = worker_env(r, n, port, secret, env)
        if zygote.usable(argv, wenv):  # forked from a warm interpreter: the same process, 0.2 s sooner
            procs.append(zygote.spawn(argv, wenv, str(ROOT)))
            continue
        procs.append(
            subprocess.Popen(
                argv,
                env=wenv,
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def collect(procs: List[Proc], timeout: float) -> List[Result]:
    deadline = time.monotonic() + timeout
    out: List[Result] = []
    try:
        for r, p in enumerate(procs):
            try:
                so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                so, se = p.communicate()
                se += f"\n[harness] rank {r} killed after {timeout}s"
            out.append(Result(r, p.returncode, so, se))
    finally:
        kill_all(procs)
    return out


def kill_all(procs: List[Proc]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass


def report(results: List[Result]) -> str:
    return "\n".join(f"--- rank {r.rank} rc={r.returncode}\n{r.stdout}\n{r.stderr}" for r in results)


def run_world(
    n: int, func: str, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None, timeout: float = 90.0
) -> List[Result]:
    results = collect(spawn_world(n, func, args, env), timeout)
    if any(r.returncode != 0 for r in results):
        raise AssertionError(f"{func} failed at world size {n}:\n{report(results)}")
    return results


def run_job(
    prefix: str,
    script: Path,
    n: int,
    func: str,
    env: Dict[str, str],
    args: Sequence[str] = (),
    timeout: float = 150.0,
    ok: bool = True,
) -> List[Result]:
    """Run ``script func *args`` on ``n`` ranks under a run id of its own (``PROCGROUP_RUN_ID``, named after
    ``prefix``): with ``ok`` every rank must exit 0, and no /dev/shm segment of the run id may be left."""
    job = f"{prefix}-{os.getpid()}-{next(_JOBS)}"
    results = collect(spawn_world(n, func, args, env={"PROCGROUP_RUN_ID": job, **env}, script=script), timeout)
    if ok:
        assert all(r.returncode == 0 for r in results), report(results)
    leaked = [x for x in os.listdir(SHM_DIR) if job in x] if os.path.isdir(SHM_DIR) else []
    assert not leaked, f"/dev/shm segments left behind: {leaked}"
    return results


def json_lines(r: Result) -> List[dict]:
    """The JSON records a rank printed (its stdout lines that start with ``{``)."""
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
