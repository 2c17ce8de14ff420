"""Worker processes on one node: spawn, pump their output, signal, reap, verify nothing is left.

* :class:`WorkerSpec` -- the blueprint of one worker (argv, env, labels);
  :class:`Worker` -- the running instance and what became of it.
* :class:`OutputPump` -- one thread multiplexing every worker pipe with a
  selector; it emits complete lines only, each written under one lock, so
  lines of different ranks never interleave within a line.
* :class:`WorkerGroup` -- the gang: start all, poll, signal every process
  group, wait with a deadline, SIGKILL, reap.
* :func:`scan_leftovers` -- the processes still alive that belong to the
  job: every descendant of the agent.  The agent is a child subreaper, so a
  worker's orphaned grandchildren (even ones that called ``setsid``) are
  re-parented to it instead of to init and stay findable.  The agent
  therefore assumes it owns its process (as ``procgroup run`` does): any
  other child it had would be counted as part of the job.

Every worker is started in its own session (so it is the leader of a process
group the agent can signal as a whole, and a terminal's Ctrl-C reaches only
the agent), and the bootstrap arms PR_SET_PDEATHSIG=SIGKILL before running
user code, so no worker outlives the agent.  No ``preexec_fn`` is used: it is
unsafe in a process that has threads (the pump, the store server).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Iterable, Optional

from .. import procfs
from ..deadline import Deadline

__all__ = [
    "WorkerSpec",
    "Worker",
    "LineSink",
    "OutputPump",
    "WorkerGroup",
    "ProcInfo",
    "proc_table",
    "scan_leftovers",
    "kill_pids",
    "reap_adopted_zombies",
    "set_child_subreaper",
    "signal_name",
    "BOOTSTRAP_PATH",
]

BOOTSTRAP_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
_PR_SET_CHILD_SUBREAPER = 36
#: Lines longer than this are emitted in pieces rather than buffered without bound.
MAX_LINE = 1 << 20
STDERR_TAIL = 40
#: How long SIGKILLed workers get to be reaped before they are reported as stuck.
KILL_TIMEOUT = 5.0


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux >= 3.4), so they can be found and reaped."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class WorkerSpec:
    """Blueprint of one worker."""

    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(hash=False, compare=False)
    prefix: str = ""
    error_file: Optional[str] = None
    log_file: Optional[str] = None
    log_append: bool = False  # restarts append to the first generation's file
    to_console: bool = True


@dataclass
class Worker:
    """A running (or finished) worker and what became of it."""

    spec: WorkerSpec
    proc: subprocess.Popen
    start_time: float  # time.time()
    end_time: Optional[float] = None
    returncode: Optional[int] = None
    #: the signal the agent sent before this worker exited (None: it exited on its own)
    signaled_by_agent: Optional[int] = None
    signaled_at: Optional[float] = None  # time.time() of that signal
    stderr_tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def alive(self) -> bool:
        return self.returncode is None

    @property
    def failed(self) -> bool:
        return self.returncode is not None and self.returncode != 0

    @property
    def terminated_by_agent(self) -> bool:
        """Stopped by the agent's teardown, rather than finishing or failing on its own."""
        return self.signaled_by_agent is not None


