"""The pieces of one generation of a node's workers that need no agent state.

:func:`worker_specs` builds the blueprints (argv, environment, output, error file) of one node's
workers; :func:`worker_result` and :func:`failure_record` turn a finished worker into what the
report and the other agents see; :func:`kill_leftovers` is the last step of every teardown;
:class:`Attempt` carries one generation's running state between the agent's start, supervise and
stop steps (:meth:`procgroup.launcher.agent.LocalAgent._run_attempt`).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from ..deadline import Deadline
from ..errors import PortInUseError
from .config import LaunchConfig, Placement, cpu_binding, worker_env
from .report import WorkerResult, load_error_file, worker_to_dict
from .workers import (
    BOOTSTRAP_PATH,
    ProcInfo,
    Worker,
    WorkerGroup,
    WorkerSpec,
    kill_pids,
    proc_table,
    reap_adopted_zombies,
    scan_leftovers,
)

__all__ = [
    "Attempt",
    "LEFTOVER_TIMEOUT",
    "TRACEBACK_TAIL",
    "check_workers_port",
    "pick_workers_port",
    "failure_record",
    "kill_leftovers",
    "terminal",
    "usable_cpus",
    "worker_result",
    "worker_specs",
]

#: How long killed leftovers get to disappear before they are reported as survivors.
LEFTOVER_TIMEOUT = 2.0
#: Lines of a failed worker's traceback carried in its failure record.
TRACEBACK_TAIL = 30


@dataclass
class Attempt:
    """One generation's running state (mutable; owned by the agent's thread).

    ``spawn_error`` is set when the workers could not be started; ``interrupted`` is the signal
    that stopped the generation, if any; ``first_signal`` is what the teardown sends first;
    ``errors`` collects the agents' own errors (a lost store, another node's abort reason).
    """

    group: WorkerGroup
    start_time: float
    node: int  # this node's rank in the generation (its placement)
    spawn_error: Optional[str] = None
    interrupted: Optional[int] = None
    first_signal: int = signal.SIGTERM
    errors: list[str] = field(default_factory=list)
    watcher: Any = None  # a liveness.Watcher on several nodes
    mapping_due: bool = False  # node 0 prints the rank <-> host/pid table once every node has its pids


def pick_workers_port(cfg: LaunchConfig) -> int:
    """One node: the workers' MASTER_PORT -- a free one for ``--master-port 0`` (--standalone), else
    ``cfg.master_port`` once :func:`check_workers_port` found it free."""
    if cfg.master_port == 0:
        from ..netutil import free_port  # noqa: PLC0415

        return free_port(cfg.master_addr)
    check_workers_port(cfg.master_addr, cfg.master_port)
    return cfg.master_port


def check_workers_port(master_addr: str, port: int) -> None:
    """The workers' rank 0 will listen on MASTER_PORT: make sure it can.  Raises
    :class:`~procgroup.errors.PortInUseError` naming ``master_addr:port`` (and the holder, if known)."""
    from ..netutil import bind_listener, is_literal_loopback  # noqa: PLC0415

    host = "127.0.0.1" if is_literal_loopback(master_addr) else "0.0.0.0"
    try:
        bind_listener(host, port).close()
    except PortInUseError as e:
        raise PortInUseError(str(e).replace(f"0.0.0.0:{port}", f"{master_addr}:{port}")) from None


def usable_cpus() -> tuple[int, ...]:
    """This process's CPU affinity, sorted; () where the platform cannot say (then nothing is bound)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return ()


def terminal(from_head: bool) -> Optional[str]:
    """The terminal this agent runs on (for dist.breakpoint() in a worker), if any; never for an
    agent started by a head node (its stdio is the ssh session)."""
    if from_head:
        return None
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.ttyname(fd)
        except OSError:
            continue
    return None


