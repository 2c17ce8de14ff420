"""The README's main job and the PyTorch tutorial scripts, run through the launcher exactly as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launch(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_SECRET"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "procgroup", "run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(120)
def test_main_demo_four_ranks():
    p = launch("--standalone", "--nproc-per-node", "4", "examples/demo.py")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(4):
        assert re.search(rf"^\[{r}\] rank {r}/4 \(local rank {r}, node 0, pid \d+\) is up$", p.stdout, re.M), p.stdout
    assert "[0] all checks passed on 4 ranks" in p.stdout, p.stdout


@pytest.mark.timeout(120)
def test_hello_four_correct_lines():
    p = launch("--standalone", "--nproc-per-node", "4", "examples/hello.py")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if re.match(r"^\[\d\] ", l)]
    assert len({l.split()[0] for l in lines}) == 4, p.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, expect", [("p2p.py", "tensor(1.)"), ("allreduce.py", "tensor(2.)")])
def test_pytorch_tutorial_scripts(script, expect):
    pytest.importorskip("torch")
    p = launch("--standalone", "--nproc-per-node", "2", f"examples/tutorial/{script}")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(2):
        assert f"[{r}] Rank  {r}  has data  {expect}" in p.stdout, p.stdout
