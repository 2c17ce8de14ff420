"""The node agent: start the workers, watch them, stop them, report -- alone or as one of a gang of nodes.

One :class:`LocalAgent` runs per node (``procgroup run`` is its CLI).  Its
state machine::

    INIT --(rendezvous done, workers spawned)--> HEALTHY
    HEALTHY --(every worker exited 0)--> SUCCEEDED
    HEALTHY --(a worker failed, here or on another node)--> STOPPING --> FAILED
    FAILED --(restarts left)--> RESTARTING --> HEALTHY      (a new generation, on every node)
    HEALTHY --(SIGINT/SIGTERM/SIGHUP to the agent)--> STOPPING --> INTERRUPTED

STOPPING is always the same teardown: the signal (SIGTERM, or the one the
agent received) to every worker's process group, ``--term-timeout`` seconds
of grace, SIGKILL, reap; then every process still descending from the agent
is killed by pid and reaped, and the ones that survive even that are
reported.  A second SIGINT/SIGTERM during the grace period skips to SIGKILL.

SIGUSR1 is not a stop: the agent passes it on to every worker's process
group (procgroup's workers then print their stacks and recent collectives),
and through the store to every other node's agent (:mod:`.liveness`); a head
node passes it on to every host's agent.

Elastic membership (``--nnodes MIN:MAX``, :mod:`.elastic`): a node lost or
arriving ends the generation like a failure does, and the agents re-form the
job as the next generation (RESTARTING) with the nodes they have.

Several nodes (``--nnodes M``, srun, or started by a head node): node 0's
agent hosts the agents' store at ``--master-addr:--master-port`` and every
agent talks to it through a :class:`~procgroup.launcher.gang.Gang` --
rendezvous of the agents first (node ranks, global ranks, the workers' port),
then, while the workers run, a watcher thread parked on the generation's
abort key.  An agent whose worker fails writes a failure record there before
it stops its own workers, so every node starts its teardown within a store
round trip; losing the store, or a node going silent (heartbeats), stops the
job too.  After the teardown every agent posts its results and reads
everyone's: each prints the job's root cause (the first failure by time),
node 0 prints the table of all ranks, and all exit with the same code.

The workers' ``MASTER_ADDR:MASTER_PORT`` is *not* the agents' store: it is a
free port (node 0 picks it each generation) where the workers' rank 0 hosts
its own store -- procgroup's, or torch's when an unmodified torch.distributed
script runs under ``procgroup run`` (torch's rank 0 insists on binding
MASTER_PORT).  Waits are event-driven: SIGCHLD, the forwarded signals and the
watcher wake the agent through ``signal.set_wakeup_fd``'s pipe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..config import ENV, SHM_DIR, SHM_SEGMENT_PREFIX, env_str
from ..deadline import Deadline
from ..errors import ConfigError, PortInUseError, RendezvousError
from ..protocol.control import ControlMessage, PortAnnounce, Report
from .attempt import (
    LEFTOVER_TIMEOUT,
    Attempt,
    check_workers_port,
    failure_record,
    kill_leftovers,
    pick_workers_port,
    terminal,
    usable_cpus,
    worker_result,
    worker_specs,
)
from .config import OMP_NUM_THREADS, LaunchConfig, Placement, cpu_binding
from .control import (
    CTL_MARK,
    HELLO_TIMEOUT,
    agent_line,
    die_with_session,
    read_hello,
    watch_stdin,
)
from .jobsecret import remove_secret_file, resolve_secret
from .report import (
    RunResult,
    combine_results,
    format_root_cause,
    format_summary,
    result_to_json,
    slim,
)
from .runinfo import publish_run, remove_run_info
from .signals import SignalWaiter
from .workers import (
    KILL_TIMEOUT,
    LineSink,
    WorkerGroup,
    set_child_subreaper,
    signal_name,
)

if TYPE_CHECKING:  # pragma: no cover - the gang is imported where a job has several nodes: one node never needs it
    from .gang import Assignment, Gang

__all__ = ["RunState", "LocalAgent", "run", "CTL_MARK", "is_local_address"]

#: One line, printed once when several workers share a node and OMP_NUM_THREADS is not set.
OMP_WARNING = (
    "procgroup run: OMP_NUM_THREADS=1 in each worker (several share this node); "
    "export OMP_NUM_THREADS to use more threads per worker"
)
#: How long to wait for the last output of dead workers (pipes held by nobody).
DRAIN_TIMEOUT = 2.0


class RunState(str, Enum):
    """States of :class:`LocalAgent` (the diagram is in the module docstring)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    STOPPING = "STOPPING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"


