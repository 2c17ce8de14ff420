"""Start the integration tests' worker processes by forking a warm interpreter instead of exec'ing a new one.

A worker rank is ``python SCRIPT FUNC ARGS`` with its own environment (``harness.spawn_world``).  On the 2-CPU CI
machine a fresh interpreter spends about 0.2 s of CPU before the script's first line (the interpreter, ``site``,
numpy), and most integration tests start 2-8 ranks, so a large part of the suite's time went into starting
Python.  Here one *zygote* per pytest process starts once, imports numpy, and then forks one child per rank; each
child takes the rank's environment, working directory, argv, stdout/stderr pipes and a session of its own, and runs
the script as ``__main__`` (``runpy.run_path``), exactly where ``python SCRIPT`` would.  The ranks stay real, separate
processes: their sockets, shared memory, signals and exit codes are their own; only their parent is the zygote.

:func:`spawn` returns a :class:`Forked` that answers the part of ``subprocess.Popen`` the tests use (``pid``,
``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``/``kill``/``terminate``, ``stdout``/``stderr``
as text files); the zygote reports each child's exit status over its control socket.  :func:`usable` says when a
rank may take this path: same interpreter, and every variable that Python or numpy read at start-up (``PYTHON*``,
``OMP_*``, ``OPENBLAS_*``, ``MKL_*``, ``NPY_*``, ``LD_*``, ``MALLOC_*``) equal to the zygote's; otherwise the
harness exec's as before.  ``PROCGROUP_TEST_ZYGOTE=0`` turns the zygote off.  The zygote exits when the pytest
process closes its socket (or dies), and never outlives it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

#: environment variables read when an interpreter (or numpy) starts: a rank whose values differ is exec'd
STARTUP_PREFIXES = ("PYTHON", "OMP_", "OPENBLAS_", "MKL_", "NPY_", "LD_", "MALLOC_")
#: the other variables the zygote itself keeps (each child takes its rank's whole environment)
_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "USER")
#: the biggest control message (a rank's environment as JSON)
MAX_MSG = 1 << 20


def _startup_env(env: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


# --------------------------------------------------------------------------------------------- the zygote itself


def _serve(sock: socket.socket) -> Optional[str]:
    """The zygote's loop: fork a child per request, report every child's exit.  Returns in the child only
    (the script's path), after the child took its rank's place; returns None when the parent is gone."""
    import selectors

    import numpy  # noqa: F401  (the point of the zygote: every child starts with it imported)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, 2)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    return None
                job = json.loads(msg)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sock.close()
                    return _become(job, fds)
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"pid": pid}).encode())
            else:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become(job: dict, fds: List[int]) -> str:
    """In the forked child: take the rank's session, pipes, environment, directory and argv."""
    os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    script = os.path.abspath(job["argv"][0])
    sys.argv = [script, *job["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
        sys.modules["numpy.random"].seed()
    return script


# --------------------------------------------------------------------------------------------- the pytest side


class Forked:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface the harness and tests use."""

    def __init__(self, zyg: "_Zygote", pid: int, args: Sequence[str], stdout: int, stderr: int) -> None:
        self._zyg = zyg
        self.pid = pid
        self.args = list(args)
        self.returncode: Optional[int] = None
        self.stdin = None
        self.stdout = open(stdout, "r", encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr = open(stderr, "r", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._readers: List[threading.Thread] = []
        self._out: Dict[str, str] = {}

    def poll(self) -> Optional[int]:
        """The exit code once the zygote reported it, else None."""
        if self.returncode is None:
            self.returncode = self._zyg.status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the exit code, raising ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self.returncode is None:
            code = self._zyg.status(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = code
        return self.returncode

    def communicate(self, input: object = None, timeout: Optional[float] = None) -> Tuple[str, str]:
        """Read stdout and stderr to their ends and wait for the exit (as ``Popen.communicate``)."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            for name in ("stdout", "stderr"):
                t = threading.Thread(target=self._read, args=(name,), daemon=True)
                t.start()
                self._readers.append(t)
        for t in self._readers:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self._out["stdout"], self._out["stderr"]

    def _read(self, name: str) -> None:
        f = getattr(self, name)
        try:
            self._out[name] = f.read()
        finally:
            f.close()

    def send_signal(self, sig: int) -> None:
        """Signal the rank, unless its exit was already reported."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the rank."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM the rank."""
        self.send_signal(signal.SIGTERM)


class _Zygote:
    def __init__(self, env: Dict[str, str]) -> None:
        self.env = _startup_env(env)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(  # no rank's variables (its secret, its rank) in the zygote's environment
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            env={**{k: v for k, v in env.items() if k in _KEEP}, **self.env},
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()  # one request at a time
        self.cond = threading.Condition()
        self.pids: List[int] = []
        self.codes: Dict[int, int] = {}
        self.dead = False
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                msg = self.sock.recv(MAX_MSG)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.dead = True
                    self.cond.notify_all()
                    return
                m = json.loads(msg)
                if "pid" in m:
                    self.pids.append(m["pid"])
                else:
                    self.codes[m["exit"]] = m["code"]
                self.cond.notify_all()

    def spawn(self, argv: Sequence[str], env: Dict[str, str], cwd: str) -> Forked:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self.lock:
                msg = json.dumps({"argv": list(argv[1:]), "env": env, "cwd": cwd}).encode()
                socket.send_fds(self.sock, [msg], [out_w, err_w])
                with self.cond:
                    if not self.cond.wait_for(lambda: self.pids or self.dead, 30):
                        raise RuntimeError("the test zygote did not answer a fork request in 30 s")
                    if not self.pids:
                        raise RuntimeError("the test zygote is gone")
                    pid = self.pids.pop(0)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return Forked(self, pid, argv, out_r, err_r)

    def status(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.codes or self.dead, timeout)
            if pid in self.codes:
                return self.codes.pop(pid)
            if self.dead:
                raise RuntimeError(f"the test zygote died before reporting pid {pid}'s exit")
            return None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes our listener's recv; the zygote sees the end and exits
            self.sock.close()
        finally:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_ZYGOTE: Optional[_Zygote] = None
_ZLOCK = threading.Lock()


def usable(argv: Sequence[str], env: Dict[str, str]) -> bool:
    """True when ``argv`` (``[sys.executable, script, ...]``) with ``env`` may be forked from the zygote."""
    if os.environ.get("PROCGROUP_TEST_ZYGOTE", "1") == "0" or argv[0] != sys.executable or len(argv) < 2:
        return False
    z = _ZYGOTE
    return z is None or (_startup_env(env) == z.env and not z.dead)


def spawn(argv: Sequence[str], env: Dict[str, str], cwd: str) -> Forked:
    """Fork ``argv``'s script with ``env`` in ``cwd`` from this pytest process's zygote (started on first use)."""
    global _ZYGOTE
    with _ZLOCK:
        if _ZYGOTE is None:
            _ZYGOTE = _Zygote(env)
            atexit.register(_ZYGOTE.close)
        z = _ZYGOTE
    return z.spawn(argv, env, cwd)


if __name__ == "__main__":
    _job = _serve(socket.socket(fileno=int(sys.argv[1])))
    if _job is None:
        sys.exit(0)
    del _serve, _become  # the rank's __main__ runs in a namespace of its own (runpy), as `python SCRIPT` would
    import runpy

    runpy.run_path(_job, run_name="__main__")
