"""An UNMODIFIED torch.distributed gloo script under ``procgroup run`` (torchrun's drop-in).

The script initialises from the environment exactly as it would under torchrun; torch's rank 0
binds MASTER_PORT for its own TCPStore, which is why the launcher never holds that port itself.
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

pytestmark = pytest.mark.timeout(180)

SRC = Path(__file__).resolve().parents[2] / "src"

TORCH_SCRIPT = """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")  # env:// : RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    x = torch.arange(1, 5, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(x)  # SUM
    want = torch.arange(1, 5, dtype=torch.float64) * (world * (world + 1) / 2)
    assert torch.equal(x, want), (x, want)
    dist.barrier()
    print(f"torch rank {rank}/{world} local {os.environ['LOCAL_RANK']} ok {x.tolist()}", flush=True)
    dist.destroy_process_group()
"""


PLAIN_SCRIPT = """
    import sys
    import numpy as np
    import procgroup as dist

    dist.init_process_group()
    x = np.full(3, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    assert x.tolist() == [3.0, 3.0, 3.0], x
    loaded = sorted(m for m in ("torch", "torch.distributed") if m in sys.modules)
    print(f"plain rank {dist.get_rank()} torch modules {loaded}", flush=True)
    dist.destroy_process_group()
"""


def _run(tmp_path: Path, *args: str, source: str = TORCH_SCRIPT) -> subprocess.CompletedProcess:
    script = tmp_path / "torch_allreduce.py"
    script.write_text(textwrap.dedent(source))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "procgroup", "run", *args, str(script)],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def _context(r: subprocess.CompletedProcess) -> str:
    return f"exit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"


def test_unmodified_torch_gloo_script_runs_under_procgroup_run(tmp_path):
    r = _run(tmp_path, "--standalone", "--nproc-per-node", "2")
    ctx = _context(r)
    assert r.returncode == 0, ctx
    assert sorted(ln for ln in r.stdout.splitlines() if " ok " in ln) == [
        "[0] torch rank 0/2 local 0 ok [3.0, 6.0, 9.0, 12.0]",
        "[1] torch rank 1/2 local 1 ok [3.0, 6.0, 9.0, 12.0]",
    ], ctx
    assert "2 worker(s) on" in r.stderr and "succeeded" in r.stderr, ctx


def test_plain_procgroup_script_under_procgroup_run_never_imports_torch(tmp_path):
    """procgroup run sets TORCHELASTIC_RUN_ID (torchrun's contract) but hosts no agent store: init must not import
    torch to look for one (it did, and that cost every init 3-4 s here)."""
    r = _run(tmp_path, "--standalone", "--nproc-per-node", "2", source=PLAIN_SCRIPT)
    ctx = _context(r)
    assert r.returncode == 0, ctx
    assert sorted(ln for ln in r.stdout.splitlines() if "plain rank" in ln) == [
        "[0] plain rank 0 torch modules []",
        "[1] plain rank 1 torch modules []",
    ], ctx
