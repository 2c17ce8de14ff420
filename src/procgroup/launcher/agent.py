"""The node agent: host the store, start the workers, watch them, stop them, report.

One :class:`LocalAgent` runs per node (``procgroup run`` is its CLI).  Its
state machine::

    INIT --(store bound, workers spawned)--> HEALTHY
    HEALTHY --(every worker exited 0)--> SUCCEEDED
    HEALTHY --(a worker failed)--> STOPPING --> FAILED
    FAILED --(restarts left)--> RESTARTING --> HEALTHY      (a new generation)
    HEALTHY --(SIGINT/SIGTERM/SIGHUP to the agent)--> STOPPING --> INTERRUPTED

STOPPING is always the same teardown: the signal (SIGTERM, or the one the
agent received) to every worker's process group, ``--term-timeout`` seconds
of grace, SIGKILL, reap; then every process still descending from the agent
is killed by pid and reaped, and the ones that survive even that are
reported.  A second SIGINT/SIGTERM during the grace period skips to SIGKILL.

The store lives in the agent, not in a worker, so a rank that finishes
early never takes it down.  Waits are event-driven: SIGCHLD and the
forwarded signals wake the agent through ``signal.set_wakeup_fd``; each wait
also has a timeout, so a missed wake-up costs at most a second.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from enum import Enum
from types import FrameType
from typing import Mapping, Optional

from ..config import ENV, env_str
from ..deadline import Deadline
from ..errors import ConfigError
from ..protocol.auth import new_secret
from .cli import OMP_NUM_THREADS, LaunchConfig, worker_env
from .report import RunResult, WorkerResult, format_root_cause, format_summary, load_error_file
from .workers import (
    BOOTSTRAP_PATH,
    LineSink,
    WorkerGroup,
    WorkerSpec,
    kill_pids,
    reap_adopted_zombies,
    scan_leftovers,
    set_child_subreaper,
)

__all__ = ["RunState", "LocalAgent", "run"]

OMP_WARNING = (
    "*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system "
    "being overloaded, please further tune the variable for optimal performance in your application as needed. \n"
    "*****************************************"
)
#: How long to wait for the last output of dead workers (pipes held by nobody).
DRAIN_TIMEOUT = 2.0
#: How long killed leftovers get to disappear before they are reported as survivors.
LEFTOVER_TIMEOUT = 2.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunState(str, Enum):
    """States of :class:`LocalAgent` (the diagram is in the module docstring)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    STOPPING = "STOPPING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"


