"""The head node: one ssh session per host of the hostfile, each running that host's agent.

:class:`HeadNode` runs ``procgroup run --hostfile``.  It

1. prints which environment variables it forwards (:class:`~.hosts.EnvPolicy`);
2. starts node 0's agent over ssh and, unless ``--master-port`` was given,
   waits for the port that agent's store got (a control line on its stdout);
3. starts the other hosts' agents with that port;
4. relays every host's output (worker lines are already ``[host:rank]``
   prefixed by the agents) and keeps the control lines to itself;
5. prints the root cause and the table of all ranks from the agents' final
   reports (node 0's, which holds every node's rows), and exits with the
   job's exit code.

Ctrl-C / SIGTERM / SIGHUP on the head: it closes every session's stdin --
each agent treats EOF as SIGTERM, stops its workers and reports -- waits a
bounded time, then kills the ssh clients (the sshd side then ends the
session and the agent's parent-death signal fires).  A second signal skips
the wait.  The ssh clients run in their own session, so a terminal's Ctrl-C
reaches only the head.  SIGUSR1 on the head is passed on to every host's
agent (a ``usr1`` line on the session's stdin), which passes it on to its
workers.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import ENV, env_str
from ..deadline import Deadline
from ..errors import ConfigError
from ..protocol.auth import new_secret
from ..protocol.control import PortAnnounce, Report
from .agent import DRAIN_TIMEOUT, LEFTOVER_TIMEOUT
from .control import HeadLink
from .hosts import HeadConfig, agent_argv, remote_command, ssh_argv
from .report import RunResult, format_root_cause, format_summary, result_from_json
from .signals import SignalWaiter
from .workers import KILL_TIMEOUT, LineSink, OutputPump, Worker, WorkerSpec, signal_name

__all__ = ["HeadNode", "run_head"]

#: after the head closed the sessions' stdin, how long the agents get to stop and report (beyond their grace)
REPORT_GRACE = 15.0
#: after one session ended without a report, how long the others get before the head stops them
ORPHAN_GRACE = 30.0


@dataclass
class Session:
    node: int
    host: str
    slots: int
    worker: Worker  # the ssh client, wrapped for the output pump
    port: Optional[int] = None
    report: Optional[Report] = None
    ended: Optional[float] = None

    @property
    def proc(self) -> subprocess.Popen:
        return self.worker.proc

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode


class HeadNode(SignalWaiter):
    """``procgroup run --hostfile``: one agent per host over ssh, their output relayed, Ctrl-C and SIGUSR1
    passed on, the job's report printed from the agents' control messages (:mod:`.control`)."""

    def __init__(
        self, cfg: HeadConfig, sink: Optional[LineSink] = None, environ: Optional[Mapping[str, str]] = None
    ) -> None:
        self.cfg = cfg
        self.sink = sink or LineSink()
        self.environ = dict(os.environ if environ is None else environ)
        self.sessions: list[Session] = []
        self._nonce = secrets.token_hex(8)
        self._link = HeadLink(self._nonce)
        self._init_signals()
        self._lock = threading.Lock()
        self.pump = OutputPump(self.sink, intercept=self._intercept)

    # ------------------------------------------------------------------ helpers

    def _say(self, msg: str) -> None:
        self.sink.text(f"procgroup run [head]: {msg}")

    def _secret(self) -> str:
        s = env_str(ENV.SECRET, self.environ)
        if s is not None:
            return s
        if self.cfg.agent.secret_file is not None:
            from .slurm import read_secret_file  # noqa: PLC0415

            v = read_secret_file(self.cfg.agent.secret_file)
            if v is None:
                raise ConfigError(f"--secret-file {self.cfg.agent.secret_file!r}: no such file")
            return v
        return new_secret()

    def _intercept(self, worker: Worker, line: bytes) -> bool:
        if not self._link.is_control(line):
            return False
        msg = self._link.parse(line)
        if msg is None:
            return True
        s = next((x for x in self.sessions if x.worker is worker), None)
        if s is not None:
            if isinstance(msg, PortAnnounce):
                s.port = msg.port
            elif isinstance(msg, Report):
                s.report = msg
        self._poke()
        return True

    def _relay_usr1(self) -> None:
        """SIGUSR1 on the head: every host's agent passes it on to its workers (a line on the session's stdin)."""
        for s in self.sessions:
            if s.ended is None and s.proc.stdin is not None and not s.proc.stdin.closed:
                try:
                    s.proc.stdin.write(self._link.usr1())
                    s.proc.stdin.flush()
                except OSError:
                    pass

    # ------------------------------------------------------------------ sessions

    def _start(self, node: int, port: int, secret: str, env: dict[str, str], run_id: str) -> Session:
        cfg = self.cfg
        h = cfg.hosts[node]
        argv = agent_argv(
            cfg.agent,
            node_rank=node,
            nnodes=len(cfg.hosts),
            nproc=h.slots,
            master_addr=cfg.master,
            master_port=port,
            run_id=run_id,
        )
        remote = remote_command(cwd=os.getcwd(), env=env, python=sys.executable or "python3", argv=argv)
        cmd = ssh_argv(cfg.ssh_command, h.host, remote, port=cfg.ssh_port, options=cfg.ssh_options)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise ConfigError(
                f"cannot run the ssh client {cfg.ssh_command[0]!r}: {e.strerror or e}; set --ssh-command"
            ) from e
        spec = WorkerSpec(rank=node, local_rank=0, argv=tuple(cmd), env={}, prefix="")
        s = Session(node=node, host=h.host, slots=h.slots, worker=Worker(spec=spec, proc=proc, start_time=time.time()))
        self.sessions.append(s)
        self.pump.add(s.worker)
        hello = self._link.hello(secret)
        try:
            assert proc.stdin is not None
            proc.stdin.write(hello)
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the session died at once: its exit status and ssh's message tell why
        return s

    def _poll(self) -> None:
        for s in self.sessions:
            if s.ended is None and s.proc.poll() is not None:
                s.ended = time.time()

    def _close_stdins(self) -> None:
        for s in self.sessions:
            if s.proc.stdin is not None and not s.proc.stdin.closed:
                try:
                    s.proc.stdin.close()
                except OSError:
                    pass

    def _kill_sessions(self, sig: int) -> None:
        for s in self.sessions:
            if s.proc.poll() is None:
                try:
                    os.killpg(s.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _wait_sessions(self, deadline: Deadline, abort: Optional[int] = None) -> bool:
        while True:
            self._poll()
            if all(s.ended is not None for s in self.sessions):
                return True
            if deadline.expired() or (abort is not None and len(self._signals) > abort):
                return False
            self._wake(min(0.5, max(0.0, deadline.remaining())))

    def _stop_all(self, why: str) -> None:
        """Close every session's stdin (agents stop and report), then kill the ssh clients if they linger."""
        self._say(f"{why}: stopping the agents on every host")
        seen = len(self._signals)
        self._close_stdins()
        grace = self.cfg.agent.term_timeout + KILL_TIMEOUT + DRAIN_TIMEOUT + 2 * LEFTOVER_TIMEOUT + REPORT_GRACE
        if self._wait_sessions(Deadline.after(grace), abort=seen):
            return
        self._kill_sessions(signal.SIGTERM)
        if self._wait_sessions(Deadline.after(2.0)):
            return
        self._kill_sessions(signal.SIGKILL)
        self._wait_sessions(Deadline.after(5.0))

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Run the job on every host; the process exit code (the job's, 128+signal, or 1 when a host failed)."""
        cfg = self.cfg
        a = cfg.agent
        if not a.module and not a.no_python and not os.path.exists(a.entrypoint):
            raise ConfigError(
                f"cannot open the script {os.path.abspath(a.entrypoint)!r}: no such file "
                "(the hosts run it from the same path; use -m for a module)"
            )
        secret = self._secret()
        env = cfg.env.select(self.environ)
        self.sink.text(cfg.env.describe(env, self.environ))
        self._install_signals()
        self.pump.start()
        interrupted: Optional[int] = None
        try:
            port = cfg.master_port
            self._start(0, port, secret, env, a.run_id)
            if port == 0:
                s0 = self.sessions[0]
                deadline = Deadline.after(a.join_timeout)
                while s0.port is None:
                    self._poll()
                    if s0.ended is not None or self._signals or deadline.expired():
                        break
                    self._wake(0.5)
                port = s0.port or 0
            if port:
                desc = ", ".join(
                    f"{h.host} (node {i}, {h.slots} worker{'s' if h.slots != 1 else ''})"
                    for i, h in enumerate(cfg.hosts)
                )
                self._say(f"agents on {desc} over ssh; the agents' store is at {cfg.master}:{port}")
                for node in range(1, len(cfg.hosts)):
                    self._start(node, port, secret, env, a.run_id)
            else:
                s0 = self.sessions[0]
                if not self._signals:
                    why = (
                        "its ssh session ended"
                        if s0.ended is not None
                        else f"it did not report within {a.join_timeout:.0f}s"
                    )
                    self._say(f"the agent on {s0.host} (node 0) did not start its store: {why}")
            orphan_deadline: Optional[Deadline] = None
            usr1 = self._usr1
            while True:
                if self._usr1 != usr1:
                    usr1 = self._usr1
                    self._relay_usr1()
                self._poll()
                if all(s.ended is not None for s in self.sessions):
                    break
                if self._signals:
                    interrupted = self._signals[0]
                    self._stop_all(f"received {signal_name(interrupted)}")
                    break
                if orphan_deadline is None and any(s.ended is not None and s.report is None for s in self.sessions):
                    orphan_deadline = Deadline.after(ORPHAN_GRACE)
                if orphan_deadline is not None and orphan_deadline.expired():
                    self._stop_all("an agent's session ended without a report and the others did not stop")
                    break
                self._wake(1.0)
        finally:
            if any(s.ended is None for s in self.sessions):
                self._kill_sessions(signal.SIGKILL)
                self._wait_sessions(Deadline.after(5.0))
            self.pump.drain(Deadline.after(DRAIN_TIMEOUT))
            self.pump.close()
            for s in self.sessions:
                for pipe in (s.proc.stdin, s.proc.stdout, s.proc.stderr):
                    if pipe is not None:
                        try:
                            pipe.close()
                        except OSError:
                            pass
            self._restore_signals()
        return self._final(interrupted)

    def _final(self, interrupted: Optional[int]) -> int:
        result = self._best_report()
        missing = [s for s in self.sessions if s.report is None]
        lines = [
            f"host {s.host} (node {s.node}): its agent sent no report; ssh exited with "
            + (
                f"status {s.returncode}"
                if s.returncode is not None and s.returncode >= 0
                else f"signal {signal_name(-(s.returncode or 0))}"
            )
            + (" (ssh could not connect or the session broke: see ssh's message above)" if s.returncode == 255 else "")
            for s in missing
        ]
        never = len(self.cfg.hosts) - len(self.sessions)
        if never:
            lines.append(f"{never} host(s) were never started: node 0's agent did not come up")
        if result is not None:
            report = format_root_cause(result)
            if report:
                self.sink.text(report)
            self.sink.text(format_summary(result, max_restarts=self.cfg.agent.max_restarts))
        for ln in lines:
            self._say(ln)
        if interrupted is not None:
            return 128 + interrupted
        if result is not None:
            code = result.exit_code
            return code if code or not lines else 1
        return 1

    def _best_report(self) -> Optional[RunResult]:
        reports = [s.report for s in sorted(self.sessions, key=lambda s: s.node) if s.report is not None]
        best: Optional[RunResult] = None
        for r in reports:
            try:
                res = result_from_json(json.dumps(r.result))
            except (ValueError, TypeError):
                continue
            if best is None or len(res.workers) > len(best.workers):
                best = res
        return best


def run_head(cfg: HeadConfig, sink: Optional[LineSink] = None) -> int:
    """Run a head-node job; the process exit code."""
    return HeadNode(cfg, sink).run()
