"""procgroup's own API with backend="nccl": CUDA torch tensors through torch's NCCL (issue 10 item 3).

Runs on a machine with a CUDA GPU, a CUDA build of torch and NCCL; elsewhere every test skips and says why.
Each test starts real ranks of ``tests/integration/device_workers.py`` (the scenarios that
tests/integration/test_device_engine_procs.py runs on the CPU through torch's gloo) with ``PG_BACKEND=nccl
PG_DEVICE=cuda``; the workers check closed-form values and print OK.  One GPU is enough: world size 1 for the
collectives, and world size 2 with both ranks on cuda:0 for the one-GPU-per-rank error.

    python -m pytest -x -q tests/cuda -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from ..integration.harness import collect, report, spawn_world

WORKER = Path(__file__).resolve().parents[1] / "integration" / "device_workers.py"


def _why_skip() -> str:
    try:
        import torch
        import torch.distributed as tdist
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return f"torch is not importable here ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    if not tdist.is_available() or not tdist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL (torch.distributed.is_nccl_available() is False)"
    return ""


_REASON = _why_skip()
pytestmark = pytest.mark.skipif(bool(_REASON), reason=f"needs a CUDA GPU with torch's NCCL: {_REASON}")


def run(
    n: int, scenario: str, *args: str, backend: str = "nccl", timeout: float = 240.0, ranks: Optional[List[int]] = None
) -> List[Tuple[int, str]]:
    """Run ``scenario`` at world size ``n``; returns (rank, stdout); fails with every rank's output unless every
    rank (or every one of ``ranks``) exited 0 and printed OK."""
    env = {"PROCGROUP_TIMEOUT": "120", "PG_BACKEND": backend, "PG_DEVICE": "cuda", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    results = collect(spawn_world(n, scenario, args, env=env, script=WORKER), timeout)
    if any(r.returncode != 0 or "OK" not in r.stdout for r in results if ranks is None or r.rank in ranks):
        raise AssertionError(f"{scenario} at world size {n} failed:\n{report(results)}")
    return [(r.rank, r.stdout) for r in results]


@pytest.mark.timeout(300)
def test_every_collective_with_cuda_tensors():
    """World size 1 on cuda:0 through torch's NCCL: all_reduce, reduce, reduce_scatter(_tensor) for nine dtypes
    (bool, bfloat16, float16 included) x SUM/PRODUCT/MIN/MAX/AVG (BAND/BOR/BXOR and integer AVG: ConfigError),
    broadcast, gather, scatter, all_gather(+into_tensor), all_to_all(+single, splits) for eleven dtypes and
    every root, sizes 0/1/7, non-contiguous tensors copied back, async_op Works, barrier and
    barrier(device_ids=[0]), numpy arrays beside them, subgroups destroyed and made again: closed-form values."""
    out = run(1, "collectives")
    assert "OK" in out[0][1]


@pytest.mark.timeout(180)
def test_two_ranks_on_one_gpu_get_procgroups_config_error():
    """World size 2, both ranks on cuda:0: every rank gets procgroup's ConfigError naming ranks 0 and 1, the GPU
    and the fix (torch.cuda.set_device(LOCAL_RANK) / CUDA_VISIBLE_DEVICES) for a collective and for send/recv,
    before NCCL is asked (not NCCL's 'Duplicate GPU detected', not a hang); the group still serves numpy."""
    out = run(2, "onedev")
    assert all(so.count("ONEDEV") == 2 for _, so in out), out


@pytest.mark.timeout(120)
def test_cuda_tensors_on_the_cpu_backend_name_the_fix():
    """backend='cpu' with a CUDA tensor: ConfigError saying the cpu backend takes CPU tensors and naming
    backend='nccl' (what it said before this backend existed)."""
    run(1, "cpu_backend", backend="cpu")


def _gpus() -> int:
    if _REASON:
        return 0
    import torch

    return int(torch.cuda.device_count())


_TWO = pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 GPUs (one per rank); this machine has {_gpus()}")


@_TWO
@pytest.mark.timeout(400)
def test_every_collective_on_several_gpus():
    """As test_every_collective_with_cuda_tensors, at world size 2 (and 4 where there are 4 GPUs): every root,
    point-to-point (send/recv, isend, batch_isend_irecv rings as one coalesced NCCL group), ANY_SOURCE refused."""
    for n in sorted({2, max(2, min(4, _gpus()))}):
        run(n, "collectives", timeout=180)


@_TWO
@pytest.mark.timeout(200)
def test_failures_on_several_gpus():
    """A skipped call: DistTimeoutError naming the op at the 2 s deadline (the NCCL group aborted, not torch's
    watchdog ending the process); a killed peer named within seconds; CPU data on one rank and CUDA tensors on
    the other: CollectiveMismatchError on both."""
    run(2, "deadline", timeout=60)
    out = run(2, "kill", timeout=60, ranks=[0])  # rank 1 kills itself
    assert "KILLED" in out[0][1], out
    for when in ("first", "later"):
        out = run(2, "mismatch", when, timeout=60)
        assert all("MISMATCH" in so for _, so in out), out
