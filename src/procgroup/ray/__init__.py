"""procgroup on Ray (the optional extra ``procgroup[ray]``).

Four ways in, each documented in ``docs/ray.md``:

* :func:`run` runs a function on N Ray actors with procgroup's API initialised (no Ray Train needed);
* :class:`ProcGroupConfig` is a backend config for Ray Train's ``DataParallelTrainer``: every worker has
  procgroup's API initialised before the train function runs (a numpy-only loop needs no torch);
* :func:`register_collective_backend` registers ``"procgroup"`` with ``ray.util.collective``
  (:class:`ProcGroupCollectiveGroup`), so actors call ``col.allreduce(x, group_name=...)`` over procgroup;
* ``TorchConfig(backend="procgroup")`` in ``TorchTrainer`` uses procgroup's torch backend; the workers must
  have registered it before torch's init (:func:`torch_worker_setup`).

Importing this package does not import ray (nor torch): ray is imported inside the functions that need it,
and ``procgroup`` itself never imports this package.
"""

from typing import Any as _Any

_LAZY = {
    "JobSpec": "_worker",
    "ProcGroupBackend": "_train",
    "ProcGroupCollectiveGroup": "_collective",
    "ProcGroupConfig": "_train",
    "RayRunError": "_run",
    "WorkerFailure": "_run",
    "register_collective_backend": "_collective",
    "run": "_run",
    "torch_worker_setup": "_train",
}


def __getattr__(name: str) -> _Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'procgroup.ray' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
