"""What happened to the workers: results, the root cause, the summary table.

Pure formatting over plain data, so every message is unit-testable.  The
root cause is the *first* failure by time -- the time in the worker's error
file when it wrote one (the moment the exception was caught), else the time
the agent saw the process exit -- among the workers that failed on their own,
not those the launcher stopped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Sequence

from ..errors import format_ranks
from .workers import signal_name

__all__ = [
    "Outcome",
    "WorkerResult",
    "RunResult",
    "load_error_file",
    "exit_code_for",
    "format_root_cause",
    "format_summary",
    "combine_results",
    "slim",
    "result_to_json",
    "result_from_json",
    "worker_to_dict",
    "worker_from_dict",
]

TAIL_LINES = 20
#: Above this many workers a successful run's table collapses to one line.
COMPACT_ABOVE = 16


class Outcome(str, Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # exited non-zero or by a signal, on its own
    TERMINATED = "terminated"  # stopped by the launcher's teardown
    STUCK = "stuck"  # still not reaped after SIGKILL (uninterruptible sleep)


@dataclass(frozen=True)
class WorkerResult:
    rank: int
    local_rank: int
    host: str
    pid: int
    returncode: Optional[int]  # None: could not be reaped; < 0: killed by signal -returncode
    start_time: float
    end_time: Optional[float]
    signaled_by_agent: Optional[int] = None
    signaled_at: Optional[float] = None
    error: Optional[dict] = None  # the worker's error file, normalized by load_error_file
    stderr_tail: tuple[str, ...] = ()

    @property
    def outcome(self) -> Outcome:
        if self.returncode is None:
            return Outcome.STUCK
        if self.signaled_by_agent is not None and not self._failed_before_signal():
            return Outcome.TERMINATED
        return Outcome.SUCCEEDED if self.returncode == 0 else Outcome.FAILED

    def _failed_before_signal(self) -> bool:
        """It raised (error file written) before the launcher's signal reached it: its own failure."""
        ts = self.error.get("timestamp") if self.error else None
        return (
            self.returncode != 0
            and isinstance(ts, (int, float))
            and self.signaled_at is not None
            and ts < self.signaled_at
        )

    def is_echo(self) -> bool:
        """It failed only because a peer died (its error is a PeerFailureError)."""
        t = str((self.error or {}).get("exc_type", ""))
        return t.endswith("PeerFailureError")

    @property
    def failure_time(self) -> float:
        """When it failed: the error file's timestamp if any, else when the agent saw it exit."""
        if self.error and isinstance(self.error.get("timestamp"), (int, float)):
            return float(self.error["timestamp"])
        return self.end_time if self.end_time is not None else float("inf")

    @property
    def duration(self) -> Optional[float]:
        return None if self.end_time is None else max(0.0, self.end_time - self.start_time)

    def status(self) -> str:
        """``exit code 1`` / ``signal SIGKILL`` / ``exit code 0``."""
        rc = self.returncode
        if rc is None:
            return "not reaped"
        if rc < 0:
            return f"signal {signal_name(-rc)}"
        return f"exit code {rc}"

    def own_failure_status(self) -> str:
        """status() for a worker that failed on its own, noting a launcher signal that hit it while exiting.

        The worker's own error record wins over that signal: ``raised ValueError, then stopped while
        exiting by the launcher's SIGTERM``, never a bare ``signal SIGTERM``.
        """
        if self.signaled_by_agent is not None and self.returncode == -self.signaled_by_agent:
            exc = str((self.error or {}).get("exc_type") or "")
            what = f"raised {exc}" if exc else "raised"
            return f"{what}, then stopped while exiting by the launcher's {signal_name(self.signaled_by_agent)}"
        return self.status()

    def who(self) -> str:
        return f"rank {self.rank} (local {self.local_rank}) on host {self.host}, pid {self.pid}"


