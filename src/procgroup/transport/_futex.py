"""Futex wait/wake on a 32-bit word of a shared mapping, through ctypes.

The shm transport blocks in :func:`futex_wait` on a "doorbell" word of its
own segment and peers ring it with :func:`futex_wake`.  The operations are
the *shared* (non-private) ones, because the word is mapped by several
processes: the kernel keys the wait queue on the physical page, not on the
virtual address.

    addr = buffer_address(mm) + offset      # 4-byte aligned
    futex_wait(addr, expected, 0.05)         # returns on wake, value change, timeout or signal
    futex_wake(addr)                         # wakes every waiter

Where ctypes or the syscall is unavailable (not Linux, seccomp, ENOSYS),
:data:`AVAILABLE` is False: :func:`futex_wait` then sleeps a short,
bounded time (callers always re-check their condition after it returns) and
:func:`futex_wake` does nothing.  Both never raise.

:func:`futex_wait` must only be called on an address that stays mapped for
the duration of the call; the kernel reports EFAULT (not a crash) otherwise.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Optional, Tuple

__all__ = ["AVAILABLE", "futex_wait", "futex_wake", "raw_waker", "buffer_address", "FALLBACK_SLEEP"]

#: Sleep used by the fallback futex_wait (seconds).
FALLBACK_SLEEP = 0.0005

_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "i386": 240,
    "i686": 240,
    "armv7l": 240,
    "ppc64le": 221,
    "s390x": 238,
    "riscv64": 98,
}
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_INT_MAX = 0x7FFFFFFF
_EAGAIN, _EINTR, _ETIMEDOUT, _ENOSYS = 11, 4, 110, 38

AVAILABLE = False
_syscall: Any = None  # ctypes functions and struct, when the syscall is there
_syscall_wake: Any = None
_Timespec: Any = None

try:  # pragma: no branch - platform dependent
    import ctypes

    _nr = _SYS_FUTEX.get(platform.machine().lower())
    if _nr is not None and os.name == "posix" and platform.system() == "Linux":
        _libc = ctypes.CDLL(None, use_errno=True)
        # two function objects with the fewest arguments each needs: ctypes
        # argument conversion dominates the cost of a wake (~0.4 us per argument)
        _syscall = _libc["syscall"]
        _syscall.restype = ctypes.c_long
        _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
        _syscall_wake = _libc["syscall"]
        _syscall_wake.restype = ctypes.c_long
        _syscall_wake.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

        class _TimespecStruct(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        _Timespec = _TimespecStruct

        _NR_FUTEX = _nr
        AVAILABLE = True
except Exception:  # noqa: BLE001 - any failure to load means "no futex": fall back to sleeping
    AVAILABLE = False


def _disable() -> None:
    global AVAILABLE
    AVAILABLE = False


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Block while the u32 at ``addr`` equals ``expected``, at most ``timeout`` seconds.

    Returns on a wake, when the value differs, on timeout or on a signal:
    the caller re-checks its condition in every case.
    """
    if timeout <= 0:
        return
    if not AVAILABLE:
        time.sleep(min(timeout, FALLBACK_SLEEP))
        return
    ts = _Timespec(int(timeout), int((timeout - int(timeout)) * 1e9))
    r = _syscall(_NR_FUTEX, addr, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.addressof(ts))
    if r != 0:
        err = ctypes.get_errno()
        if err == _ENOSYS:
            _disable()
            time.sleep(min(timeout, FALLBACK_SLEEP))
        elif err not in (_EAGAIN, _EINTR, _ETIMEDOUT):
            # EFAULT/EINVAL/EPERM: never spin on a broken futex
            time.sleep(min(timeout, FALLBACK_SLEEP))


def futex_wake(addr: int, n: int = _INT_MAX) -> int:
    """Wake up to ``n`` waiters on ``addr``; returns how many were woken (0 in fallback mode)."""
    if not AVAILABLE:
        return 0
    r = _syscall_wake(_NR_FUTEX, addr, _FUTEX_WAKE, n)
    if r < 0:
        if ctypes.get_errno() == _ENOSYS:
            _disable()
        return 0
    return int(r)


def raw_waker() -> Optional[Tuple[Any, int]]:
    """``(fn, nr)`` for the hot path: ``fn(nr, addr, 1, n)`` is FUTEX_WAKE without the wrapper; None if unavailable."""
    if not AVAILABLE or _syscall_wake is None:
        return None
    return _syscall_wake, _NR_FUTEX


def buffer_address(buf: object) -> int:
    """Address of the first byte of a writable buffer (an ``mmap``), without keeping an export.

    The address is valid as long as the mapping is; the caller guarantees that.
    """
    import ctypes as _ct

    c = (_ct.c_char * 1).from_buffer(buf)  # type: ignore[arg-type]  # any writable buffer; typeshed wants one
    addr = _ct.addressof(c)
    del c
    return addr
