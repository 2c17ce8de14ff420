"""The torch plug-in's routing helpers (procgroup.torch._delegate); the one-GPU-per-rank verdict itself is
procgroup.backends.nccl.devices' (tests/unit/test_nccl_backend.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from procgroup.torch._delegate import device_of  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_device_of_finds_the_first_non_cpu_tensor() -> None:
    import torch

    assert device_of([[torch.zeros(1)], torch.zeros(2), "opts"]) is None
    meta = torch.zeros(1, device="meta")
    assert device_of([[torch.zeros(1), [meta]], torch.zeros(2)]) == meta.device