class LocalAgent:
    """Runs one node's share of the job described by a :class:`LaunchConfig`."""

    def __init__(
        self,
        cfg: LaunchConfig,
        sink: Optional[LineSink] = None,
        environ: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.cfg = cfg
        self.sink = sink or LineSink()
        self.environ = dict(os.environ if environ is None else environ)
        self.hostname = env_str(ENV.HOSTNAME, self.environ) or socket.gethostname()
        self.state = RunState.INIT
        self.pid = os.getpid()
        self.port: Optional[int] = None
        self._store = None
        self._signals: list[int] = []
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._saved_handlers: dict[int, object] = {}
        self._saved_wakeup: Optional[int] = None
        self._tmpdir: Optional[str] = None
        self._subreaper = False

    # ------------------------------------------------------------------ public

    def run(self) -> RunResult:
        """Run the job to the end; never raises for a worker failure (see the result)."""
        cfg = self.cfg
        if not cfg.module and not cfg.no_python and not os.path.exists(cfg.entrypoint):
            raise ConfigError(
                f"cannot open the script {os.path.abspath(cfg.entrypoint)!r}: no such file "
                "(use -m for a module, --no-python for an executable)"
            )
        secret = self._secret()
        if cfg.log_dir is not None:
            try:
                os.makedirs(cfg.log_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--log-dir {cfg.log_dir!r}: cannot create it ({e.strerror or e}); "
                                  "choose a writable directory") from e
        self._subreaper = set_child_subreaper()
        if cfg.hosts_store:
            self._start_store(secret)  # PortInUseError / ConfigError before anything is spawned
        else:
            self.port = cfg.master_port
        try:
            self._install_signals()
            if cfg.nproc_per_node > 1 and OMP_NUM_THREADS not in self.environ:
                self.sink.text(OMP_WARNING)
            restart = 0
            while True:
                result = self._run_attempt(secret, restart)
                if not result.is_failed():
                    self.state = RunState.SUCCEEDED
                    break
                if result.interrupted_by is not None:
                    self.state = RunState.INTERRUPTED
                    break
                if restart >= cfg.max_restarts or result.spawn_error is not None:
                    self.state = RunState.FAILED
                    break
                self.state = RunState.RESTARTING
                report = format_root_cause(result)
                self.sink.text(
                    (report + "\n" if report else "")
                    + format_summary(result, max_restarts=cfg.max_restarts)
                    + f"\nprocgroup run: restarting all {cfg.nproc_per_node} workers "
                      f"(restart {restart + 1} of max {cfg.max_restarts})"
                )
                restart += 1
                if cfg.hosts_store:  # a fresh store: no keys of the failed generation survive
                    self._close_store()
                    self._start_store(secret, port=self.port)
            report = format_root_cause(result)
            if report:
                self.sink.text(report)
            self.sink.text(format_summary(result, max_restarts=cfg.max_restarts))
            return result
        finally:
            self._restore_signals()
            self._close_store()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ setup

    def _secret(self) -> str:
        s = env_str(ENV.SECRET, self.environ)
        if s is not None:
            return s
        if self.cfg.nnodes > 1:
            raise ConfigError(
                f"--nnodes {self.cfg.nnodes}: every node must use the same job secret, and separate "
                f"`procgroup run` invocations cannot agree on a random one; export the same {ENV.SECRET} on every "
                f"node, e.g. {ENV.SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        return new_secret()

    def _start_store(self, secret: str, port: Optional[int] = None) -> None:
        from ..store import StoreServer  # noqa: PLC0415 - the launcher needs it only on node 0

        bind_port = self.cfg.master_port if port is None else port
        server = StoreServer(self.cfg.store_bind_host, bind_port, secret=secret.encode())
        self.port = int(server.start())
        self._store = server

    def _close_store(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            finally:
                self._store = None

    def _error_dir(self) -> str:
        if self.cfg.log_dir is not None:
            return self.cfg.log_dir
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix=f"procgroup-{self.cfg.run_id}-")
        return self._tmpdir

    def _specs(self, secret: str, restart: int) -> list[WorkerSpec]:
        cfg = self.cfg
        assert self.port is not None
        suffix = "" if restart == 0 else f".restart{restart}"
        specs = []
        for local in cfg.local_ranks():
            rank = cfg.global_rank(local)
            error_file = os.path.join(self._error_dir(), f"rank{rank}{suffix}.error.json")
            try:
                os.unlink(error_file)  # never mistake an earlier run's error for this one's
            except FileNotFoundError:
                pass
            env = worker_env(cfg, local, master_port=self.port, secret=secret, hostname=self.hostname,
                             error_file=error_file, restart_count=restart, base=self.environ)
            argv = [sys.executable, BOOTSTRAP_PATH, "--parent-pid", str(self.pid)]
            if cfg.no_python:
                argv += ["--exec"]
            else:
                argv += ["--error-file", error_file, "--rank", str(rank), "--local-rank", str(local),
                         "--host", self.hostname]
                if cfg.module:
                    argv += ["-m"]
            argv += ["--", cfg.entrypoint, *cfg.args]
            specs.append(WorkerSpec(
                rank=rank,
                local_rank=local,
                argv=tuple(argv),
                env=env,
                prefix=cfg.format_prefix(local, self.hostname),
                error_file=error_file,
                log_file=os.path.join(cfg.log_dir, f"rank{rank}.log") if cfg.log_dir else None,
                log_append=restart > 0,
                to_console=cfg.shows_rank(rank),
            ))
        return specs

    # ------------------------------------------------------------------ signals

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded use: no handlers; waits fall back to short timeouts
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake_r, self._wake_w = r, w
        self._saved_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in (*FORWARDED, signal.SIGCHLD):
            self._saved_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum != signal.SIGCHLD:
            self._signals.append(signum)

    def _restore_signals(self) -> None:
        for sig, h in self._saved_handlers.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
        self._saved_handlers.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._saved_wakeup if self._saved_wakeup is not None else -1)
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None

    def _wake(self, timeout: float) -> None:
        """Block until a signal arrives (SIGCHLD included) or ``timeout`` seconds pass."""
        if self._wake_r is None:
            time.sleep(min(timeout, 0.05))
            return
        try:
            ready, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout))
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            return
        if ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

    # ------------------------------------------------------------------ one generation

    def _run_attempt(self, secret: str, restart: int) -> RunResult:
        cfg = self.cfg
        t0 = time.time()
        group = WorkerGroup(self._specs(secret, restart), self.sink)
        spawn_error: Optional[str] = None
        interrupted: Optional[int] = None
        if restart and cfg.log_dir:
            for s in group.specs:
                if s.log_file:
                    with open(s.log_file, "ab") as f:
                        f.write(f"===== procgroup: restart {restart} =====\n".encode())
        try:
            group.start()
        except OSError as e:
            spawn_error = f"{e.strerror or e} while starting {sys.executable} for {cfg.entrypoint!r}"
        self.state = RunState.HEALTHY if spawn_error is None else RunState.STOPPING

        first_signal = signal.SIGTERM
        try:
            while spawn_error is None:
                finished = group.poll()
                if any(w.failed for w in finished):
                    break
                if not group.alive():
                    break
                if self._signals:
                    interrupted = self._signals[0]
                    first_signal = interrupted
                    break
                self._wake(1.0)
        except BaseException:  # a bug in the agent itself: never leave the workers behind
            group.stop(signal.SIGKILL, 0.0)
            group.close()
            raise

        self.state = RunState.STOPPING
        seen = len(self._signals)
        # SIGTERM (or the signal the agent got) to every group, grace, SIGKILL, reap.  A further
        # signal to the agent during the grace period means "now": skip straight to SIGKILL.
        stuck = group.stop(first_signal, cfg.term_timeout, self._wake, abort=lambda: len(self._signals) > seen)
        if stuck:
            self.sink.text("procgroup run: warning: " + ", ".join(f"rank {w.rank} (pid {w.pid})" for w in stuck)
                           + " did not exit within 5 s of SIGKILL (uninterruptible sleep in the kernel?)")

        killed, survivors = self._kill_leftovers(group)
        if not group.pump.drain(Deadline.after(DRAIN_TIMEOUT)):
            self.sink.text("procgroup run: warning: worker output pipes still open after teardown; "
                           "some output may be missing")
        group.close()
        if interrupted is None and self._signals:
            interrupted = self._signals[0]  # arrived during teardown of a failure: still report it

        results = tuple(
            WorkerResult(
                rank=w.rank,
                local_rank=w.spec.local_rank,
                host=self.hostname,
                pid=w.pid,
                returncode=w.returncode,
                start_time=w.start_time,
                end_time=w.end_time,
                signaled_by_agent=w.signaled_by_agent,
                signaled_at=w.signaled_at,
                error=load_error_file(w.spec.error_file, not_before=w.start_time),
                stderr_tail=tuple(w.stderr_tail),
            )
            for w in group.workers
        )
        return RunResult(
            workers=results,
            run_id=cfg.run_id,
            host=self.hostname,
            restart_count=restart,
            interrupted_by=interrupted,
            leftovers_killed=tuple(p.describe() for p in killed),
            still_alive=tuple(p.describe() for p in survivors),
            spawn_error=spawn_error,
            start_time=t0,
            end_time=time.time(),
        )

    def _kill_leftovers(self, group: WorkerGroup):  # type: ignore[no-untyped-def]
        """Kill every process still descending from the agent; returns (killed, survivors)."""
        known = [w.pid for w in group.workers]
        reap_adopted_zombies(self.pid, known)
        left = scan_leftovers(self.pid)
        if not left:
            return [], []
        kill_pids(left, signal.SIGTERM)
        deadline = Deadline.after(min(self.cfg.term_timeout, LEFTOVER_TIMEOUT))
        while not deadline.expired():
            self._wake(0.05)
            reap_adopted_zombies(self.pid, known)
            if not scan_leftovers(self.pid):
                break
        kill_pids(scan_leftovers(self.pid), signal.SIGKILL)
        deadline = Deadline.after(LEFTOVER_TIMEOUT)
        survivors = scan_leftovers(self.pid)
        while survivors and not deadline.expired():
            self._wake(0.05)
            reap_adopted_zombies(self.pid, known)
            survivors = scan_leftovers(self.pid)
        reap_adopted_zombies(self.pid, known)
        return left, survivors


def run(cfg: LaunchConfig, sink: Optional[LineSink] = None) -> int:
    """Run the job; the process exit code (0, the first failure's code, 128+signal)."""
    return LocalAgent(cfg, sink).run().exit_code

