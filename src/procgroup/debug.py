"""Debugging aids: monitored_barrier, breakpoint on one rank, SIGUSR1 state dumps.

* :func:`monitored_barrier` -- a barrier whose error names the ranks that did
  not arrive (rank 0 of the group collects, then tells every arrived rank).
* :func:`breakpoint` -- pdb on one rank while the others wait.  Under
  ``procgroup run`` workers have no terminal of their own, so the debugger
  talks to the launcher's terminal, whose path the launcher passes in
  ``PROCGROUP_TTY``; elsewhere it uses ``/dev/tty`` or stdin.
* ``SIGUSR1`` -- each initialized process prints every thread's Python stack
  and the recent collectives of each of its groups (the flight recorder) to
  stderr.  ``procgroup run`` forwards SIGUSR1 to all its workers.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, List, Optional, TextIO

import numpy as np

from . import algorithms as alg
from .config import to_seconds
from .deadline import Deadline
from .errors import ConfigError, DistTimeoutError, format_ranks
from .flight import as_record
from .state import _state, resolve_group

__all__ = ["monitored_barrier", "breakpoint", "dump_state", "install_signal_handler"]

#: how long the other ranks wait for a human at a breakpoint
BREAKPOINT_WAIT = 24 * 3600.0


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 of the group receives a token from every other rank; if some are missing at the
    deadline it raises :class:`DistTimeoutError` naming the first missing rank (every missing
    rank with ``wait_all_ranks=True``), and tells the ranks that did arrive, which raise the same.
    Each message starts with torch's (gloo's) wording, so code that matches it keeps working:
    rank 0 ``Rank N failed to pass monitoredBarrier in T ms`` (``Ranks A, B failed ...`` with
    ``wait_all_ranks``; ``Rank 0 timed out in monitoredBarrier after T ms`` when its own time ran
    out before a rank it had not heard from yet), the others ``Rank R successfully reached
    monitoredBarrier, but received errors while waiting for send/recv from rank 0``.
    Nothing is modified in place; a rank not in ``group`` returns at once.
    """
    g = resolve_group(group, "monitored_barrier")
    if not g.is_member():
        return
    t = 0.0 if _is_zero(timeout) else to_seconds(timeout)  # zero: rank 0 checks once who is there (torch's too)
    tmo = g.timeout if t is None else t

    def run(c: Any) -> None:
        n = c.size
        if n == 1:
            return
        token = np.zeros(1, np.int64)
        report = np.full(n + 1, -1, np.int64)  # [count, missing ranks...]
        if c.rank == 0:
            t0 = time.monotonic()
            dl = Deadline.after(tmo)
            tokens = [np.zeros(1, np.int64) for _ in range(n)]
            reqs = {p: c.irecv(p, tokens[p], step=0) for p in range(1, n)}
            missing: List[int] = []
            self_timed_out = False
            for p, req in reqs.items():
                if not wait_all_ranks and dl.remaining() <= 0 and not req.test():
                    self_timed_out = True  # torch's wording: rank 0's own time ran out before this rank's turn
                    missing.append(g.ranks[p])
                    break
                try:
                    req.wait(dl)
                except DistTimeoutError:
                    missing.append(g.ranks[p])
                    if not wait_all_ranks:
                        break
            report[0] = len(missing)
            report[1 : 1 + len(missing)] = missing
            arrived = [p for p, req in reqs.items() if req.test()]
            for p in arrived:
                c.send(p, report, step=1)
            if missing:
                ms = (time.monotonic() - t0) * 1e3 if self_timed_out else tmo * 1e3
                if self_timed_out:
                    head = f"Rank {g.ranks[0]} timed out in monitoredBarrier after {ms:.0f} ms"
                else:
                    who = f"Rank {missing[0]}" if len(missing) == 1 else "Ranks " + ", ".join(map(str, missing))
                    head = f"{who} failed to pass monitoredBarrier in {ms:.0f} ms"
                arrived_ranks = [g.ranks[0]] + [g.ranks[p] for p in arrived]
                raise DistTimeoutError(
                    f"{head}: " + _missing_msg(g, missing, arrived_ranks, tmo=tmo, all_=wait_all_ranks)
                )
        else:
            head = (
                f"Rank {g.ranks[c.rank]} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank {g.ranks[0]}"
            )
            c.send(0, token, step=0)
            try:
                c.irecv(0, report, step=1).wait(Deadline.after(tmo + 10.0))
            except DistTimeoutError as e:
                raise DistTimeoutError(f"{head}: rank {g.ranks[0]} sent no verdict ({e})") from e
            k = int(report[0])
            if k > 0:
                missing_r = [int(x) for x in report[1 : 1 + k]]
                raise DistTimeoutError(f"{head}: " + _missing_msg(g, missing_r, None, tmo, wait_all_ranks))

    g.run("monitored_barrier", run, timeout=tmo + 15.0, signature=("monitored_barrier",))


