"""procgroup on a local Ray cluster: run(), DataParallelTrainer, TorchTrainer, ray.util.collective, failures.

One Ray cluster (``ray.init(num_cpus=4)``, logical CPUs) serves the whole module and is shut down at its end.
Skipped where ray is not installed (``pip install "procgroup[ray]"``, i.e. ``ray[train]>=2.60``).  Run with
``PYTHONPATH=$PWD/src python -m pytest -q tests/ray``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'procgroup[ray]' to run these tests")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module (workers inherit PYTHONPATH, so they import this tree's procgroup)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _sum_of_ranks(n: int) -> list:
    import procgroup as dist

    x = np.full(n, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    return [dist.get_rank(), dist.get_world_size(), x.tolist()]


@pytest.mark.timeout(120)
def test_run_all_reduce_numpy(cluster):
    from procgroup.ray import run

    out = run(_sum_of_ranks, 2, args=(5,), timeout=60)
    assert out == [[0, 2, [3.0] * 5], [1, 2, [3.0] * 5]]


def _rank1_raises() -> None:
    import procgroup as dist
    from procgroup.errors import PeerFailureError

    if dist.get_rank() == 1:
        time.sleep(0.2)
        raise ValueError("boom on purpose")
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(4))
    except PeerFailureError as e:
        raise PeerFailureError(f"after {time.monotonic() - t0:.3f}s: {e}", peer=e.peer) from e


@pytest.mark.timeout(120)
def test_run_worker_raises_peers_name_it_within_5s(cluster):
    from procgroup.ray import RayRunError, run

    with pytest.raises(RayRunError) as ei:
        run(_rank1_raises, 2, timeout=120)  # a deadline far beyond the 5 s the peers may take
    err = ei.value
    assert err.rank == 1
    assert "ValueError: boom on purpose" in str(err) and "### Worker 1 of 2" in str(err)
    peer = err.failures[0]
    assert peer.rank == 0 and peer.kind == "PeerFailureError", err.failures
    assert "rank 1" in peer.message, peer.message
    assert float(peer.message.split("after ", 1)[1].split("s:", 1)[0]) < 5.0, peer.message


def _numpy_loop(config: dict) -> None:
    import sys

    import ray.train

    import procgroup as dist

    assert dist.is_initialized() and dist.get_world_size() == 2
    w = np.zeros(3)
    for step in range(config["steps"]):
        grad = np.full(3, float(dist.get_rank() + 1) * (step + 1))
        dist.all_reduce(grad)
        w -= 0.1 * grad / dist.get_world_size()
    everyone = [np.zeros(3) for _ in range(2)]
    dist.all_gather(everyone, w)
    assert np.array_equal(everyone[0], everyone[1])
    assert "torch" not in sys.modules, "a numpy-only loop imported torch"
    ray.train.report({"w0": float(w[0])})


@pytest.mark.timeout(240)
def test_data_parallel_trainer_numpy_only(cluster):
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from procgroup.ray import ProcGroupConfig

    trainer = DataParallelTrainer(
        _numpy_loop,
        train_loop_config={"steps": 4},
        backend_config=ProcGroupConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2),
    )
    result = trainer.fit()
    assert result.error is None


def _ddp_loop(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as tdist
    from ray.train.torch import prepare_model

    assert tdist.get_backend() == "procgroup"
    torch.manual_seed(tdist.get_rank())  # different initial weights: DDP's broadcast must make them equal
    model = prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(config["steps"]):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(tdist.get_world_size())]
    tdist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], p) for p in everyone), everyone
    ray.train.report({"backend": tdist.get_backend()})


def _entry_point_dir(root) -> str:
    """A folder holding only the metadata of procgroup's ``torch.backends`` entry point, as pip installs it.

    This tree is not pip-installed; on the workers' path, this folder makes ``import torch`` register the
    backend exactly as it does for an installed procgroup (torch's backend autoload).
    """
    info = root / "procgroup_torch_backend-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: procgroup-torch-backend\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nprocgroup = procgroup.torch:autoload\n")
    return str(root)


@pytest.mark.timeout(240)
def test_torch_trainer_ddp_over_procgroup_backend(cluster, tmp_path):
    pytest.importorskip("torch", reason="torch is not installed")
    import os

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    path = os.pathsep.join(p for p in (_entry_point_dir(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    trainer = TorchTrainer(
        _ddp_loop,
        train_loop_config={"steps": 3},
        torch_config=TorchConfig(backend="procgroup"),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(worker_runtime_env={"env_vars": {"PYTHONPATH": path}}),
    )
    result = trainer.fit()
    assert result.error is None


@ray.remote(num_cpus=1)
class _Member:
    def __init__(self, rank: int) -> None:
        from procgroup.ray import register_collective_backend

        register_collective_backend()
        self.rank = rank

    def join(self, group: str) -> None:
        import ray.util.collective as col

        col.init_collective_group(2, self.rank, backend="procgroup", group_name=group)

    def collectives(self, group: str, kind: str) -> dict:
        import ray.util.collective as col

        if kind == "torch":
            import torch

            def make(values):
                return torch.tensor(values, dtype=torch.float32)

            def out(t):
                return t.tolist()
        else:

            def make(values):
                return np.array(values, dtype=np.float32)

            def out(t):
                return t.tolist()

        r = self.rank
        s = make([r + 1.0] * 3)
        col.allreduce(s, group_name=group)
        m = make([r + 1.0] * 3)
        col.allreduce(m, group_name=group, op=col.types.ReduceOp.MAX)
        b = make([10.0 * (r + 1)] * 2)
        col.broadcast(b, src_rank=1, group_name=group)
        g = [make([0.0, 0.0]), make([0.0, 0.0])]
        col.allgather(g, make([float(r), float(r)]), group_name=group)
        col.barrier(group_name=group)
        return {"sum": out(s), "max": out(m), "bcast": out(b), "gather": [out(t) for t in g]}

    def leave(self, group: str) -> None:
        import ray.util.collective as col

        col.destroy_collective_group(group)


@pytest.mark.timeout(180)
def test_ray_util_collective_backend(cluster):
    from procgroup.ray import register_collective_backend

    register_collective_backend()
    register_collective_backend()  # idempotent
    members = [_Member.remote(r) for r in range(2)]
    try:
        ray.get([m.join.remote("pg") for m in members], timeout=120)
        want = {"sum": [3.0] * 3, "max": [2.0] * 3, "bcast": [20.0, 20.0], "gather": [[0.0, 0.0], [1.0, 1.0]]}
        for kind in ("numpy", "torch"):
            assert ray.get([m.collectives.remote("pg", kind) for m in members], timeout=60) == [want, want]
        ray.get([m.leave.remote("pg") for m in members], timeout=60)
    finally:
        for m in members:
            ray.kill(m)
