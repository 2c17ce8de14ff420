"""Run-info files: how ``procgroup top RUN_ID`` finds a job that ``procgroup run`` started on this machine.

The agent that speaks for the job (one node's, or node 0's) writes one small JSON file per job into a
private per-user directory when each generation starts, and removes it when the job ends:

* ``$PROCGROUP_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/procgroup``, else ``<tmp>/procgroup-<uid>``;
* the directory is created mode 0700 and must belong to this user (a directory another user made in
  ``/tmp`` is refused, naming ``PROCGROUP_RUNTIME_DIR``); the file is mode 0600, because it holds the job
  secret that the store checks;
* the file is ``<run id>.<agent pid>.json`` (several nodes' jobs all have the run id "none"), with the workers'
  store address, the secret, the world size, the restart count and the agent's pid.  A file whose agent is gone
  (SIGKILLed) is stale: readers skip it and remove it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional

from .. import procfs
from ..config import ENV, env_str
from ..errors import ConfigError
from .config import LaunchConfig, Placement

__all__ = [
    "RunInfo",
    "runtime_dir",
    "write_run_info",
    "remove_run_info",
    "load_run_info",
    "running_jobs",
    "find_run",
    "publish_run",
]

#: the freedesktop per-user runtime directory (not part of the launcher <-> library contract)
XDG_RUNTIME_DIR = "XDG_RUNTIME_DIR"
_SUFFIX = ".json"


@dataclass(frozen=True)
class RunInfo:
    """What ``procgroup top`` needs to attach to a running job (one run-info file)."""

    run_id: str
    store_addr: str
    store_port: int
    secret: str = field(repr=False)
    world_size: int
    nnodes: int
    restart: int
    agent_pid: int
    host: str
    started: float
    #: where this was read from (not stored in the file)
    path: Optional[str] = field(default=None, compare=False)

    @property
    def store(self) -> str:
        """``host:port`` of the workers' store."""
        return f"{self.store_addr}:{self.store_port}"

    def describe(self) -> str:
        """One line for a listing: run id, size, store, agent pid, age."""
        age = max(0.0, time.time() - self.started)
        return (
            f"{self.run_id}  {self.world_size} ranks on {self.nnodes} node(s)  store {self.store}  "
            f"agent pid {self.agent_pid}  restart {self.restart}  running {age:.0f}s"
        )


def runtime_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """The directory of the run-info files (see the module docstring); not created here."""
    env = os.environ if environ is None else environ
    explicit = env_str(ENV.RUNTIME_DIR, env)
    if explicit is not None:
        return os.path.abspath(explicit)
    xdg = env_str(XDG_RUNTIME_DIR, env)
    if xdg is not None and os.path.isdir(xdg):
        return os.path.join(xdg, "procgroup")
    return os.path.join(tempfile.gettempdir(), f"procgroup-{os.getuid()}")


def _private_dir(path: str, create: bool) -> bool:
    """Make sure ``path`` is a directory of ours that nobody else can write (created 0700 when ``create``).

    False when it does not exist (and ``create`` is False); ConfigError when it is not safe to use.
    """
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create the run-info directory {path!r} ({e.strerror or e}); set {ENV.RUNTIME_DIR} "
                "to a writable directory"
            ) from e
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    import stat as stat_mod  # noqa: PLC0415 - only here

    if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"the run-info directory {path!r} is not a directory of this user that only it can write; "
            f"remove it, or set {ENV.RUNTIME_DIR} to a private directory"
        )
    return True


def write_run_info(info: RunInfo, environ: Optional[Mapping[str, str]] = None, old: Optional[str] = None) -> str:
    """Write ``info`` (atomically, mode 0600) and return its path; ``old``: the path an earlier generation wrote.

    Raises ConfigError when the directory cannot be used (see :func:`runtime_dir`), OSError when the file cannot
    be written.
    """
    d = runtime_dir(environ)
    _private_dir(d, create=True)
    path = os.path.join(d, f"{info.run_id}.{info.agent_pid}{_SUFFIX}")
    data = {k: v for k, v in asdict(info).items() if k != "path"}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)  # mkstemp: 0600, O_EXCL
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        remove_run_info(tmp)
        raise
    if old is not None and old != path:
        remove_run_info(old)
    return path


