"""Linux cross-memory attach (``process_vm_readv``, ``process_vm_writev``) through ctypes: one-copy large messages.

The shm transport sends a large message as a *rendezvous*: the sender puts
only ``(address, id)`` of its buffer in the ring, the receiver copies the
payload straight from the sender's address space into the receive buffer
with one ``process_vm_readv`` call, then acknowledges ``id`` so the sender's
request completes.  One copy instead of two (into the ring, out of it), no
ring-space ping-pong, and the copy runs on the receiver's core only.

It needs the same permission as ptrace attach (same uid, and Yama's
``ptrace_scope`` <= 0 or a ptracer relationship; seccomp may forbid the
call).  The transport probes every peer once at formation (reading the
peer's segment magic through :func:`read`) and falls back to the ring for
peers it cannot read.  ``ShmOptions.cma`` (``PROCGROUP_SHM_CMA=0``) turns it off.

:data:`AVAILABLE` is False where the call does not exist; :func:`read` raises
``OSError`` (errno set: ESRCH for a dead process, EFAULT for a bad address,
EPERM without permission).  :func:`write` is the same copy the other way
(``process_vm_writev``: a pair's broadcast root writes part of the result
straight into the other rank's buffer while that rank reads the rest); it
needs the same permission, and :func:`can_write` says whether the call is
allowed here at all (a seccomp profile may forbid one and not the other).
"""

from __future__ import annotations

import os
import platform
import threading
from typing import Any, Optional, Tuple

from ..config import ShmOptions

__all__ = ["AVAILABLE", "enabled", "read", "read_parallel", "SPLIT_MIN", "write", "can_write"]

AVAILABLE = False
_readv: Any = None  # the ctypes functions, when libc has them
_writev: Any = None

try:  # pragma: no branch - platform dependent
    import ctypes

    if os.name == "posix" and platform.system() == "Linux":
        _libc = ctypes.CDLL(None, use_errno=True)

        class _IOVec(ctypes.Structure):
            _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]

        _readv = _libc["process_vm_readv"]
        _writev = _libc["process_vm_writev"]
        for _f in (_readv, _writev):
            _f.restype = ctypes.c_ssize_t
            _f.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
        AVAILABLE = True
except Exception:  # noqa: BLE001 - no libc symbol, no ctypes: the ring it is
    AVAILABLE = False

#: bytes per process_vm_readv call (the kernel may return short reads; we loop anyway)
_STEP = 1 << 30


def enabled(options: Optional[ShmOptions] = None) -> bool:
    """Whether the transport may use cross-memory attach: available here and not turned off by ``options.cma``.

    ``options``: the transport's :class:`~procgroup.config.ShmOptions` (the defaults when None: on).
    """
    return AVAILABLE and (options is None or options.cma)


def read(pid: int, local: int, remote: int, n: int) -> None:
    """Copy ``n`` bytes at ``remote`` in process ``pid`` to ``local`` in ours.

    Raises OSError with errno set: ESRCH (the process is gone), EFAULT (a bad address, or no progress),
    EPERM (no permission), ENOSYS (the call is not available here).
    """
    _copy(_readv, "process_vm_readv", pid, local, remote, n)


def write(pid: int, local: int, remote: int, n: int) -> None:
    """Copy ``n`` bytes at ``local`` in ours to ``remote`` in process ``pid``; raises OSError as :func:`read`."""
    _copy(_writev, "process_vm_writev", pid, local, remote, n)


