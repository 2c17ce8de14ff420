"""examples/torch_ddp_digits.py under ``procgroup run`` at N=2: procgroup's losses equal gloo's bit for bit."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .gloo_reference import launch

pytest.importorskip("torch")
pytest.importorskip("sklearn", reason="the example's dataset ships in scikit-learn (pip install scikit-learn)")

ROOT = Path(__file__).resolve().parents[2]


#: rank 0's line for each epoch: the epoch and its mean loss as float.hex
_EPOCH = re.compile(r"^\[0\] epoch (\d) loss \S+ \((\S+)\)", re.MULTILINE)


def _losses(backend: str) -> list[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    r = launch(
        ["examples/torch_ddp_digits.py", "--backend", backend, "--epochs", "3"],
        env,
        ROOT,
        reference=backend == "gloo",
        complete=lambda r: len(_EPOCH.findall(r.stdout)) == 3,
    )
    losses = _EPOCH.findall(r.stdout)
    assert [e for e, _ in losses] == ["0", "1", "2"], r.stdout
    return [h for _, h in losses]


@pytest.mark.timeout(300)
def test_digits_losses_bitwise_equal_to_gloo() -> None:
    pg, gloo = _losses("procgroup"), _losses("gloo")
    assert pg == gloo
    assert float.fromhex(pg[-1]) < float.fromhex(pg[0])  # it learns
