"""DDP and FSDP2 train with backend="procgroup": real processes at world size 2 under ``procgroup run``.

DDP with bucketed allreduce (a tiny bucket cap, so one bucket per layer), the allreduce and fp16-compression comm
hooks, no_sync gradient accumulation and Join with uneven inputs; FSDP2 (``fully_shard``) for 2 steps; and an
unmodified gloo DDP script with only the backend name changed ends with parameters bit-for-bit equal to gloo's.
Skipped when torch is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomllib

from .gloo_reference import launch

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _env(extra_path: str = "") -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    parts = [str(ROOT / "src"), extra_path, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _train(case: str, backend: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / f"{case}-{backend}"
    r = launch(
        [str(HERE / "train_worker.py"), case, backend, str(out)],
        _env(),
        tmp_path,
        reference=backend == "gloo",
        complete=lambda r: r.stdout.count(f"OK {case} rank") == 2,
    )
    assert r.stdout.count(f"OK {case} rank") == 2, r.stdout
    return [torch.load(out / f"rank{i}.pt") for i in range(2)]


def _same_on_both_ranks(res: list[dict]) -> None:
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b), "ranks' parameters differ after DDP training"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case,tol", [("bucketed", 1e-5), ("allreduce_hook", 1e-5), ("fp16_hook", 2e-3), ("no_sync", 1e-5)]
)
def test_ddp_matches_single_process_reference(case: str, tol: float, tmp_path: Path) -> None:
    """Parameters are identical on both ranks and match single-process SGD on both ranks' data."""
    res = _train(case, "procgroup", tmp_path)
    _same_on_both_ranks(res)
    for p, ref in zip(res[0]["params"], res[0]["reference"]):
        torch.testing.assert_close(p, ref, rtol=tol, atol=tol)


@pytest.mark.timeout(300)
def test_ddp_join_with_uneven_inputs(tmp_path: Path) -> None:
    """Rank 0 has 3 batches, rank 1 has 5: Join shadows the missing allreduces and both finish in sync."""
    res = _train("join", "procgroup", tmp_path)
    assert [int(r["n_batches"]) for r in res] == [3, 5]
    _same_on_both_ranks(res)


@pytest.mark.timeout(300)
def test_fsdp2_trains_two_steps(tmp_path: Path) -> None:
    """fully_shard on CPU: 2 SGD steps; the unsharded parameters match single-process SGD."""
    res = _train("fsdp2", "procgroup", tmp_path)
    assert res[0]["losses"].shape == (2,) and torch.isfinite(res[0]["losses"]).all()
    for r in res:
        for p, ref in zip(r["params"], r["reference"]):
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5)


def _autoload_dist_info(tmp_path: Path) -> Path:
    """A dist-info declaring procgroup's torch.backends entry point (what an installed procgroup provides)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = data["project"]["entry-points"]["torch.backends"]
    info = tmp_path / "site" / "procgroup_torch_hook-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: procgroup-torch-hook\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return info.parent


def _loads(path: Path) -> bool:
    """``path`` holds a whole torch.save file (rank 0 saved before gloo's abort at exit, if any)."""
    try:
        torch.load(path)
    except Exception:
        return False
    return True


@pytest.mark.timeout(300)
def test_unmodified_ddp_script_bitwise_equal_to_gloo(tmp_path: Path) -> None:
    """The same script with only backend="gloo" -> "procgroup": final parameters equal bit for bit at N=2."""
    original = (HERE / "unmodified_ddp.py").read_text()
    call = 'init_process_group(backend="gloo")'
    assert original.count(call) == 1
    changed = tmp_path / "ddp_procgroup.py"
    changed.write_text(original.replace(call, call.replace("gloo", "procgroup")))
    env = _env(str(_autoload_dist_info(tmp_path)))
    ref = tmp_path / "gloo.pt"
    launch([str(HERE / "unmodified_ddp.py"), str(ref)], env, tmp_path, reference=True, complete=lambda _: _loads(ref))
    launch([str(changed), str(tmp_path / "procgroup.pt")], env, tmp_path)
    gloo, pg = torch.load(tmp_path / "gloo.pt"), torch.load(tmp_path / "procgroup.pt")
    assert len(gloo) == len(pg) == 6
    for a, b in zip(gloo, pg):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))
