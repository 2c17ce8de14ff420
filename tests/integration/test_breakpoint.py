"""dist.breakpoint() opens pdb on one rank, on the launcher's terminal (a pty here), while the others wait."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    buf = b""
    end = time.monotonic() + timeout
    while needle not in buf:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"did not see {needle!r} on the terminal within {timeout}s; got {buf[-2000:]!r}")
        r, _, _ = select.select([fd], [], [], min(left, 0.5))
        if r:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    return buf


@pytest.mark.timeout(90)
def test_breakpoint_on_rank_0_via_the_launchers_terminal():
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "procgroup",
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "tests/integration/scripts/breakpoint_worker.py",
        ],
        cwd=ROOT,
        env=env,
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(slave)
    try:
        _read_until(master, b"(Pdb)", 60)
        os.write(master, b"p secret_value + 1\n")
        out = _read_until(master, b"42", 20)
        assert b"42" in out
        os.write(master, b"c\n")
        so, se = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert p.returncode == 0, so + se
    assert "[0] rank 0 after breakpoint: [2.0, 2.0]" in so, so
    assert "[1] rank 1 after breakpoint: [2.0, 2.0]" in so, so
    assert "waiting for the debugger on rank 0" in se, se
