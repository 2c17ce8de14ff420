"""torch.distributed's group and procgroup's own group in one job (issue 10 item 8).

One script inits torch's gloo group and procgroup's group in the same process (N=2) and runs one all_reduce
with each, under ``procgroup run`` and under ``torchrun``.  torch first works under both launchers; procgroup
first under ``procgroup run`` still fails (procgroup's rank 0 binds MASTER_PORT for its store, then torch's
TCPStore gets EADDRINUSE): that case is a strict xfail, so it turns into a failure once fixed.
Skipped when torch is not importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
    import sys
    import numpy as np
    import torch
    import torch.distributed as tdist
    import procgroup as dist

    if sys.argv[1] == "torch_first":
        tdist.init_process_group("gloo")
        dist.init_process_group()
    else:
        dist.init_process_group()
        tdist.init_process_group("gloo")
    n = tdist.get_world_size()
    t = torch.ones(2)
    tdist.all_reduce(t)
    a = np.ones(2)
    dist.all_reduce(a)
    assert t.tolist() == [n, n] and a.tolist() == [n, n], (t, a)
    print(f"both ok rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
    tdist.destroy_process_group()
"""


def _run(tmp_path: Path, launcher: str, order: str) -> subprocess.CompletedProcess:
    script = tmp_path / "both_groups.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    cmd = (
        [sys.executable, "-m", "procgroup", "run"]
        if launcher == "procgroup"
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    return subprocess.run(
        [*cmd, "--standalone", "--nproc-per-node", "2", str(script), order],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher,order",
    [
        ("procgroup", "torch_first"),
        ("torchrun", "torch_first"),
        ("torchrun", "procgroup_first"),
        pytest.param(
            "procgroup",
            "procgroup_first",
            marks=pytest.mark.xfail(strict=True, reason="procgroup's store holds MASTER_PORT: torch gets EADDRINUSE"),
        ),
    ],
)
def test_torch_group_and_procgroup_group_in_one_job(tmp_path, launcher, order):
    r = _run(tmp_path, launcher, order)
    ctx = f"exit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, ctx
    assert r.stdout.count("both ok rank") == 2, ctx