def remove_run_info(path: Optional[str]) -> None:
    """Remove the run-info file ``path`` (None, or a file already gone: nothing to do)."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def load_run_info(path: str) -> Optional[RunInfo]:
    """The run-info file at ``path``, or None when it is missing or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
        return RunInfo(**data, path=path)
    except (OSError, ValueError, TypeError):
        return None


def running_jobs(
    environ: Optional[Mapping[str, str]] = None, alive: Callable[[int], bool] = procfs.pid_alive
) -> list[RunInfo]:
    """The jobs whose agent is still alive, oldest first; stale files (agent gone) are removed on the way.

    Raises ConfigError when the directory exists but is not private (see :func:`runtime_dir`).
    """
    d = runtime_dir(environ)
    if not _private_dir(d, create=False):
        return []
    out = []
    for name in sorted(os.listdir(d)):
        if not name.endswith(_SUFFIX) or name.startswith("."):
            continue
        info = load_run_info(os.path.join(d, name))
        if info is None:
            continue
        if not alive(info.agent_pid):
            remove_run_info(info.path)
            continue
        out.append(info)
    return sorted(out, key=lambda i: i.started)


def find_run(
    run_id: Optional[str],
    environ: Optional[Mapping[str, str]] = None,
    alive: Callable[[int], bool] = procfs.pid_alive,
    agent_pid: Optional[int] = None,
) -> RunInfo:
    """The running job ``run_id`` (None: the only running job) started by ``procgroup run`` on this machine;
    ``agent_pid`` picks one of several agents with the same run id (several nodes' jobs are all "none").

    Raises ConfigError naming what to do when there is none, or several to choose from.
    """
    jobs = running_jobs(environ, alive)
    where = runtime_dir(environ)
    if run_id is not None:
        jobs = [j for j in jobs if j.run_id == run_id]
    if agent_pid is not None:
        jobs = [j for j in jobs if j.agent_pid == agent_pid]
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        what = f"job with run id {run_id!r}" if run_id is not None else "job"
        if agent_pid is not None:
            what += f" and agent pid {agent_pid}"
        raise ConfigError(
            f"no running {what} started by `procgroup run` on this machine (run-info files in {where}); "
            "give the store instead: procgroup top --store HOST:PORT (the secret from "
            f"{ENV.SECRET} or --secret-file)"
        )
    listing = "\n  ".join(j.describe() for j in jobs)
    hint = "give its run id" if run_id is None else "several agents use this run id: give --agent-pid PID"
    raise ConfigError(f"{len(jobs)} running jobs; {hint}:\n  {listing}")


def publish_run(
    old: Optional[str],
    cfg: LaunchConfig,
    placement: Placement,
    *,
    secret: str,
    restart: int,
    agent_pid: int,
    host: str,
    environ: Mapping[str, str],
    warn: Callable[[str], None],
) -> Optional[str]:
    """The agent's hook: write generation ``restart``'s run-info file (replacing ``old``) and return its path.

    A file that cannot be written only costs ``procgroup top`` its attach-by-run-id: ``warn`` says so once and
    the job goes on (returns ``old``'s replacement or None).
    """
    info = RunInfo(
        run_id=cfg.run_id,
        store_addr=placement.master_addr,
        store_port=placement.master_port,
        secret=secret,
        world_size=placement.world_size,
        nnodes=placement.nnodes,
        restart=restart,
        agent_pid=agent_pid,
        host=host,
        started=time.time(),
    )
    try:
        return write_run_info(info, environ, old)
    except (OSError, ConfigError) as e:
        if restart == 0:
            warn(f"warning: `procgroup top {cfg.run_id}` will not find this job: {e}")
        remove_run_info(old)
        return None