def worker_specs(
    cfg: LaunchConfig,
    *,
    secret: str,
    restart: int,
    placement: Placement,
    hostname: str,
    environ: Mapping[str, str],
    error_dir: str,
    agent_pid: int,
    tty: Optional[str],
    cpus: Sequence[int] = (),
) -> list[WorkerSpec]:
    """The blueprints of this node's workers for generation ``restart``.

    ``cpus``: the CPUs this agent may use; with ``cfg.cpu_bind`` "auto" and more workers than them, each worker
    is bound to one (:func:`~.config.cpu_binding`; the bootstrap's ``--cpus``).

    Removes each worker's stale error file first (never mistake an earlier run's error for this
    one's); raises :class:`~procgroup.errors.ConfigError` only through :func:`worker_env`.
    """
    suffix = "" if restart == 0 else f".restart{restart}"
    binding = cpu_binding(placement.local_world_size, cpus, cfg.cpu_bind)
    specs = []
    for local in range(placement.local_world_size):
        rank = placement.rank(local)
        error_file = os.path.join(error_dir, f"rank{rank}{suffix}.error.json")
        try:
            os.unlink(error_file)
        except FileNotFoundError:
            pass
        env = worker_env(
            cfg,
            local,
            master_port=placement.master_port,
            secret=secret,
            hostname=hostname,
            error_file=error_file,
            restart_count=restart,
            base=environ,
            placement=placement,
            tty=tty,
        )
        argv = [sys.executable, BOOTSTRAP_PATH, "--parent-pid", str(agent_pid)]
        if binding is not None:
            argv += ["--cpus", ",".join(str(c) for c in binding[local])]
        if cfg.no_python:
            argv += ["--exec"]
        else:
            argv += ["--error-file", error_file, "--rank", str(rank), "--local-rank", str(local), "--host", hostname]
            if cfg.module:
                argv += ["-m"]
        argv += ["--", cfg.entrypoint, *cfg.local_rank_argv(local), *cfg.args]
        specs.append(
            WorkerSpec(
                rank=rank,
                local_rank=local,
                argv=tuple(argv),
                env=env,
                prefix=cfg.format_prefix(local, hostname, placement),
                error_file=error_file,
                log_file=os.path.join(cfg.log_dir, f"rank{rank}.log") if cfg.log_dir else None,
                log_append=restart > 0,
                to_console=cfg.shows_rank(rank),
            )
        )
    return specs


def worker_result(w: Worker, host: str) -> WorkerResult:
    """What the report says about worker ``w`` of ``host`` (its error file read if it is newer than the start)."""
    return WorkerResult(
        rank=w.rank,
        local_rank=w.spec.local_rank,
        host=host,
        pid=w.pid,
        returncode=w.returncode,
        start_time=w.start_time,
        end_time=w.end_time,
        signaled_by_agent=w.signaled_by_agent,
        signaled_at=w.signaled_at,
        error=load_error_file(w.spec.error_file, not_before=w.start_time),
        stderr_tail=tuple(w.stderr_tail),
    )


def failure_record(w: Worker, host: str, node: Optional[int]) -> dict[str, Any]:
    """What the other agents learn the moment worker ``w`` of this node fails (a JSON-able dict)."""
    wr = worker_result(w, host)
    tb = str((wr.error or {}).get("traceback") or "").rstrip("\n").splitlines() or list(wr.stderr_tail)
    return {
        "reason": f"rank {wr.rank} on {host} failed ({wr.status()})",
        "host": host,
        "node": node,
        "rank": wr.rank,
        "local_rank": wr.local_rank,
        "pid": wr.pid,
        "status": wr.status(),
        "returncode": wr.returncode,
        "timestamp": wr.failure_time,
        "traceback_tail": tb[-TRACEBACK_TAIL:],
        "worker": worker_to_dict(wr),
    }


def kill_leftovers(
    agent_pid: int, group: WorkerGroup, term_timeout: float, wait: Callable[[float], Any]
) -> tuple[list[ProcInfo], list[ProcInfo]]:
    """Kill every process still descending from the agent: SIGTERM, up to ``min(term_timeout,
    LEFTOVER_TIMEOUT)`` of grace, SIGKILL, up to LEFTOVER_TIMEOUT more; reaps adopted zombies on
    the way.  ``wait(seconds)`` sleeps (the agent's wakeable wait).  Returns (killed, survivors)."""
    known = [w.pid for w in group.workers]
    table = proc_table()  # one read of /proc answers both questions (zombies are not "left")
    reap_adopted_zombies(agent_pid, known, table)
    left = scan_leftovers(agent_pid, table=table)
    if not left:
        return [], []
    kill_pids(left, signal.SIGTERM)
    deadline = Deadline.after(min(term_timeout, LEFTOVER_TIMEOUT))
    while not deadline.expired():
        wait(0.05)
        reap_adopted_zombies(agent_pid, known)
        if not scan_leftovers(agent_pid):
            break
    kill_pids(scan_leftovers(agent_pid), signal.SIGKILL)
    deadline = Deadline.after(LEFTOVER_TIMEOUT)
    survivors = scan_leftovers(agent_pid)
    while survivors and not deadline.expired():
        wait(0.05)
        reap_adopted_zombies(agent_pid, known)
        survivors = scan_leftovers(agent_pid)
    reap_adopted_zombies(agent_pid, known)
    return left, survivors