class LineSink:
    """Console writer: whole lines, one lock, bytes passed through undecoded."""

    def __init__(self, out: Optional[IO] = None, err: Optional[IO] = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.lock = threading.Lock()

    @staticmethod
    def _write(stream: IO, data: bytes) -> None:
        buf = getattr(stream, "buffer", None)
        try:
            if buf is not None:
                stream.flush()
                buf.write(data)
                buf.flush()
            else:
                stream.write(data.decode("utf-8", "replace"))
                stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # console gone (| head) or closed: worker output is still in the log files, if any

    def line(self, data: bytes, *, err: bool = False) -> None:
        with self.lock:
            self._write(self.err if err else self.out, data)

    def text(self, s: str, *, err: bool = True) -> None:
        """Agent messages (reports, warnings); stderr by default so stdout stays the workers'."""
        if s and not s.endswith("\n"):
            s += "\n"
        self.line(s.encode("utf-8", "replace"), err=err)


class _Stream:
    __slots__ = ("worker", "is_err", "buf", "prefix", "log")

    def __init__(self, worker: Worker, is_err: bool, log: Optional[IO[bytes]]) -> None:
        self.worker = worker
        self.is_err = is_err
        self.buf = bytearray()
        self.prefix = worker.spec.prefix.encode("utf-8", "replace")
        self.log = log


class OutputPump:
    """One thread reading every worker's stdout and stderr pipes.

    Each complete line goes to the console with the worker's prefix (stderr
    lines to the agent's stderr), to the worker's log file, and -- for stderr
    -- into the worker's tail kept for the root-cause report.  A partial last
    line is flushed with a newline at EOF.
    """

    def __init__(self, sink: LineSink, intercept: Optional[Callable[["Worker", bytes], bool]] = None) -> None:
        self.sink = sink
        #: called with each complete stdout line; True = consumed (not logged or shown): the head node's control lines
        self.intercept = intercept
        self.sel = selectors.DefaultSelector()
        self._logs: list[IO[bytes]] = []
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._open = 0
        self._wake_r, self._wake_w = os.pipe()
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False

    def add(self, worker: Worker) -> None:
        log: Optional[IO[bytes]] = None
        if worker.spec.log_file:
            os.makedirs(os.path.dirname(worker.spec.log_file), exist_ok=True)
            # closed in _close
            log = open(worker.spec.log_file, "ab" if worker.spec.log_append else "wb")  # noqa: SIM115
            self._logs.append(log)
        with self._lock:
            for pipe, is_err in ((worker.proc.stdout, False), (worker.proc.stderr, True)):
                if pipe is None:
                    continue
                self.sel.register(pipe.fileno(), selectors.EVENT_READ, _Stream(worker, is_err, log))
                self._open += 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="procgroup-output-pump", daemon=True)
        self._thread.start()

    def _emit(self, st: _Stream, lines: list[bytes]) -> None:
        """Route complete lines (each ending in a newline): tail, log file, console in one write."""
        if self.intercept is not None and not st.is_err:
            lines = [ln for ln in lines if not self.intercept(st.worker, ln)]
        if not lines:
            return
        if st.is_err:
            st.worker.stderr_tail.extend(ln.decode("utf-8", "replace").rstrip("\n") for ln in lines)
        if st.log is not None:
            try:
                st.log.write(b"".join(lines))
                st.log.flush()
            except OSError:
                pass
        if st.worker.spec.to_console:
            self.sink.line(b"".join(st.prefix + ln for ln in lines), err=st.is_err)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._open == 0 and self._stopping:
                    break
            for key, _ in self.sel.select(timeout=1.0):
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    continue
                st: _Stream = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:  # EOF: flush a last line that had no newline
                    if st.buf:
                        self._emit(st, [bytes(st.buf) + b"\n"])
                        st.buf.clear()
                    with self._lock:
                        self.sel.unregister(key.fd)
                        self._open -= 1
                    continue
                st.buf += chunk
                cut = st.buf.rfind(b"\n") + 1
                lines = [ln + b"\n" for ln in bytes(st.buf[: cut - 1]).split(b"\n")] if cut else []
                del st.buf[:cut]
                if len(st.buf) > MAX_LINE:  # a huge line without newline: emit it in pieces
                    lines.append(bytes(st.buf) + b"\n")
                    st.buf.clear()
                self._emit(st, lines)

    def drain(self, deadline: Deadline) -> bool:
        """Wait for EOF on every pipe (all writers gone), up to ``deadline``; True if everything was read."""
        with self._lock:
            self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(deadline.remaining_or_none())
            return not self._thread.is_alive()
        return True

    @property
    def finished(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def close(self) -> None:
        """Stop reading (after :meth:`drain`); files are closed even if a pipe never reached EOF."""
        for log in self._logs:
            try:
                log.close()
            except OSError:
                pass
        if self._thread is None or not self._thread.is_alive():
            self.sel.close()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass


# --------------------------------------------------------------------------- the gang


class WorkerGroup:
    """The workers of one attempt on this node."""

    def __init__(self, specs: Iterable[WorkerSpec], sink: LineSink) -> None:
        self.specs = list(specs)
        self.sink = sink
        self.workers: list[Worker] = []
        self.pump = OutputPump(sink)

    # -- start
    def start(self, stop: Optional[Callable[[], bool]] = None) -> bool:
        """Spawn every worker (from the calling thread: PR_SET_PDEATHSIG fires when *that thread* exits).

        ``stop()`` is asked before each spawn (the agent's "a signal arrived"): when it says so, the
        loop ends there and returns False, leaving the caller to stop the workers already started;
        True when every worker was started.  If one cannot be spawned, OSError propagates and the
        caller stops the ones already started.
        """
        self.pump.start()
        for spec in self.specs:
            if stop is not None and stop():
                return False
            proc = subprocess.Popen(
                list(spec.argv),
                env=spec.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
            w = Worker(spec=spec, proc=proc, start_time=time.time())
            self.workers.append(w)
            self.pump.add(w)
        return True

    def close(self) -> None:
        """Release the pump and the pipes (after :meth:`OutputPump.drain`)."""
        self.pump.close()
        if self.pump.finished:
            for w in self.workers:
                for pipe in (w.proc.stdout, w.proc.stderr):
                    if pipe is not None:
                        pipe.close()

    # -- observe
    def poll(self) -> list[Worker]:
        """Reap whoever exited; returns the workers that finished since the last poll."""
        done = []
        for w in self.workers:
            if w.returncode is None:
                rc = w.proc.poll()
                if rc is not None:
                    w.returncode = rc
                    w.end_time = time.time()
                    done.append(w)
        return done

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.returncode is None]

    # -- stop
    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the process group of every worker not yet reaped, marking it as stopped by the agent.

        Only unreaped leaders are signalled through their group: until it is
        reaped, a leader's pid (= its pgid) cannot be reused, so the signal
        cannot reach a stranger.  Members of a group whose leader is gone are
        found by :func:`scan_leftovers` and killed by pid.
        """
        self.poll()  # whoever already exited did so on its own: do not count it as stopped by us
        for w in self.workers:
            if w.returncode is not None:
                continue
            if w.signaled_by_agent is None:
                w.signaled_by_agent = sig
                w.signaled_at = time.time()
            _killpg(w.pid, sig)

    def forward(self, sig: int) -> None:
        """Pass ``sig`` (SIGUSR1: dump stacks) to every live worker's process group; not a stop."""
        self.poll()
        for w in self.workers:
            if w.returncode is None:
                _killpg(w.pid, sig)

    def wait(
        self,
        deadline: Deadline,
        wake: Optional[Callable[[float], None]] = None,
        abort: Optional[Callable[[], bool]] = None,
    ) -> bool:
        """Reap workers until all have exited, ``deadline`` passes or ``abort()``; True when none is left alive.

        ``wake(timeout)`` blocks until something may have changed (a SIGCHLD)
        or ``timeout`` seconds pass; without it we re-check every 50 ms.
        """
        while True:
            self.poll()
            if not self.alive():
                return True
            rem = deadline.remaining()
            if rem <= 0 or (abort is not None and abort()):
                return False
            if wake is not None:
                wake(min(rem, 0.5))
            else:
                time.sleep(min(rem, 0.05))

    def stop(
        self,
        first_signal: int,
        grace: float,
        wake: Optional[Callable[[float], None]] = None,
        abort: Optional[Callable[[], bool]] = None,
    ) -> list[Worker]:
        """``first_signal`` (SIGTERM) to every group, wait up to ``grace`` s, SIGKILL the rest, reap.

        ``abort()`` returning True cuts the grace period short.  Returns the
        workers still not reaped :data:`KILL_TIMEOUT` s after SIGKILL (a
        process in uninterruptible sleep); the caller reports them.
        """
        if self.alive():
            self.signal_all(first_signal)
            self.wait(Deadline.after(grace), wake, abort)
        if self.alive():
            self.signal_all(signal.SIGKILL)
            self.wait(Deadline.after(KILL_TIMEOUT), wake)
        return self.alive()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - a group we own is always ours to signal
        pass


# --------------------------------------------------------------------------- leftovers (/proc via procfs)


@dataclass(frozen=True)
class ProcInfo:
    """A process left behind by the workers (found by :func:`scan_leftovers`)."""

    pid: int
    ppid: int
    pgid: int
    state: str
    cmdline: str

    def describe(self) -> str:
        """One line for the report: pid, process group, state and command line."""
        return f"pid {self.pid} (pgid {self.pgid}, state {self.state}): {self.cmdline}"


#: pid -> (state, ppid, pgid) of every process (:data:`procgroup.procfs.ProcTable`)
ProcTable = procfs.ProcTable


def proc_table() -> ProcTable:
    """One pass over /proc through :func:`procgroup.procfs.proc_table` (empty where there is none).
    Pass it to :func:`reap_adopted_zombies` and :func:`scan_leftovers` to answer both from the same
    read: the teardown of a job that left nothing behind then costs a single scan of the host's processes."""
    return procfs.proc_table()


def scan_leftovers(agent_pid: int, exclude: Iterable[int] = (), table: Optional[ProcTable] = None) -> list[ProcInfo]:
    """Live processes (not zombies) whose ancestry leads to ``agent_pid`` (in ``table``, else /proc now).

    The agent is a child subreaper, so a worker's orphaned descendants --
    including ones that left the worker's process group or session -- are
    re-parented to it and stay in this set.  Matching by process group alone
    is deliberately not done: once a group empties, its id can be reused by
    an unrelated process on a long run.
    """
    skip = set(exclude) | {agent_pid}
    procs = proc_table() if table is None else table

    def descends(pid: int) -> bool:
        for _ in range(4096):  # bounded even if /proc changed under us into a cycle
            st = procs.get(pid)
            if st is None or st[1] <= 1:
                return False
            pid = st[1]
            if pid == agent_pid:
                return True
        return False

    return [
        ProcInfo(pid, ppid, pgid, state, procfs.cmdline(pid))
        for pid, (state, ppid, pgid) in sorted(procs.items())
        if pid not in skip and state not in ("Z", "X") and descends(pid)
    ]


def kill_pids(procs: Iterable[ProcInfo], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each process; ones already gone (or not ours) are skipped."""
    for p in procs:
        try:
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_adopted_zombies(agent_pid: int, known: Iterable[int], table: Optional[ProcTable] = None) -> None:
    """waitpid() the zombies re-parented to us (as subreaper) that are not our Popen children
    (those in ``table``, else in /proc now)."""
    skip = set(known)
    for pid, st in (proc_table() if table is None else table).items():
        if pid in skip:
            continue
        if st[1] == agent_pid and st[0] == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            except OSError as e:  # pragma: no cover
                if e.errno != errno.ECHILD:
                    raise
