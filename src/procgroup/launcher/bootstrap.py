"""Worker-side entry point: run the user's program as ``__main__``, record an uncaught exception.

Usage (the agent builds this command line; it also works by hand)::

    python -m procgroup.launcher.bootstrap [OPTIONS] [-m] target [args...]
    python .../procgroup/launcher/bootstrap.py [OPTIONS] [-m] target [args...]

OPTIONS (all before the target; everything after it belongs to the program):

``--error-file PATH``  where to write the JSON error record (default: $PROCGROUP_ERROR_FILE)
``--rank R --local-rank L --host H``  identity recorded in the error file (default: from the environment)
``--parent-pid P``  the agent's pid: die with SIGKILL when it dies (PR_SET_PDEATHSIG), exit at once if it already has
``--cpus 0,2``  bind this process (and so the program, its threads and children) to these CPUs first
``--exec``  run ``target`` as an executable (``--no-python``) after arming the parent-death signal
``-m``  ``target`` is a module name, as ``python -m``

The agent runs this file by path, not with ``-m``, so that nothing but the
standard library is imported before the user's code: importing the
``procgroup`` package (and numpy with it) first would defeat a script that
sets ``OMP_NUM_THREADS`` before its own imports.  The program sees what
``python script.py`` / ``python -m module`` would give it: ``sys.argv``,
``sys.path[0]`` (the script's directory, or the working directory for
``-m``), ``__name__ == "__main__"``.

On an uncaught exception the error record (rank, host, pid, exception type,
message, formatted traceback, timestamp) is written atomically, the
traceback is printed to stderr without the bootstrap's own frames, and the
process exits with status 1.  ``SystemExit`` passes through unchanged and
``KeyboardInterrupt`` is re-raised so that the exit status still says SIGINT.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Mapping, NoReturn, Optional

__all__ = ["main", "set_parent_death_signal", "bind_cpus", "write_error_file", "error_record"]

_PR_SET_PDEATHSIG = 1
#: After an uncaught exception, exit even if non-daemon threads keep the interpreter alive.
_EXIT_WATCHDOG_S = 30.0
_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _env(attr: str, environ: Mapping[str, str]) -> Optional[str]:
    """The value of the contract variable ``ENV.<attr>`` in ``environ`` (None when unset or empty), read through
    :func:`procgroup.config.env_str`; procgroup is imported only when the agent did not pass the value."""
    try:
        from procgroup.config import ENV, env_str  # noqa: PLC0415 - deliberately lazy, see module docstring
    except ImportError:  # run by path without procgroup on sys.path: use the tree this file is in
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from procgroup.config import ENV, env_str  # noqa: PLC0415
    return env_str(str(getattr(ENV, attr)), environ)


def _is_own(filename: str) -> bool:
    return filename in _OWN_FILES or (not filename.startswith("<") and os.path.abspath(filename) in _OWN_FILES)


def _trimmed_tb(exc: BaseException) -> Optional[TracebackType]:
    """The traceback without the bootstrap's and runpy's frames at its top."""
    tb = exc.__traceback__
    while tb is not None and _is_own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb if tb is not None else exc.__traceback__


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, _trimmed_tb(exc)))


def error_record(exc: BaseException, *, rank: Optional[int], local_rank: Optional[int], host: str) -> dict:
    t = time.time()
    return {
        "rank": rank,
        "local_rank": local_rank,
        "host": host,
        "pid": os.getpid(),
        "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": format_exception(exc),
        "timestamp": t,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}",
    }


def write_error_file(path: str, record: dict) -> None:
    """Write ``record`` as JSON atomically (tmp file + rename): the agent never reads half a file."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _force_exit_later(code: int, after: float) -> None:
    def _go() -> None:
        time.sleep(after)
        try:
            sys.stderr.write(
                f"procgroup bootstrap: still alive {after:g}s after an uncaught exception "
                "(a non-daemon thread is running?); forcing exit\n"
            )
            sys.stderr.flush()
        finally:
            os._exit(code)

    threading.Thread(target=_go, name="procgroup-exit-watchdog", daemon=True).start()


def bind_cpus(spec: str) -> bool:
    """Bind this process to the CPUs of ``spec`` ("0,2"; the agent's ``--cpu-bind``), before any thread exists, so
    that every thread and child inherits them.  A CPU this process may not use (a cgroup changed under us) leaves
    it unbound with a line on stderr, never stops the worker; False then."""
    try:
        cpus = {int(c) for c in spec.split(",") if c.strip()}
        os.sched_setaffinity(0, cpus)
        return True
    except (ValueError, OSError, AttributeError) as e:
        sys.stderr.write(f"procgroup bootstrap: not bound to CPUs {spec!r} ({e}); running unbound\n")
        return False


class _Args:
    error_file: Optional[str] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    host: Optional[str] = None
    parent_pid: Optional[int] = None
    cpus: Optional[str] = None
    exec_: bool = False
    module: bool = False
    target: str = ""
    argv: list[str]


