"""torch's group and procgroup's group in one job (issue 10 item 8), with real processes.

procgroup reuses torch's default store when torch's group exists in the process, and under torchrun joins the
agent's store on MASTER_PORT, so neither order clashes on the port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("both_groups.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("OK") == 2 and out.count("[2.0, 2.0] [2.0, 2.0]") == 2, out[-4000:]


@pytest.mark.parametrize("order", ["torch-first", "pg-first"])
def test_under_torchrun(order: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    proc = subprocess.run([*cmd, str(WORKER), order], capture_output=True, text=True, timeout=120, env=os.environ)
    _check(proc)


def test_under_procgroup_run_torch_first() -> None:
    cmd = [sys.executable, "-m", "procgroup", "run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    proc = subprocess.run([*cmd, str(WORKER), "torch-first"], capture_output=True, text=True, timeout=120)
    _check(proc)
