"""procgroup as torch's backend with CUDA tensors, carried by torch's NCCL built under procgroup's group.

Needs a CUDA build of torch and a GPU (skips, saying so, otherwise); a machine with one GPU runs world size 1
and the two-ranks-on-one-GPU error.  Run: ``python -m pytest -q tests/cuda``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

torch = pytest.importorskip("torch")

from ..integration.harness import Result, collect, report, spawn_world  # noqa: E402

WORKER = Path(__file__).with_name("torch_cuda_workers.py")

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
    reason="needs a CUDA device and a torch build with NCCL (this machine has "
    + ("no CUDA device" if not torch.cuda.is_available() else "no NCCL in torch")
    + "); run on a GPU machine",
)


def run(n: int, scenario: str, backend: str = "procgroup", timeout: float = 120.0) -> List[Result]:
    """``scenario`` at world size ``n``; fail with every rank's output unless all printed OK."""
    env = {"PROCGROUP_TIMEOUT": "60", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    results = collect(spawn_world(n, scenario, [backend], env=env, script=WORKER), timeout)
    if any(r.returncode != 0 or "OK" not in r.stdout for r in results):
        raise AssertionError(f"{scenario} ({backend}) failed at world size {n}:\n{report(results)}")
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["procgroup", "cpu:procgroup,cuda:nccl"])
def test_cuda_collectives(backend: str) -> None:
    """Every collective on CUDA tensors (six dtypes, every root, non-contiguous, async + future, barrier) goes to
    torch's NCCL under procgroup's group; a CPU all_reduce in the same group stays with procgroup."""
    n = torch.cuda.device_count()
    run(min(n, 4), "collectives", backend)


@pytest.mark.timeout(180)
def test_ddp_on_cuda() -> None:
    """DDP on a CUDA model with backend "procgroup" trains; at world size 1 its parameters equal plain training's."""
    run(min(torch.cuda.device_count(), 2), "ddp")


@pytest.mark.timeout(180)
def test_two_ranks_on_one_gpu_say_so() -> None:
    """Two ranks on one GPU: a ConfigError naming both ranks, the GPU and the fix, instead of NCCL's
    "Duplicate GPU detected" from inside its first collective."""
    results = run(2, "shared_gpu")
    assert all("raised:" in r.stdout for r in results), report(results)