def _usage(msg: str) -> NoReturn:
    sys.stderr.write(
        f"procgroup bootstrap: {msg}\nusage: bootstrap [--error-file F] [--rank R] [--local-rank L] "
        "[--host H] [--parent-pid P] [--cpus LIST] [--exec | -m] target [args...]\n"
    )
    sys.exit(2)


def _parse(argv: list[str]) -> _Args:
    a = _Args()
    valued = {
        "--error-file": "error_file",
        "--rank": "rank",
        "--local-rank": "local_rank",
        "--host": "host",
        "--parent-pid": "parent_pid",
        "--cpus": "cpus",
    }
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in valued:
            if i + 1 >= len(argv):
                _usage(f"{tok} needs a value")
            val: object = argv[i + 1]
            if valued[tok] in ("rank", "local_rank", "parent_pid"):
                try:
                    val = int(argv[i + 1])
                except ValueError:
                    _usage(f"{tok} {argv[i + 1]!r} is not an integer")
            setattr(a, valued[tok], val)
            i += 2
        elif tok == "--exec":
            a.exec_ = True
            i += 1
        elif tok == "-m":
            a.module = True
            i += 1
        elif tok == "--":
            i += 1
            break
        elif tok.startswith("-") and tok != "-":
            _usage(f"unknown option {tok!r} (options go before the target)")
        else:
            break
    if i >= len(argv):
        _usage("no target given")
    a.target = argv[i]
    a.argv = argv[i + 1 :]
    return a


def _identity(a: _Args, environ: Mapping[str, str]) -> tuple[Optional[int], Optional[int], str]:
    def int_var(attr: str) -> Optional[int]:
        try:
            return int(_env(attr, environ) or "")
        except (ValueError, ImportError):
            return None

    rank = a.rank if a.rank is not None else int_var("RANK")
    local = a.local_rank if a.local_rank is not None else int_var("LOCAL_RANK")
    host = a.host
    if host is None:
        try:
            host = _env("HOSTNAME", environ) or socket.gethostname()
        except ImportError:
            host = socket.gethostname()
    return rank, local, host


def _error_file(a: _Args, environ: Mapping[str, str]) -> Optional[str]:
    if a.error_file:
        return a.error_file
    try:
        return _env("ERROR_FILE", environ)
    except ImportError:
        return None


def main(argv: Optional[list[str]] = None) -> None:
    a = _parse(list(sys.argv[1:] if argv is None else argv))

    if a.parent_pid is not None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != a.parent_pid:  # the agent died before prctl took effect
            sys.stderr.write(f"procgroup bootstrap: the launcher (pid {a.parent_pid}) is gone; not starting\n")
            os._exit(1)

    if a.cpus is not None:
        bind_cpus(a.cpus)

    if a.exec_:
        try:
            os.execvp(a.target, [a.target, *a.argv])
        except OSError as e:
            sys.stderr.write(
                f"procgroup: cannot execute {a.target!r}: {e.strerror or e} "
                "(--no-python runs an executable from PATH or a path; drop --no-python for a .py file)\n"
            )
            os._exit(127)

    import faulthandler  # a builtin module: imports nothing

    if not faulthandler.is_enabled():  # PYTHONFAULTHANDLER / -X faulthandler already enabled it
        faulthandler.enable()  # a segfault then shows a Python stack in the root-cause report

    if a.module:
        sys.argv = [a.target, *a.argv]  # runpy replaces argv[0] with the module's path
        sys.path[0] = os.getcwd()
        run = lambda: runpy.run_module(a.target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        if not os.path.exists(a.target):
            sys.stderr.write(
                f"procgroup: can't open file {os.path.abspath(a.target)!r}: no such file "
                "(use -m for a module, --no-python for an executable)\n"
            )
            sys.exit(2)
        sys.argv = [a.target, *a.argv]
        sys.path[0] = os.path.dirname(os.path.realpath(a.target))
        run = lambda: runpy.run_path(a.target, run_name="__main__")  # noqa: E731

    try:
        run()
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        # Python prints it and exits by SIGINT, as without the launcher; only our frames are hidden
        raise exc.with_traceback(_trimmed_tb(exc))  # noqa: B904 - the same exception, re-raised
    except BaseException as exc:  # noqa: BLE001 - record anything, then exit 1 like Python does
        try:
            environ = os.environ  # the worker's environment, read here only, for the error record
            path = _error_file(a, environ)
            if path:
                rank, local, host = _identity(a, environ)
                write_error_file(path, error_record(exc, rank=rank, local_rank=local, host=host))
        except Exception as werr:  # noqa: BLE001 - the user's traceback matters more; say why the file is missing
            sys.stderr.write(f"procgroup bootstrap: could not write the error file: {werr}\n")
        sys.stdout.flush()
        exc.__traceback__ = _trimmed_tb(exc)
        # as the interpreter does for an uncaught exception: procgroup's exit handler reads it to tell the peers
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.last_exc = exc  # type: ignore[attr-defined]  # Python 3.12+ reads this name; harmless before
        sys.excepthook(type(exc), exc, exc.__traceback__)  # the user's hook if they installed one
        sys.stderr.flush()
        _force_exit_later(1, _EXIT_WATCHDOG_S)
        sys.exit(1)


if __name__ == "__main__":
    main()
