"""Registration of the "procgroup" torch backend: ``import procgroup.torch`` and torch's entry-point autoload."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import inspect
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import procgroup.torch as pgt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def test_import_registers_the_backend_for_cpu_and_cuda() -> None:
    """``import procgroup.torch`` makes "procgroup" a torch backend name, for CPU and CUDA tensors."""
    assert pgt.is_registered()
    assert "procgroup" in dist.Backend.backend_list
    plugin = dist.Backend._plugins["PROCGROUP"]
    assert plugin.extended_api is True
    assert dist.Backend.backend_capability["procgroup"] == ["cpu", "cuda"]
    cfg = dist.distributed_c10d.BackendConfig(dist.Backend("procgroup"))
    assert cfg.get_device_backend_map() == {"cpu": "procgroup", "cuda": "procgroup"}
    mixed = dist.distributed_c10d.BackendConfig(dist.Backend("cpu:procgroup,cuda:nccl"))
    assert mixed.get_device_backend_map() == {"cpu": "procgroup", "cuda": "nccl"}
    # registering did not take over torch's defaults for either device
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_register_is_idempotent() -> None:
    """A second ``register()`` changes nothing."""
    before = dist.Backend._plugins["PROCGROUP"]
    pgt.register()
    assert dist.Backend._plugins["PROCGROUP"] is before


def test_autoload_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry-point hook registers the backend when torch.distributed is loaded."""
    plugins = dict(dist.Backend._plugins)
    plugins.pop("PROCGROUP")
    monkeypatch.setattr(dist.Backend, "_plugins", plugins)
    assert not pgt.is_registered()
    pgt.autoload()
    assert pgt.is_registered()


def test_autoload_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A failure inside the hook is logged, not raised (it runs inside every `import torch`)."""

    def broken(_cls: object) -> None:
        raise RuntimeError("simulated registration failure")

    monkeypatch.setattr(pgt, "_register_with", broken)
    with caplog.at_level(logging.WARNING, logger="procgroup.torch"):
        assert pgt.autoload() is None
    assert any("simulated registration failure" in r.getMessage() for r in caplog.records)


def test_autoload_while_torch_is_still_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called before torch.distributed exists, inside torch's own import: returns quietly, imports nothing."""
    fake = types.ModuleType("torch")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    fake.__spec__._initializing = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.delitem(sys.modules, "torch.distributed.distributed_c10d")
    assert pgt.autoload() is None


def test_entry_point_declaration_names_the_hook() -> None:
    """pyproject declares the hook in the entry-point group torch reads, and it names an importable function."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = data["project"]["entry-points"]["torch.backends"]
    assert eps == {"procgroup": "procgroup.torch:autoload"}
    assert '"torch.backends"' in inspect.getsource(torch._import_device_backends)
    ep = importlib.metadata.EntryPoint(name="procgroup", value=eps["procgroup"], group="torch.backends")
    assert ep.load() is pgt.autoload


def _dist_info(tmp_path: Path) -> Path:
    """A distribution on a temporary path that declares the same entry point (an editable install's stand-in)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    info = tmp_path / "procgroup_torch_hook-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: procgroup-torch-hook\nVersion: 0.0\n")
    lines = [f"{k} = {v}" for k, v in data["project"]["entry-points"]["torch.backends"].items()]
    (info / "entry_points.txt").write_text("[torch.backends]\n" + "\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("autoload", ["1", "0"])
def test_import_torch_registers_through_the_entry_point(tmp_path: Path, autoload: str) -> None:
    """`import torch` alone registers the backend (lazily: the backend module is not imported) unless disabled."""
    path = _dist_info(tmp_path)
    code = (
        "import sys, torch\n"
        "from torch.distributed import Backend\n"
        "print('registered' if 'PROCGROUP' in Backend._plugins else 'absent')\n"
        "print('backend-module-loaded' if 'procgroup.torch.backend' in sys.modules else 'lazy')\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(path), str(ROOT / "src")]), TORCH_DEVICE_BACKEND_AUTOLOAD=autoload
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["registered", "lazy"] if autoload == "1" else ["absent", "lazy"]), out


@pytest.mark.timeout(120)
def test_import_procgroup_torch_before_torch_with_the_hook_installed(tmp_path: Path) -> None:
    """`import procgroup.torch` first: torch's hook then runs inside it, on the half-imported module; both work."""
    path = _dist_info(tmp_path)
    code = (
        "import procgroup.torch as p, torch.distributed as d\n"
        "print('registered' if 'PROCGROUP' in d.Backend._plugins and p.is_registered() else 'absent')\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(path), str(ROOT / "src")]), TORCH_DEVICE_BACKEND_AUTOLOAD="1"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["registered"], out
    assert "could not register" not in out.stderr, out.stderr
