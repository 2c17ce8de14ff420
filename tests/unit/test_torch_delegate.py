"""The one-GPU-per-rank check the torch plug-in runs before building NCCL (procgroup.torch._delegate)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from procgroup.torch._delegate import device_of, shared_devices  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_distinct_devices_pass() -> None:
    assert shared_devices([("a", "GPU-1", "cuda:0"), ("a", "GPU-2", "cuda:1"), ("b", "GPU-3", "cuda:0")]) is None
    assert shared_devices([]) is None


def test_unknown_ids_never_conflict() -> None:
    assert shared_devices([("a", "", "cuda:0"), ("a", "", "cuda:0")]) is None


def test_shared_device_names_both_ranks_and_the_fix() -> None:
    why = shared_devices([("a", "GPU-1", "cuda:0"), ("a", "GPU-2", "cuda:1"), ("a", "GPU-1", "cuda:0")])
    assert why is not None
    assert "ranks 0 and 2 both use the GPU GPU-1" in why
    assert "rank 2: cuda:0 on a" in why and "set_device" in why and "CUDA_VISIBLE_DEVICES" in why


def test_device_of_finds_the_first_non_cpu_tensor() -> None:
    import torch

    assert device_of([[torch.zeros(1)], torch.zeros(2), "opts"]) is None
    meta = torch.zeros(1, device="meta")
    assert device_of([[torch.zeros(1), [meta]], torch.zeros(2)]) == meta.device