@dataclass(frozen=True)
class RunResult:
    """One attempt of the gang on this node."""

    workers: tuple[WorkerResult, ...]
    run_id: str = "none"
    host: str = ""
    restart_count: int = 0
    #: the signal the agent received (SIGINT/SIGTERM/SIGHUP) that stopped the job
    interrupted_by: Optional[int] = None
    #: processes found alive after teardown and killed; still_alive: not even SIGKILL helped
    leftovers_killed: tuple[str, ...] = ()
    still_alive: tuple[str, ...] = ()
    spawn_error: Optional[str] = None
    start_time: float = field(default_factory=time.time)
    end_time: float = field(default_factory=time.time)
    #: failures of the launcher itself, not of a worker: "lost the connection to the store at h1:29500",
    #: "node 2 (h3) stopped sending heartbeats" ... (multi-node); each makes the run failed
    agent_errors: tuple[str, ...] = ()
    #: number of nodes whose results this holds (1 for one agent's own view)
    nnodes: int = 1

    @property
    def failures(self) -> list[WorkerResult]:
        """Failed workers, the root cause first: by time, except that a worker which only reported losing a
        peer (PeerFailureError) comes after the failures that are not such echoes -- a rank SIGKILLed leaves no
        error file, so its survivors' reports can carry an earlier timestamp than the agent's view of its exit."""
        failed = [w for w in self.workers if w.outcome is Outcome.FAILED]
        return sorted(failed, key=lambda w: (w.is_echo(), w.failure_time))

    @property
    def root_cause(self) -> Optional[WorkerResult]:
        f = self.failures
        return f[0] if f else None

    def is_failed(self) -> bool:
        return (
            self.root_cause is not None
            or self.interrupted_by is not None
            or self.spawn_error is not None
            or bool(self.agent_errors)
            or any(w.outcome is Outcome.STUCK for w in self.workers)
        )

    @property
    def exit_code(self) -> int:
        """The first failure's exit code (128+signal for a signal); 128+signal when interrupted; else 0."""
        rc = self.root_cause
        if rc is not None:
            if rc.own_failure_status() != rc.status():
                return 1  # it raised (the bootstrap exits 1); the launcher's signal only cut its exit short
            return exit_code_for(rc.returncode)
        if self.interrupted_by is not None:
            return 128 + self.interrupted_by
        if self.spawn_error is not None or self.is_failed():
            return 1
        return 0


def exit_code_for(returncode: Optional[int]) -> int:
    if returncode is None:
        return 1
    if returncode < 0:
        return 128 + (-returncode)
    return min(returncode, 255) or 0


def load_error_file(path: Optional[str], not_before: float = 0.0) -> Optional[dict]:
    """The worker's error record, or None if absent, unreadable or older than ``not_before``.

    Understands procgroup's format and torch.distributed.elastic's
    (``{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}``,
    written by ``@record``).
    """
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if "traceback" not in data and isinstance(data.get("message"), dict):  # torch elastic's @record format
        msg = data["message"]
        extra = msg.get("extraInfo") or {}
        try:
            ts = float(extra["timestamp"])
        except (KeyError, TypeError, ValueError):
            ts = None
        data = {
            "message": str(msg.get("message", "")),
            "traceback": str(extra.get("py_callstack", "")),
            "timestamp": ts,
        }
    ts = data.get("timestamp")
    if isinstance(ts, (int, float)) and ts < not_before - 1.0:
        return None  # left over from an earlier run
    return data


def _ts(t: Optional[float]) -> str:
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _dur(d: Optional[float]) -> str:
    if d is None:
        return "-"
    return f"{d:.1f}s" if d < 600 else f"{d / 60:.1f}min"


def _result_cell(w: WorkerResult, root: Optional[WorkerResult]) -> str:
    o = w.outcome
    if o is Outcome.SUCCEEDED:
        return "ok"
    if o is Outcome.STUCK:
        return "NOT REAPED after SIGKILL"
    if o is Outcome.TERMINATED:
        sent = signal_name(w.signaled_by_agent or 0)
        how = sent if w.returncode == -(w.signaled_by_agent or 0) else f"sent {sent}, ended with {w.status()}"
        return f"terminated by launcher ({how})"
    mark = "  <- root cause" if w is root else ""
    st = w.own_failure_status()
    if st != w.status():
        st = f"(raised; {signal_name(w.signaled_by_agent or 0)} from launcher)"
    return f"FAILED {st}{mark}"