def _copy(fn: Any, name: str, pid: int, local: int, remote: int, n: int) -> None:
    if not AVAILABLE:
        raise OSError(38, f"{name} is not available")
    li = _IOVec()
    ri = _IOVec()
    done = 0
    while done < n:
        k = min(n - done, _STEP)
        li.iov_base, li.iov_len = local + done, k
        ri.iov_base, ri.iov_len = remote + done, k
        got = fn(pid, ctypes.addressof(li), 1, ctypes.addressof(ri), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(14, f"{name} made no progress")
        done += got


_can_write: Optional[bool] = None


def can_write() -> bool:
    """Whether ``process_vm_writev`` is allowed in this process (probed once, by copying one byte within it: the
    permission towards a peer is the one ``process_vm_readv`` needs, which the shm transport probes per peer)."""
    global _can_write
    if _can_write is None:
        ok = False
        if AVAILABLE:
            src, dst = ctypes.create_string_buffer(b"\x5a", 1), ctypes.create_string_buffer(1)
            try:
                write(os.getpid(), ctypes.addressof(src), ctypes.addressof(dst), 1)
                ok = dst.raw == b"\x5a"
            except OSError:
                ok = False
        _can_write = ok
    return _can_write


#: messages of at least this many bytes are read by two threads at once (``read_parallel``)
SPLIT_MIN = 4 << 20


class _Helper:
    """The thread that copies the second half of a split read: one per process, started on first use (a fork's
    child starts its own), asleep on a condition between reads."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.busy = threading.Lock()  # one split read at a time; another caller meanwhile reads alone
        self.cv = threading.Condition()
        self.job: Optional[Tuple[int, int, int, int]] = None
        self.err: Optional[OSError] = None
        threading.Thread(target=self._run, name="procgroup-cma", daemon=True).start()

    def _run(self) -> None:
        cv = self.cv
        while True:
            with cv:
                while self.job is None:
                    cv.wait()
                job = self.job
            err = None
            try:
                read(*job)
            except OSError as e:
                err = e
            with cv:
                self.err, self.job = err, None
                cv.notify_all()

    def read(self, pid: int, local: int, remote: int, n: int, half: int) -> None:
        """Bytes ``[half, n)`` by the helper while this thread reads ``[0, half)``; returns (or raises the first
        error) once both are done.  Caller holds ``busy``."""
        cv = self.cv
        with cv:
            self.err, self.job = None, (pid, local + half, remote + half, n - half)
            cv.notify()
        try:
            read(pid, local, remote, half)
        finally:
            # never leave while the helper still writes into ``local``: an interrupt (Ctrl-C) waits for it too.
            # No deadline: the helper is inside one process_vm_readv, which ends (EFAULT or ESRCH at worst)
            late: Optional[BaseException] = None
            with cv:
                while self.job is not None:
                    try:
                        cv.wait()
                    except BaseException as e:  # noqa: BLE001 - re-raised once the helper is done
                        late = late or e
            if late is not None:
                raise late
        if self.err is not None:
            raise self.err


_helper: Optional[_Helper] = None
_helper_lock = threading.Lock()


def _forget_helper() -> None:  # a fork's child: the parent's helper thread does not exist here
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def read_parallel(pid: int, local: int, remote: int, n: int) -> None:
    """:func:`read` with the second half copied by a helper thread meanwhile (the call releases the GIL).

    One core copying through process_vm_readv reaches about one memcpy's bandwidth; two reach more where the
    memory system has headroom (a rooted collective's sender is idle meanwhile).  The helper is one thread kept for
    the process (pass 18: starting a thread per read cost N=2 send/recv 16 / 64 MiB 1002 / 2711 against 744 / 2383
    us); where another thread of this process is using it, this one reads alone.  Returns or raises once both
    halves are done, so nothing writes into ``local`` afterwards.
    """
    global _helper
    half = (n // 2) & ~4095
    if n < SPLIT_MIN or half <= 0:
        read(pid, local, remote, n)
        return
    h = _helper
    if h is None or h.pid != os.getpid():
        with _helper_lock:
            if _helper is None or _helper.pid != os.getpid():
                _helper = _Helper()
            h = _helper
    if not h.busy.acquire(blocking=False):
        read(pid, local, remote, n)
        return
    try:
        h.read(pid, local, remote, n, half)
    finally:
        h.busy.release()
