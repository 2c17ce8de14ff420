"""Cross-memory attach helpers: one-thread and two-thread reads of another address space (here: our own), and
writes into one."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

from procgroup.transport import _cma

pytestmark = pytest.mark.skipif(not _cma.AVAILABLE, reason="process_vm_readv is not available here")


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


@pytest.mark.parametrize(
    "n", [1, 4095, _cma.SPLIT_MIN - 1, _cma.SPLIT_MIN, _cma.SPLIT_MIN + 4097, 3 * _cma.SPLIT_MIN + 1]
)
def test_read_parallel_copies_every_byte(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 16, dtype=np.uint8)  # a guard band after the destination must stay untouched
    _cma.read_parallel(os.getpid(), _addr(dst), _addr(src), n)
    assert np.array_equal(dst[:n], src)
    assert not dst[n:].any()


def test_read_parallel_reports_a_failure_of_either_half(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2 * _cma.SPLIT_MIN
    dst = np.zeros(n, dtype=np.uint8)
    with pytest.raises(OSError):
        _cma.read_parallel(os.getpid(), _addr(dst), 4096, n)  # the first pages of the address space are unmapped
    real = _cma.read
    src = np.ones(n, dtype=np.uint8)
    for bad_half in (0, 1):

        def flaky(pid: int, local: int, remote: int, k: int, bad_half: int = bad_half) -> None:
            if (local != _addr(dst)) == bool(bad_half):
                raise OSError(14, "injected failure")
            real(pid, local, remote, k)

        monkeypatch.setattr(_cma, "read", flaky)
        with pytest.raises(OSError, match="injected"):
            _cma.read_parallel(os.getpid(), _addr(dst), _addr(src), n)


def test_the_helper_thread_is_kept_and_a_failing_half_waits_for_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 2 * _cma.SPLIT_MIN
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    for _ in range(3):
        dst = np.zeros(n, dtype=np.uint8)
        _cma.read_parallel(os.getpid(), _addr(dst), _addr(src), n)
        assert np.array_equal(dst, src)
    assert sum(t.name == "procgroup-cma" for t in threading.enumerate()) == 1  # one helper, reused
    real, half = _cma.read, n // 2

    def slow_helper(pid: int, local: int, remote: int, k: int) -> None:
        if local == _addr(dst):
            raise KeyboardInterrupt  # this thread's half: an interrupt at once
        time.sleep(0.2)  # the helper's half, still copying when the interrupt comes
        real(pid, local, remote, k)

    dst = np.zeros(n, dtype=np.uint8)
    monkeypatch.setattr(_cma, "read", slow_helper)
    with pytest.raises(KeyboardInterrupt):
        _cma.read_parallel(os.getpid(), _addr(dst), _addr(src), n)
    assert np.array_equal(dst[half:], src[half:]), "read_parallel returned while its helper still wrote"


def test_concurrent_split_reads_and_a_forked_child() -> None:
    n = _cma.SPLIT_MIN + 8192
    src = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    outs = [np.zeros(n, dtype=np.uint8) for _ in range(4)]

    def reads(k: int) -> None:
        for _ in range(5):
            _cma.read_parallel(os.getpid(), _addr(outs[k]), _addr(src), n)

    threads = [threading.Thread(target=reads, args=(k,)) for k in range(4)]  # one has the helper, others read alone
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(np.array_equal(o, src) for o in outs)
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper thread is not here; a new one serves it
        code = 1
        try:
            dst = np.zeros(n, dtype=np.uint8)
            _cma.read_parallel(os.getpid(), _addr(dst), _addr(src), n)
            code = 0 if np.array_equal(dst, src) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_enabled_follows_the_options_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from procgroup.config import ShmOptions

    monkeypatch.setenv("PROCGROUP_SHM_CMA", "0")  # read once by config.shm_options(), never by _cma itself
    assert _cma.enabled(ShmOptions()) is True
    assert _cma.enabled(ShmOptions(cma=False)) is False


@pytest.mark.parametrize("n", [1, 4097, (1 << 20) + 3])
def test_write_copies_every_byte_and_nothing_past_them(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 16, dtype=np.uint8)
    _cma.write(os.getpid(), _addr(src), _addr(dst), n)
    assert np.array_equal(dst[:n], src) and not dst[n:].any()


def test_a_failed_write_raises_with_errno() -> None:
    src = np.ones(16, np.uint8)
    with pytest.raises(OSError) as ei:
        _cma.write(os.getpid(), _addr(src), 8, 16)  # an address that is not mapped
    assert ei.value.errno == errno.EFAULT
    assert _cma.can_write()  # allowed here; probed once per process
