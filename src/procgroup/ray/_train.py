"""Ray Train: a backend config that gives every worker procgroup's own API, and the torch backend's setup.

``ProcGroupConfig`` is a Ray Train ``BackendConfig``: pass it to ``DataParallelTrainer(backend_config=...)``.
Before the train function runs, every worker has joined one procgroup job (worker 0's node address and a free
port there, a fresh run id, a random per-job secret): ``procgroup.all_reduce`` and the rest work with numpy
data, and no worker imports torch.  At shutdown every worker destroys its group.

Failure semantics: the train function runs inside the config's ``train_func_context``; when it raises on one
worker, that worker records the failure in the job's store, and the other workers' procgroup calls fail
within about a second with a PeerFailureError naming its rank (procgroup's watchdog) instead of waiting for
their deadline.  Ray Train then reports the failure as usual (``WorkerGroupError`` / ``TrainingFailedError``).

``torch_worker_setup`` registers procgroup's torch backend in a worker process; it is meant for Ray's
``worker_process_setup_hook`` so that ``TorchConfig(backend="procgroup")`` finds the backend (see docs/ray.md).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Type

from . import _worker

__all__ = ["ProcGroupConfig", "ProcGroupBackend", "torch_worker_setup"]

logger = logging.getLogger("procgroup.ray")

#: seconds on_shutdown waits for the workers to leave the group
_SHUTDOWN_TIMEOUT = 30.0


def _backend_config_base() -> Type[Any]:
    from ray.train.backend import BackendConfig

    return BackendConfig


def _backend_base() -> Type[Any]:
    from ray.train.backend import Backend

    return Backend


@contextlib.contextmanager
def _train_func_context() -> Iterator[None]:
    """Wraps the train function in each worker: a raise is recorded for the peers before it propagates."""
    try:
        yield
    except BaseException as e:
        import procgroup as dist

        if dist.is_initialized():
            _worker.record_failure(dist.get_rank(), e)
        raise


class ProcGroupBackend(_backend_base()):  # type: ignore[misc]
    """The Ray Train ``Backend`` of :class:`ProcGroupConfig` (Ray makes it; users do not)."""

    def on_start(self, worker_group: Any, backend_config: "ProcGroupConfig") -> None:
        """Form one procgroup job over the worker group (rank = the worker's index in the group).

        Raises what ``procgroup.init_process_group`` raises on a worker (e.g. RendezvousTimeoutError after
        ``backend_config.timeout_s``), as Ray delivers it.
        """
        import ray

        addr, port = worker_group.execute_single(0, _worker.free_address)
        spec = _worker.new_job(addr, port, len(worker_group), backend_config.timeout_s)
        ray.get([worker_group.execute_single_async(i, _worker.join, spec, i) for i in range(len(worker_group))])

    def on_training_start(self, worker_group: Any, backend_config: "ProcGroupConfig") -> None:
        """Nothing to do: the group formed in on_start."""

    def on_shutdown(self, worker_group: Any, backend_config: "ProcGroupConfig") -> None:
        """Every worker destroys its group; gives up (logging) after 30 s."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(worker_group.execute_async(_worker.leave), timeout=_SHUTDOWN_TIMEOUT)
        except GetTimeoutError:
            logger.warning("procgroup: the workers did not leave the group within %.0f s", _SHUTDOWN_TIMEOUT)


@dataclass
class ProcGroupConfig(_backend_config_base()):  # type: ignore[misc]
    """Ray Train backend config: procgroup's own API on every worker of a ``DataParallelTrainer``.

    ``timeout_s``: procgroup's deadline in seconds (forming the group, and every call's default).
    """

    timeout_s: float = 300.0

    @property
    def backend_cls(self) -> Type[Any]:
        """The Backend class Ray Train instantiates: :class:`ProcGroupBackend`."""
        return ProcGroupBackend

    @property
    def train_func_context(self) -> Any:
        """Context manager around the train function in each worker (records a failure for the peers)."""
        return _train_func_context

    def to_dict(self) -> dict:
        """The serialisable fields (for Ray's state export)."""
        return {"timeout_s": self.timeout_s}


def torch_worker_setup() -> None:
    """Register procgroup's torch.distributed backend in this worker process (``import procgroup.torch``).

    For Ray's ``worker_process_setup_hook``, so that ``TorchConfig(backend="procgroup")`` finds the backend
    before Ray Train calls torch's ``init_process_group``.  Not needed where procgroup is pip-installed and
    torch's backend autoload is on (``import torch`` then registers it through procgroup's entry point).
    Raises ImportError when torch is missing.
    """
    import procgroup.torch  # noqa: F401 - registers the backend "procgroup"