def _any_shm_segment() -> bool:
    """Whether any procgroup shared-memory segment (of any job) exists: a cheap test before the exact cleanup."""
    try:
        return any(n.startswith(SHM_SEGMENT_PREFIX) for n in os.listdir(SHM_DIR))
    except OSError:
        return False


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (one of its addresses binds here; 127.0.1.1 included)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return False
    for fam, _t, _p, _c, sa in infos:
        try:
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.bind((sa[0], 0))
            return True
        except OSError:
            continue
    return False


class LocalAgent(SignalWaiter):
    """Runs one node's share of the job described by a :class:`LaunchConfig`."""

    def __init__(
        self,
        cfg: LaunchConfig,
        sink: Optional[LineSink] = None,
        environ: Optional[Mapping[str, str]] = None,
        stdin_fd: int = 0,
    ) -> None:
        self.cfg = cfg
        self.sink = sink or LineSink()
        self.environ = dict(os.environ if environ is None else environ)
        self.hostname = env_str(ENV.HOSTNAME, self.environ) or socket.gethostname()
        self.state = RunState.INIT
        self.pid = os.getpid()
        #: the CPUs this agent may use (what srun, mpirun, a cgroup or taskset gave it): --cpu-bind binds within them
        self._cpus: tuple[int, ...] = usable_cpus()
        self.port: Optional[int] = None  # the workers' MASTER_PORT (one node)
        self.node_rank: Optional[int] = cfg.node_rank
        self.gang: Optional[Gang] = None
        self._multi = cfg.nnodes > 1 or cfg.from_head
        self._node0 = True
        self._stdin_fd = stdin_fd
        self._nonce: Optional[str] = None
        self._head_secret: Optional[str] = None
        self._stdin_closed = False
        self._usr1_relayed = 0  # SIGUSR1s the head node relayed (every agent gets its own line)
        self._secret_file: Optional[str] = None  # srun mode, node 0: the file it wrote
        self._init_signals()
        self._tmpdir: Optional[str] = None
        self._subreaper = False
        self._reported_nodes: list[int] = []
        self._last_gen: Optional[int] = None  # the last generation started (its shm segments are checked)
        self._gen = 0  # the generation the last rendezvous gave (elastic: an arrival starts at a later one)
        self._membership: Optional[str] = None  # elastic: why the last generation's membership changed
        self._lost: list[str] = []  # elastic: the nodes lost so far (named when fewer than MIN remain)
        self._expect: Optional[int] = None  # elastic: how many agents should come back after a loss
        self._runinfo: Optional[str] = None  # the run-info file `procgroup top RUN_ID` reads (runinfo.py)

    # ------------------------------------------------------------------ public

    def run(self) -> RunResult:
        """Run the job to the end; never raises for a worker failure (see the result)."""
        secret = self._prepare()
        self._last_gen = None
        # Only the agents' protocol raises GangAborted; on one node ``except ()`` catches nothing and the
        # gang module is not even imported.
        aborted: tuple[type[BaseException], ...] = ()
        try:
            self._install_signals()
            if self.cfg.from_head:
                threading.Thread(target=self._watch_stdin, name="procgroup-head-stdin", daemon=True).start()
            if self._multi:
                from .gang import GangAborted  # noqa: PLC0415

                aborted = (GangAborted,)
                try:
                    secret = self._open_gang(secret)
                except aborted as e:
                    result = self._aborted_result(str(e), 0)
                    self._report(result)
                    return result
            assert secret is not None
            result = self._generations(secret, aborted)
            self._report(result)
            return result
        finally:
            self._cleanup_shm(self._last_gen)
            if self.gang is not None:
                self.gang.close(self.node_rank, self._last_gen, self._reported_nodes)
            self._remove_secret_file()
            remove_run_info(self._runinfo)
            self._restore_signals()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _prepare(self) -> Optional[str]:
        """Checks and setup before any signal handler is installed: the program exists, the head's hello
        (--from-head), whether this is node 0, the secret, the log directory, the child subreaper.
        Returns the secret (None: an srun node other than 0, see :meth:`_secret`); raises ConfigError."""
        cfg = self.cfg
        if not cfg.module and not cfg.no_python and not os.path.exists(cfg.entrypoint):
            raise ConfigError(
                f"cannot open the script {os.path.abspath(cfg.entrypoint)!r}: no such file "
                "(use -m for a module, --no-python for an executable)"
            )
        if cfg.from_head:
            self._read_head_hello()
        if self._multi:
            self._node0 = cfg.node_rank == 0 or (cfg.node_rank is None and is_local_address(cfg.master_addr))
        secret = self._secret(self._node0)
        if cfg.log_dir is not None:
            try:
                os.makedirs(cfg.log_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"--log-dir {cfg.log_dir!r}: cannot create it ({e.strerror or e}); choose a writable directory"
                ) from e
        self._subreaper = set_child_subreaper()
        return secret

    def _generations(self, secret: str, aborted: tuple[type[BaseException], ...]) -> RunResult:
        """Run generation after generation (the gang restarts) until one ends for good; sets ``state``."""
        cfg = self.cfg
        restart = 0
        while True:
            try:
                placement, assignment = self._plan(restart)
            except aborted as e:
                result = self._aborted_result(str(e), restart)
                self.state = RunState.INTERRUPTED if result.interrupted_by is not None else RunState.FAILED
                return result
            restart = self._gen
            self._membership = None
            self._last_gen = restart
            if self._speaks_for_job():
                self._runinfo = publish_run(
                    self._runinfo,
                    cfg,
                    placement,
                    secret=secret,
                    restart=restart,
                    agent_pid=self.pid,
                    host=self.hostname,
                    environ=self.environ,
                    warn=self._say,
                )
            # the first attempt's notices; under a head node only node 0's agent prints them
            if restart == 0 and not (cfg.from_head and placement.node_rank != 0):
                if placement.local_world_size > 1 and OMP_NUM_THREADS not in self.environ:
                    self.sink.text(OMP_WARNING)
                if cpu_binding(placement.local_world_size, self._cpus, cfg.cpu_bind) is not None:
                    self.sink.text(
                        f"procgroup run: {placement.local_world_size} workers on this node's {len(self._cpus)} "
                        f"CPU{'s' if len(self._cpus) > 1 else ''}: "
                        "each bound to one, round-robin (--cpu-bind none leaves them to the scheduler)"
                    )
            local = self._run_attempt(secret, restart, placement, assignment)
            result = self._conclude(local, restart, assignment)
            final = self._final_state(result, restart)
            if final is not None:
                self.state = final
                if final is RunState.FAILED and self._membership and not result.agent_errors:
                    why = f"{self._membership}, but all --max-restarts {cfg.max_restarts} were used"
                    result = replace(result, agent_errors=(why,))
                return result
            self.state = RunState.RESTARTING
            self._announce_restart(result, restart)
            restart += 1

    def _final_state(self, result: RunResult, restart: int) -> Optional[RunState]:
        """How the job ends after generation ``restart`` gave ``result``; None: restart the gang (elastic: also
        when a node was lost or arrived)."""
        finished = bool(result.workers) and all(w.returncode == 0 for w in result.workers) and self._expect is None
        if self._membership is not None and result.interrupted_by is None and result.spawn_error is None:
            if finished:  # a node arrived after every worker had succeeded: the job is done
                return RunState.SUCCEEDED
            return RunState.FAILED if restart >= self.cfg.max_restarts else None
        if not result.is_failed():
            return RunState.SUCCEEDED
        if result.interrupted_by is not None:
            return RunState.INTERRUPTED
        if restart >= self.cfg.max_restarts or result.spawn_error is not None or result.agent_errors:
            return RunState.FAILED
        return None

    def _announce_restart(self, result: RunResult, restart: int) -> None:
        """Print the failed generation's root cause (and, for the job, its table), then the restart line."""
        cfg = self.cfg
        if cfg.from_head and self.node_rank != 0:  # the head relays node 0's lines only once
            return
        report = format_root_cause(result)
        if self._speaks_for_job():
            report = (report + "\n" if report else "") + format_summary(result, max_restarts=cfg.max_restarts)
        if report and self._membership is None:
            self.sink.text(report)
        n = len(result.workers)
        where = f" on {result.nnodes} nodes" if result.nnodes > 1 else ""
        if self._membership is not None:
            self._say(
                f"stopped all {n} workers{where}; re-forming the job (restart {restart + 1} of {cfg.max_restarts}) "
                f"because {self._membership}"
            )
            return
        self._say(f"restarting all {n} workers{where} (restart {restart + 1} of max {cfg.max_restarts})")

    def _cleanup_shm(self, last_gen: Optional[int]) -> None:
        """Unlink shared-memory segments of this job that workers could not (all SIGKILLed while forming)."""
        if last_gen is None or not _any_shm_segment():
            return  # the usual case: the workers unlinked their own; skip importing the transport (~25 ms)
        from ..transport.shm import cleanup_job_segments  # noqa: PLC0415 - the launcher may use the library

        for gen in range(last_gen + 1):
            for name in cleanup_job_segments(f"{self.cfg.run_id}/{gen}"):
                self._say(f"removed leftover shared-memory segment /dev/shm/{name}")

    # ------------------------------------------------------------------ setup

    def _secret(self, node0: bool = True) -> Optional[str]:
        """The job secret (:func:`~.jobsecret.resolve_secret`); remembers the srun file node 0 wrote."""
        secret, written = resolve_secret(self.cfg, self.environ, head_secret=self._head_secret, node0=node0)
        if written is not None:
            self._secret_file = written
        return secret

    def _remove_secret_file(self) -> None:
        remove_secret_file(self._secret_file)
        self._secret_file = None

    def _read_head_hello(self) -> None:
        """--from-head: one JSON line on stdin with the job secret and the control-line nonce."""
        hello = read_hello(self._stdin_fd, HELLO_TIMEOUT)
        self._head_secret = hello.secret
        self._nonce = hello.nonce
        die_with_session()

    def _watch_stdin(self) -> None:
        """--from-head: EOF on stdin (the head exited or closed the session) stops the job, like SIGTERM;
        a ``usr1`` line is the head passing on a SIGUSR1."""

        def usr1() -> None:
            self._usr1_relayed += 1  # the head passes it on to every agent: pass it on here only
            self._poke()

        watch_stdin(self._stdin_fd, usr1)
        self._stdin_closed = True
        self._signals.append(signal.SIGTERM)
        self._poke()

    def _open_gang(self, secret: Optional[str]) -> str:
        from .gang import Gang, GangAborted  # noqa: PLC0415

        cfg = self.cfg
        self.gang = Gang(
            host=self.hostname,
            master_addr=cfg.master_addr,
            port=cfg.master_port,
            nnodes=cfg.nnodes,
            node0=self._node0,
            join_timeout=cfg.join_timeout,
            interrupted=lambda: bool(self._signals),
            wakeup=self._poke,
            progress=self._say,
            heartbeat_timeout=cfg.heartbeat_timeout,
        )
        if self._node0:
            assert secret is not None
            try:
                port = self.gang.serve(secret)
            except PortInUseError as e:
                if cfg.elastic:  # another agent of this host hosts it (torchrun's c10d does the same)
                    self._node0 = self.gang.node0 = False
                elif cfg.node_rank is None:
                    raise PortInUseError(
                        f"{e}; if another agent of this job runs on this host, give each agent its --node-rank"
                    ) from None
                else:
                    raise
            else:
                if cfg.from_head:
                    self._ctl(PortAnnounce(port=port))
        if secret is not None:
            fixed = secret
            self.gang.connect(lambda: fixed)
            return fixed
        from .slurm import secret_path, wait_secret_file  # noqa: PLC0415

        assert cfg.slurm_step is not None
        path = secret_path(cfg.slurm_step)
        deadline = Deadline.after(cfg.join_timeout)
        got: list[str] = []

        def read() -> str:
            try:
                v = wait_secret_file(path, deadline, lambda: bool(self._signals), self._wake)
            except InterruptedError:
                raise GangAborted("interrupted while waiting for node 0's secret file") from None
            got.append(v)
            return v

        self.gang.connect(read, retry_auth=True)
        return got[-1]

    def _plan(self, restart: int) -> tuple[Placement, Optional[Assignment]]:
        """Where this node's workers sit in generation ``restart`` (the agents' rendezvous on several nodes)."""
        cfg = self.cfg
        self._gen = restart  # elastic: the rendezvous may move it on
        if self.gang is None:
            if self.port is None:
                self.port = pick_workers_port(cfg)
            else:
                check_workers_port(cfg.master_addr, self.port)
            return Placement.uniform(cfg, self.port), None
        from ..netutil import free_port  # noqa: PLC0415
        from .gang import AgentInfo  # noqa: PLC0415

        me = AgentInfo(
            host=self.hostname,
            pid=self.pid,
            nproc=cfg.nproc_per_node,
            nnodes=cfg.nnodes,
            run_id=cfg.run_id,
            max_restarts=cfg.max_restarts,
            node_rank=self.node_rank,
            hosts_store=self._node0,
            worker_port=free_port("0.0.0.0") if self._node0 else None,
            conn=self.gang.conn_address,
            min_nodes=cfg.min_nnodes,
        )
        try:
            if cfg.elastic:
                from .elastic import join_elastic  # noqa: PLC0415

                assert cfg.min_nnodes is not None
                assignment, node, self._gen = join_elastic(
                    self.gang, restart, me, min_nodes=cfg.min_nnodes, max_nodes=cfg.nnodes,
                    window=cfg.join_window, lost=self._lost, expect=self._expect, progress=self._say,
                )  # fmt: skip
            else:
                assignment, node = self.gang.join(restart, me)
        except RendezvousError as e:  # the nodes' flags disagree, too many agents, a timeout: same on every node
            raise ConfigError(str(e)) from None
        self.node_rank = node
        if restart == 0:
            self._remove_secret_file()  # every agent has joined, so every agent has read it
            if cfg.ranks_filter is not None:
                bad = sorted(r for r in cfg.ranks_filter if not 0 <= r < assignment.world_size)
                if bad:
                    raise ConfigError(
                        f"--ranks-filter names rank(s) {bad} but the job has ranks 0..{assignment.world_size - 1}"
                    )
            if node == 0 and cfg.notes:
                self._say("derived: " + "; ".join(cfg.notes))
        return assignment.placement(node, cfg.master_addr), assignment

    def _error_dir(self) -> str:
        if self.cfg.log_dir is not None:
            return self.cfg.log_dir
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix=f"procgroup-{self.cfg.run_id}-")
        return self._tmpdir

    # ------------------------------------------------------------------ messages

    def _label(self) -> str:
        if not self._multi:
            return "procgroup run"
        node = "?" if self.node_rank is None else self.node_rank
        return f"procgroup run [{self.hostname} node {node}]"

    def _say(self, msg: str) -> None:
        self.sink.text(f"{self._label()}: {msg}")

    def _ctl(self, msg: ControlMessage) -> None:
        """A control line for the head node (--from-head), on stdout with the head's nonce."""
        if self._nonce is None:
            return
        self.sink.line(agent_line(self._nonce, msg), err=False)

    def _speaks_for_job(self) -> bool:
        """Whether this agent prints the job-wide report: one node, or node 0 (the head relays node 0's)."""
        return not self._multi or self.node_rank == 0

    # ------------------------------------------------------------------ signals

    # ------------------------------------------------------------------ one generation

    def _run_attempt(
        self, secret: str, restart: int, placement: Placement, assignment: Optional[Assignment]
    ) -> RunResult:
        """One generation on this node: start the workers, supervise them until they end, fail, are
        interrupted or another node stops the job, then tear down and return this node's result."""
        att = self._start_attempt(secret, restart, placement, assignment)
        try:
            self._supervise(att, restart, assignment)
        except BaseException:  # a bug in the agent itself: never leave the workers behind
            att.group.stop(signal.SIGKILL, 0.0)
            att.group.close()
            raise
        return self._stop_attempt(att, restart)

    def _start_attempt(
        self, secret: str, restart: int, placement: Placement, assignment: Optional[Assignment]
    ) -> Attempt:
        """Spawn generation ``restart``'s workers; on several nodes, publish their pids, pass on a spawn
        failure to the other agents and start watching for theirs."""
        cfg = self.cfg
        gang = self.gang
        node = placement.node_rank
        specs = worker_specs(
            cfg,
            secret=secret,
            restart=restart,
            placement=placement,
            hostname=self.hostname,
            environ=self.environ,
            error_dir=self._error_dir(),
            agent_pid=self.pid,
            tty=terminal(cfg.from_head),
            cpus=self._cpus,
        )
        att = Attempt(group=WorkerGroup(specs, self.sink), start_time=time.time(), node=node)
        if restart and cfg.log_dir:
            for s in att.group.specs:
                if s.log_file:
                    with open(s.log_file, "ab") as f:
                        f.write(f"===== procgroup: restart {restart} =====\n".encode())
        try:
            att.group.start(stop=lambda: bool(self._signals))  # a signal ends the spawn loop at once
        except OSError as e:
            att.spawn_error = f"{e.strerror or e} while starting {sys.executable} for {cfg.entrypoint!r}"
        self.state = RunState.HEALTHY if att.spawn_error is None else RunState.STOPPING
        if gang is not None and assignment is not None:
            gang.publish_pids(restart, node, [[w.rank, w.spec.local_rank, w.pid] for w in att.group.workers])
            if att.spawn_error is not None:
                gang.abort(
                    restart,
                    {
                        "reason": f"could not start the workers on {self.hostname}: {att.spawn_error}",
                        "host": self.hostname,
                        "node": node,
                        "timestamp": time.time(),
                    },
                )
            att.watcher = gang.watch(restart, node, assignment)
            att.mapping_due = node == 0 and att.spawn_error is None
        return att

    def _supervise(self, att: Attempt, restart: int, assignment: Optional[Assignment]) -> None:
        """Wait (event-driven) until a worker fails, all succeed, the agent is signalled or another node
        stops the job; records in ``att`` why the generation ends.  Passes SIGUSR1 on to the workers: one
        sent to this agent also to every other node's (through the store), one relayed by the head or
        counted by another agent only here."""
        gang = self.gang
        group = att.group
        usr1 = (self._usr1, self._usr1_relayed, 0)
        while att.spawn_error is None:
            now = (self._usr1, self._usr1_relayed, att.watcher.usr1 if att.watcher is not None else 0)
            if now != usr1:
                if now[0] != usr1[0] and gang is not None:
                    gang.publish_usr1()
                usr1 = now
                group.forward(signal.SIGUSR1)
            finished = group.poll()
            failed = [w for w in finished if w.failed]
            if failed:
                if gang is not None:
                    gang.report_failure(restart, att.node, failure_record(failed[0], self.hostname, self.node_rank))
                return
            if not group.alive():
                return
            if self._signals:
                att.interrupted = att.first_signal = self._signals[0]
                if gang is not None:
                    gang.abort(
                        restart,
                        {
                            "reason": self._interrupt_reason(att.interrupted),
                            "host": self.hostname,
                            "node": att.node,
                            "timestamp": time.time(),
                        },
                    )
                return
            if att.watcher is not None and att.watcher.triggered:
                self._note_abort(att)
                return
            if att.mapping_due:
                self._print_mapping(att, restart, assignment)
            self._wake(0.25 if att.mapping_due else 1.0)

    def _note_abort(self, att: Attempt) -> None:
        """Another node stopped the job (or the store was lost): keep the agents' reasons in ``att.errors``
        (a worker failure elsewhere is reported from its own record, not as an agent error)."""
        watcher = att.watcher
        if watcher.lost is not None:
            att.errors.append(watcher.lost)
        att.errors.extend(watcher.lost_nodes.values())
        for why in att.errors:  # said now, with its time, not only in the final report
            self._say(f"stopping this node's workers: {why}")
        rec = watcher.abort_record
        if rec is not None and rec.get("membership"):
            self._say(f"stopping this node's workers: {rec.get('reason')}")
            return  # an arrival (elastic): not an error
        if rec is not None and "worker" not in rec and rec.get("node") != att.node:
            why = str(rec.get("reason") or "another agent stopped the job")
            if why not in att.errors:
                att.errors.append(why)

    def _note_membership(self, watcher: Any) -> None:
        """Elastic: whether this generation ended because a node was lost or arrived (``_membership``); the
        lost nodes are remembered for the error that names them when fewer than MIN remain."""
        if watcher.lost is not None:
            return  # the store itself is gone: nothing to re-form around
        lost = [why for why in watcher.lost_nodes.values() if why not in self._lost]
        self._lost.extend(lost)
        self._expect = len(watcher.assignment.nodes) - len(watcher.lost_nodes) if lost else None
        rec = watcher.abort_record or {}
        if lost or rec.get("membership"):
            self._membership = "; ".join(lost) or str(rec.get("reason"))

    def _print_mapping(self, att: Attempt, restart: int, assignment: Optional[Assignment]) -> None:
        """Node 0: once every node has published its pids, print the rank <-> host/pid table (once)."""
        assert self.gang is not None and assignment is not None
        pids = self.gang.pids_if_ready(restart, len(assignment.nodes))
        if pids is not None:
            from .gang import format_mapping  # noqa: PLC0415

            self.sink.text(format_mapping(assignment, pids, run_id=self.cfg.run_id, restart=restart))
            att.mapping_due = False

    def _stop_attempt(self, att: Attempt, restart: int) -> RunResult:
        """The teardown (signal, grace, SIGKILL, reap, leftovers, drain the output) and this node's result."""
        cfg = self.cfg
        group = att.group
        self.state = RunState.STOPPING
        seen = len(self._signals)
        # SIGTERM (or the signal the agent got) to every group, grace, SIGKILL, reap.  A further
        # signal to the agent during the grace period means "now": skip straight to SIGKILL.
        stuck = group.stop(att.first_signal, cfg.term_timeout, self._wake, abort=lambda: len(self._signals) > seen)
        if stuck:
            self._say(
                "warning: "
                + ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stuck)
                + " did not exit within 5 s of SIGKILL (uninterruptible sleep in the kernel?)"
            )
        killed, survivors = kill_leftovers(self.pid, group, cfg.term_timeout, self._wake)
        if not group.pump.drain(Deadline.after(DRAIN_TIMEOUT)):
            self._say("warning: worker output pipes still open after teardown; some output may be missing")
        group.close()
        interrupted = att.interrupted
        if interrupted is None and self._signals:
            interrupted = self._signals[0]  # arrived during teardown of a failure: still report it
        errors = list(att.errors)
        if interrupted is not None and self._multi:
            errors.insert(0, self._interrupt_reason(interrupted))
        return RunResult(
            workers=tuple(worker_result(w, self.hostname) for w in group.workers),
            run_id=cfg.run_id,
            host=self.hostname,
            restart_count=restart,
            interrupted_by=interrupted,
            leftovers_killed=tuple(p.describe() for p in killed),
            still_alive=tuple(p.describe() for p in survivors),
            spawn_error=att.spawn_error,
            start_time=att.start_time,
            end_time=time.time(),
            agent_errors=tuple(errors),
        )

    def _interrupt_reason(self, sig: int) -> str:
        if self._stdin_closed or (self.cfg.from_head and sig == signal.SIGTERM and os.getppid() == 1):
            return (
                f"the ssh session of the agent on {self.hostname} ended (the head node exited, was stopped, "
                "or lost the connection)"
            )
        return f"the agent on {self.hostname} received {signal_name(sig)}"

    def _conclude(self, local: RunResult, gen: int, assignment: Optional[Assignment]) -> RunResult:
        """One node: its own result.  Several: post ours, collect everyone's, combine (the same on every node)."""
        gang = self.gang
        if gang is None or assignment is None or self.node_rank is None:
            return local
        gang.post_result(gen, self.node_rank, slim(local))
        settle = self.cfg.term_timeout + KILL_TIMEOUT + DRAIN_TIMEOUT + 2 * LEFTOVER_TIMEOUT + 5.0
        got, errors = gang.collect(gen, assignment, settle)
        if gang.watcher is not None:
            gang.watcher.stop()
            if self.cfg.elastic:
                self._note_membership(gang.watcher)
        if self._signals and local.interrupted_by is None:
            errors.append(
                f"the agent on {self.hostname} received {signal_name(self._signals[0])} "
                "while waiting for the other nodes"
            )
            gang.abort(
                gen, {"reason": errors[-1], "host": self.hostname, "node": self.node_rank, "timestamp": time.time()}
            )
        self._reported_nodes = sorted(got)
        return combine_results(
            [got[n] for n in sorted(got)],
            hosts=assignment.hosts,
            run_id=self.cfg.run_id,
            restart_count=gen,
            extra_errors=errors,
        )

    def _aborted_result(self, why: str, gen: int) -> RunResult:
        interrupted = self._signals[0] if self._signals else None
        errors = () if interrupted is not None else (why,)
        return RunResult(
            workers=(),
            run_id=self.cfg.run_id,
            host=self.hostname,
            restart_count=gen,
            interrupted_by=interrupted,
            agent_errors=errors,
        )

    def _report(self, result: RunResult) -> None:
        cfg = self.cfg
        if not result.workers and not cfg.from_head:  # stopped before any worker started
            if result.interrupted_by is not None:
                self._say(f"interrupted by {signal_name(result.interrupted_by)} before the workers started")
            for e in result.agent_errors:
                self._say(f"error: {e}")
            return
        if cfg.from_head:
            self._ctl(
                Report(
                    node=self.node_rank,
                    host=self.hostname,
                    exit_code=result.exit_code,
                    result=json.loads(result_to_json(slim(result))),
                )
            )
            return
        report = format_root_cause(result)
        if report:
            self.sink.text(report)
        if self._speaks_for_job():
            self.sink.text(format_summary(result, max_restarts=cfg.max_restarts))
        else:
            state = "FAILED" if result.is_failed() else "succeeded"
            self._say(f"the job {state} (exit code {result.exit_code}); node 0's agent prints the table of all ranks")


def run(cfg: LaunchConfig, sink: Optional[LineSink] = None) -> int:
    """Run the job; the process exit code (0, the first failure's code, 128+signal)."""
    return LocalAgent(cfg, sink).run().exit_code