def _is_zero(timeout: Any) -> bool:
    try:
        return timeout is not None and float(getattr(timeout, "total_seconds", lambda: timeout)()) == 0.0
    except (TypeError, ValueError):
        return False


def _missing_msg(g: Any, missing: List[int], arrived_ranks: Optional[List[int]], tmo: float, all_: bool) -> str:
    s = (
        f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)} did not reach monitored_barrier "
        f"in group {g.name} within {tmo:.1f}s"
    )
    if arrived_ranks is not None:
        s += f" (ranks {format_ranks(arrived_ranks)} did)"
    if not all_:
        s += "; pass wait_all_ranks=True to list every missing rank"
    return s + ". Send SIGUSR1 to the job (procgroup run forwards it) to see where each rank is"


def _debugger_io() -> tuple:
    """The debugger's input and output: PROCGROUP_TTY (parsed at init), else /dev/tty, else stdin/stdout."""
    path = _state.config.tty if _state.config is not None else None
    for p in ([path] if path else []) + ["/dev/tty"]:
        try:  # a terminal is not seekable, so one "r+" file object cannot serve both ways
            return open(p, "r"), open(p, "w", buffering=1)
        except OSError:
            continue
    return sys.stdin, sys.stdout


def breakpoint(rank: int = 0, skip: int = 0) -> None:  # noqa: A001 - torch's name
    """Open pdb on ``rank`` (global rank) while every other rank waits; continue with ``c``."""
    g = resolve_group(None, "breakpoint")
    if not 0 <= rank < g.size():
        raise ConfigError(f"breakpoint(rank={rank}): rank is outside [0, {g.size()})")
    if g.rank() != rank:
        sys.stderr.write(f"procgroup: rank {g.rank()} waiting for the debugger on rank {rank}\n")
        g.run("breakpoint", alg.barrier, timeout=BREAKPOINT_WAIT, signature=("breakpoint",))
        return
    import pdb

    resumed = threading.Event()

    class _Pdb(pdb.Pdb):
        def set_continue(self) -> None:
            resumed.set()
            super().set_continue()

        def set_quit(self) -> None:
            resumed.set()
            super().set_quit()

    def release(c: Any) -> None:  # on the group's worker thread: the others pass once the user continues
        resumed.wait(BREAKPOINT_WAIT)
        alg.barrier(c)

    # async: ordered before this rank's next collective, which waits for it
    g.run("breakpoint", release, async_op=True, timeout=BREAKPOINT_WAIT, signature=("breakpoint",))
    fin, fout = _debugger_io()
    dbg = _Pdb(stdin=fin, stdout=fout)
    dbg.use_rawinput = False
    fout.write(f"\n--- procgroup: rank {rank} stopped at a breakpoint; the other ranks wait. 'c' continues. ---\n")
    fout.flush()
    dbg.set_trace(sys._getframe(1 + skip))  # stops at the caller's next line


def dump_state(out: Optional[TextIO] = None) -> str:
    """Every thread's Python stack and every group's recent collectives, as text (also written to ``out``)."""
    buf = io.StringIO()
    w = _state.world
    who = f"rank {w.rank}/{w.size}" if w is not None else "uninitialized"
    buf.write(f"=== procgroup state: {who}, pid {os.getpid()} ===\n")
    names = {t.ident: t.name for t in threading.enumerate()}
    for tid, frame in sys._current_frames().items():
        buf.write(f"--- thread {names.get(tid, tid)} ---\n")
        buf.write("".join(traceback.format_stack(frame)))
    for g in list(_state.groups):
        if not g.is_member():
            continue
        buf.write(
            f"--- group {g.name} (gid {g.gid}, ranks {format_ranks(g.ranks)}): last completed seq {g.last_completed}\n"
        )
        for rec in list(g.flight)[-16:]:
            buf.write(f"    {as_record(rec).describe()}\n")
    text = buf.getvalue()
    if out is not None:
        out.write(text)
        out.flush()
    return text


def _on_sigusr1(signum: int, frame: Any) -> None:
    dump_state(sys.stderr)


def install_signal_handler() -> None:
    """SIGUSR1 -> dump_state, unless the application already handles SIGUSR1 (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, _on_sigusr1)
    except (ValueError, OSError):
        pass