def format_root_cause(run: RunResult) -> str:
    """The ``### Root cause`` block and the list of other ranks; "" when nothing failed."""
    root = run.root_cause
    lines: list[str] = []
    if root is None:
        if run.interrupted_by is not None:
            n = sum(1 for w in run.workers if w.outcome is Outcome.TERMINATED)
            if run.nnodes > 1 and run.agent_errors:
                lines.append(f"### Stopped: {run.agent_errors[0]}; the agents stopped {n} worker(s)")
            else:
                lines.append(
                    f"### The launcher received {signal_name(run.interrupted_by)}: "
                    f"forwarded it to the workers and stopped {n} of them"
                )
        elif run.spawn_error:
            lines.append(f"### Root cause: could not start the workers: {run.spawn_error}")
        elif run.agent_errors:
            lines.append(f"### Root cause: {run.agent_errors[0]}")
        first_shown = (run.interrupted_by is None and not run.spawn_error) or (
            run.interrupted_by is not None and run.nnodes > 1
        )
        rest = run.agent_errors[1:] if first_shown else run.agent_errors
        lines.extend(f"    also: {e}" for e in rest)
        stuck = [w for w in run.workers if w.outcome is Outcome.STUCK]
        if stuck:
            lines.append(
                "### Workers that did not exit even after SIGKILL: "
                + ", ".join(f"rank {w.rank} pid {w.pid}" for w in stuck)
            )
        return "\n".join(lines)

    lines.append(f"### Root cause: {root.who()}, {root.own_failure_status()}")
    t0 = root.start_time
    lines.append(f"    failed at {_ts(root.failure_time)} ({root.failure_time - t0:.2f}s after it started)")
    err = root.error
    if err and err.get("traceback"):
        if err.get("exc_type"):
            lines.append(f"    error: {err['exc_type']}: {err.get('message', '')}".rstrip())
        lines.append(str(err["traceback"]).rstrip("\n"))
    elif root.stderr_tail:
        tail = root.stderr_tail[-TAIL_LINES:]
        why = "no error file (the process died without a Python exception)"
        if root.returncode is not None and root.returncode < 0:
            why = f"no error file: killed by {signal_name(-root.returncode)}, so no Python traceback could be written"
        lines.append(f"    {why}; last {len(tail)} line(s) of its stderr:")
        lines.extend("    | " + ln for ln in tail)
    else:
        if root.returncode is not None and root.returncode < 0:
            lines.append(
                f"    killed by {signal_name(-root.returncode)} with no output on stderr "
                "(SIGKILL often means the out-of-memory killer: check `dmesg` / `journalctl -k`)"
                if -root.returncode == 9
                else f"    killed by {signal_name(-root.returncode)} with no output on stderr"
            )
        else:
            lines.append(
                "    no error file and no output on stderr (the program called sys.exit / os._exit with this code?)"
            )

    others = [w for w in run.workers if w is not root and w.outcome is not Outcome.SUCCEEDED]
    stopped = [w for w in others if w.outcome is Outcome.TERMINATED and w.end_time is not None]
    if others:
        head = "### Other ranks:"
        if stopped:
            lag = max(w.end_time or 0.0 for w in stopped) - root.failure_time
            where = f" on {len({w.host for w in stopped})} host(s)" if run.nnodes > 1 else ""
            head = (
                f"### Other ranks: the launcher stopped {len(stopped)} worker(s){where} "
                f"{max(0.0, lag):.2f}s after the root cause"
            )
        lines.append(head)
        for w in sorted(others, key=lambda w: w.rank):
            if w.outcome is Outcome.TERMINATED:
                sent = signal_name(w.signaled_by_agent or 0)
                what = f"terminated by the launcher ({sent}" + (
                    ")" if w.returncode == -(w.signaled_by_agent or 0) else f"; ended with {w.status()})"
                )
            elif w.outcome is Outcome.STUCK:
                what = "did NOT exit after SIGKILL (uninterruptible sleep?)"
            else:
                when = w.failure_time - root.failure_time
                what = f"failed on its own {when:.2f}s after the root cause: {w.own_failure_status()}"
                if w.error and w.error.get("exc_type"):
                    what += f" ({w.error['exc_type']}: {_first_line(w.error.get('message', ''))})"
            where = f" on {w.host}" if run.nnodes > 1 else ""
            lines.append(f"    rank {w.rank} (local {w.local_rank}){where} pid {w.pid}: {what}")
    if run.agent_errors:
        lines.append("### Launcher errors:")
        lines.extend(f"    {e}" for e in run.agent_errors)
    return "\n".join(lines)


def _first_line(s: object, limit: int = 160) -> str:
    t = str(s).strip().splitlines()
    line = t[0] if t else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def format_summary(run: RunResult, *, max_restarts: int = 0) -> str:
    """The table printed after every run; a successful big job collapses to one line."""
    ws = sorted(run.workers, key=lambda w: w.rank)
    state = "FAILED" if run.is_failed() else "succeeded"
    if run.interrupted_by is not None and run.root_cause is None:
        state = f"interrupted by {signal_name(run.interrupted_by)}"
    elapsed = run.end_time - run.start_time
    head = (
        f"procgroup run: {len(ws)} worker(s) on {run.host} {state} in {elapsed:.1f}s "
        f"(exit code {run.exit_code}, run id {run.run_id}"
    )
    if run.restart_count or max_restarts:
        head += f", restart {run.restart_count} of max {max_restarts}"
    head += ")"
    lines = [head]
    root = run.root_cause
    shown = ws
    if len(ws) > COMPACT_ABOVE:
        ok = [w for w in ws if w.outcome is Outcome.SUCCEEDED]
        shown = [w for w in ws if w.outcome is not Outcome.SUCCEEDED]
        if ok:
            durs = [w.duration for w in ok if w.duration is not None]
            span = f"{_dur(min(durs))}-{_dur(max(durs))}" if durs else "-"
            lines.append(f"  ranks {format_ranks(w.rank for w in ok)}: ok, {span}")
    if shown:
        hw = max(4, max(len(w.host) for w in shown))
        lines.append(f"  {'rank':>4}  {'host':<{hw}}  {'pid':>7}  {'duration':>8}  result")
        for w in shown:
            lines.append(f"  {w.rank:>4}  {w.host:<{hw}}  {w.pid:>7}  {_dur(w.duration):>8}  {_result_cell(w, root)}")
    if run.leftovers_killed:
        lines.append(f"  killed {len(run.leftovers_killed)} leftover process(es) of the job:")
        lines.extend("    " + p for p in run.leftovers_killed)
    if run.still_alive:
        lines.append(f"  WARNING: {len(run.still_alive)} process(es) of the job survived SIGKILL:")
        lines.extend("    " + p for p in run.still_alive)
    return "\n".join(lines)


