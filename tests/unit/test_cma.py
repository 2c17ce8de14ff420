"""Cross-memory attach helpers: one-thread and two-thread reads of another address space (here: our own), and
writes into one."""

from __future__ import annotations

import errno
import os

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
