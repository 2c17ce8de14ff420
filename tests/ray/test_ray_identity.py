"""Issue 16 item 1: a bare ``procgroup.init_process_group()`` inside a Ray TorchTrainer worker works within 1 s.

Ray Train has already started torch's group (and its store on MASTER_PORT) in the worker, so procgroup reuses that
store through the adapter instead of colliding with it; the job id comes from MASTER_ADDR:MASTER_PORT, not 'default'.
"""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'procgroup[ray]' to run these tests")
pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module, shut down at its end."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _bare_init_loop(config: dict) -> None:
    import time

    import torch
    from ray import train

    import procgroup as dist

    t0 = time.monotonic()
    dist.init_process_group()
    took = time.monotonic() - t0
    try:
        x = np.full(3, dist.get_rank() + 1.0)
        dist.all_reduce(x)
        t = torch.full((2,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        # checked in the worker: a failure makes fit() raise TrainingFailedError naming it
        assert dist.get_world_size() == 2, dist.get_world_size()
        assert x.tolist() == [3.0, 3.0, 3.0] and t.tolist() == [3.0, 3.0], (x, t)
        from procgroup.identity import detect_identity

        assert detect_identity().source == "ray", detect_identity()
        from procgroup.state import _state

        # torch's store, reused: no store of procgroup's own (no second port) and no wait for one to time out (the
        # wall time is loose: the suite runs beside other tests; alone it takes well under a second)
        assert _state.store_server is None, "procgroup hosted a store of its own inside a TorchTrainer worker"
        assert took < 10.0, f"init_process_group took {took:.2f}s inside a TorchTrainer worker"
        train.report({"took": took})
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_bare_init_inside_torch_trainer(cluster) -> None:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    result = TorchTrainer(_bare_init_loop, scaling_config=ScalingConfig(num_workers=2)).fit()
    assert result.error is None