def results_table_rows(results: Sequence[WorkerResult]) -> list[tuple[int, str, int, str, Optional[float]]]:
    """(rank, host, pid, status, duration) rows, for programmatic use and tests."""
    return [(w.rank, w.host, w.pid, w.status(), w.duration) for w in sorted(results, key=lambda w: w.rank)]


# --------------------------------------------------------------------------- several nodes


def worker_to_dict(w: WorkerResult) -> dict:
    d = dataclasses.asdict(w)
    d["stderr_tail"] = list(w.stderr_tail)
    return d


def worker_from_dict(d: dict) -> WorkerResult:
    names = {f.name for f in dataclasses.fields(WorkerResult)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["stderr_tail"] = tuple(kw.get("stderr_tail") or ())
    return WorkerResult(**kw)


def slim(run: RunResult) -> RunResult:
    """``run`` without the stderr tails no report shows (those of workers that did not fail): what travels
    between nodes stays small however many ranks a node runs."""
    keep = (Outcome.FAILED, Outcome.STUCK)
    return dataclasses.replace(
        run,
        workers=tuple(
            w if w.outcome in keep or not w.stderr_tail else dataclasses.replace(w, stderr_tail=()) for w in run.workers
        ),
    )


def result_to_json(run: RunResult) -> str:
    """One agent's :class:`RunResult` as JSON (sent through the store and to the head node)."""
    d = dataclasses.asdict(run)
    d["workers"] = [worker_to_dict(w) for w in run.workers]
    for k in ("leftovers_killed", "still_alive", "agent_errors"):
        d[k] = list(d[k])
    return json.dumps(d, separators=(",", ":"))


def result_from_json(data: "str | bytes") -> RunResult:
    """Inverse of :func:`result_to_json`; ValueError for anything that is not one."""
    d = json.loads(data)
    if not isinstance(d, dict) or not isinstance(d.get("workers"), list):
        raise ValueError("not a procgroup run result")
    names = {f.name for f in dataclasses.fields(RunResult)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["workers"] = tuple(worker_from_dict(w) for w in d["workers"])
    for k in ("leftovers_killed", "still_alive", "agent_errors"):
        kw[k] = tuple(kw.get(k) or ())
    return RunResult(**kw)


def combine_results(
    parts: Sequence[RunResult],
    *,
    hosts: Sequence[str],
    run_id: str,
    restart_count: int,
    extra_errors: Sequence[str] = (),
) -> RunResult:
    """The whole job's result from every node's own (``parts``; missing nodes are in ``extra_errors``).

    The root cause is then the first failure over all nodes, by the time in the
    worker's error file or the time its agent saw it exit (hosts' clocks are
    assumed to agree to well under a second, as NTP keeps them).
    """
    workers = tuple(sorted((w for p in parts for w in p.workers), key=lambda w: w.rank))
    interrupted = next((p for p in parts if p.interrupted_by is not None), None)
    errors: list[str] = []
    if interrupted is not None and len(parts) > 1:
        errors.append(
            interrupted.agent_errors[0]
            if interrupted.agent_errors
            else f"the agent on {interrupted.host} received {signal_name(interrupted.interrupted_by or 0)}"
        )
    for p in parts:
        errors.extend(e for e in p.agent_errors if e not in errors)
    errors.extend(e for e in extra_errors if e not in errors)
    spawn = next((f"on {p.host}: {p.spawn_error}" for p in parts if p.spawn_error), None)
    label = hosts[0] if len(hosts) == 1 else f"{len(hosts)} nodes ({', '.join(hosts)})"
    return RunResult(
        workers=workers,
        run_id=run_id,
        host=label,
        restart_count=restart_count,
        interrupted_by=interrupted.interrupted_by if interrupted is not None else None,
        leftovers_killed=tuple(f"{p.host}: {x}" for p in parts for x in p.leftovers_killed),
        still_alive=tuple(f"{p.host}: {x}" for p in parts for x in p.still_alive),
        spawn_error=spawn,
        start_time=min((p.start_time for p in parts), default=time.time()),
        end_time=max((p.end_time for p in parts), default=time.time()),
        agent_errors=tuple(errors),
        nnodes=len(hosts),
    )
