"""The nccl backend's delegation path in real processes, on a machine without a GPU.

``tests/backends/torch_gloo`` forms the very world ``backend="nccl"`` forms (procgroup's cpu world plus the
:class:`~procgroup.backends.nccl.engine.TorchDeviceEngine`), with the engine's (device type, torch backend)
set to ("cpu", "gloo") and torch CPU tensors routed to it: every collective and p2p op with a torch tensor
runs the engine's code (per-group torch group over procgroup's store, device check, polling wait under the
deadline with the liveness probes, abort, copies back) through torch's gloo.  The scenarios live in
``device_workers.py``; tests/cuda/test_own_api_nccl.py runs the same ones with CUDA tensors and NCCL.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import pytest

pytest.importorskip("torch")


from .harness import Result, collect, report, spawn_world  # noqa: E402

WORKER = Path(__file__).with_name("device_workers.py")


def run(n: int, scenario: str, *args: str, timeout: float = 120.0, ranks: Optional[List[int]] = None) -> List[Result]:
    """Run ``scenario`` at world size ``n`` on the gloo stand-in; fail with every rank's output unless all
    (or ``ranks``) printed OK and exited 0."""
    extra = {"PG_BACKEND": "torch_gloo", "PG_DEVICE": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    results = collect(spawn_world(n, scenario, args, env=extra, script=WORKER), timeout)
    judged = [r for r in results if ranks is None or r.rank in ranks]
    if any(r.returncode != 0 or "OK" not in r.stdout for r in judged):
        raise AssertionError(f"{scenario} {args} failed at world size {n}:\n{report(results)}")
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_through_the_engine(n: int) -> None:
    """Every collective and p2p op, every root, nine dtypes (bool, bfloat16, float16 included), every ReduceOp
    (BAND/BOR/BXOR: ConfigError), sizes 0/1/7, non-contiguous tensors, async_op, subgroups destroyed and made
    again, numpy arrays beside them in the same world: closed-form values."""
    run(n, "collectives", timeout=180)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", ["deadline", "first_deadline"])
def test_a_skipped_call_times_out_naming_the_op(scenario: str) -> None:
    """One rank skips a call (the group's first device call, or a later one): the other raises
    DistTimeoutError naming all_reduce at its 2 s deadline, not at torch's own timeout."""
    out = run(2, scenario, timeout=50)
    assert "OK" in out[0].stdout


@pytest.mark.timeout(60)
def test_a_killed_peer_is_named() -> None:
    """A rank dies between calls: the survivor's next device call raises within seconds naming rank 1."""
    out = run(2, "kill", timeout=50, ranks=[0])
    assert "KILLED" in out[0].stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["first", "later"])
def test_cpu_and_device_data_in_one_call_is_a_mismatch(when: str) -> None:
    """Rank 0 passes a numpy array, rank 1 a device tensor: CollectiveMismatchError on both (the signature
    carries the device), at the group's first device call and once its torch group exists."""
    out = run(2, "mismatch", when, timeout=50)
    assert all("MISMATCH" in r.stdout for r in out), report(out)


@pytest.mark.timeout(60)
def test_two_ranks_on_one_device_get_a_config_error() -> None:
    """Ranks reporting the same device: ConfigError naming both ranks, the device and the fix, on every rank,
    for a collective and for send/recv; the group keeps working for CPU data."""
    out = run(2, "onedev", timeout=50)
    assert all(r.stdout.count("ONEDEV") == 2 for r in out), report(out)
