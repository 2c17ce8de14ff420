"""procgroup as a torch.distributed backend: ``torch.distributed.init_process_group("procgroup")``.

Two ways to register the backend name ``"procgroup"`` with torch:

* ``import procgroup.torch`` registers it (raises ImportError when torch is missing);
* ``import torch`` does it by itself when procgroup is installed: procgroup declares :func:`autoload` in torch's
  ``torch.backends`` entry-point group, which torch runs at the end of its own import unless
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.  That hook never raises (an error there would break ``import torch``
  for every program on the machine): it only records the factory, which imports the backend on first use,
  and logs a failure instead of raising.

Then ``init_process_group("procgroup")`` works with ``env://``, ``tcp://``, ``file://`` and ``store=``, and so
do ``new_group(..., backend="procgroup")`` and subgroups; ``"cpu:procgroup,cuda:nccl"`` carries CUDA tensors
through torch's NCCL.  See :mod:`procgroup.torch.backend` for what runs natively and what falls through.

Example (run with ``procgroup run --nproc-per-node 2 train.py`` or torchrun)::

    import torch.distributed as dist
    import procgroup.torch  # not needed once procgroup is installed: `import torch` registers it

    dist.init_process_group("procgroup")            # or "cpu:procgroup,cuda:nccl"
    model = torch.nn.parallel.DistributedDataParallel(model)

``init_process_group(..., pg_options=procgroup.torch.Options(device_backends={...}, fallback="gloo"))``
changes which torch backend carries other devices' tensors and what is not served natively.

Limitation: the hook registers only when torch.distributed is already loaded when torch runs it (true of
torch 2.13, which imports it earlier in its own ``__init__``); otherwise it logs and ``import procgroup.torch``
registers.

This package is the only part of procgroup that imports torch.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["BACKEND_NAME", "Options", "autoload", "is_registered", "register"]

logger = logging.getLogger("procgroup.torch")

#: the backend name torch knows procgroup by
BACKEND_NAME = "procgroup"

#: devices the backend accepts tensors of (CUDA tensors are carried by torch's NCCL underneath)
DEVICES = ["cpu", "cuda"]


def _factory(*args: Any) -> Any:
    """torch's creator function: imports the backend module on first use (see ``backend.create_backend``)."""
    from ._monitored import install
    from .backend import create_backend

    install()  # torch's monitored_barrier checks for the name "gloo": let procgroup groups through
    return create_backend(*args)


def _register_with(backend_cls: Any) -> None:
    if BACKEND_NAME.upper() in getattr(backend_cls, "_plugins", {}):
        return
    backend_cls.register_backend(BACKEND_NAME, _factory, extended_api=True, devices=list(DEVICES))


def is_registered() -> bool:
    """True when torch (already imported) knows the ``"procgroup"`` backend.  Never imports torch."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return c10d is not None and BACKEND_NAME.upper() in getattr(c10d.Backend, "_plugins", {})


def register() -> None:
    """Register ``"procgroup"`` with ``torch.distributed.Backend`` (idempotent).

    Raises ImportError when torch is not installed and RuntimeError when this torch build has no
    torch.distributed.
    """
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise ImportError(f"procgroup.torch needs torch: pip install torch ({e})") from e
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed, so procgroup cannot register as its backend")
    _register_with(dist.Backend)


def autoload() -> None:
    """torch's ``torch.backends`` entry point: register ``"procgroup"``; never raises.

    torch calls it from inside its own ``import torch``, after torch.distributed is loaded.  It imports
    nothing heavy (the backend module loads when the first group is created) and logs, rather than raises,
    any failure, so a broken procgroup can never break ``import torch``.
    """
    try:
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:
            torch_mod = sys.modules.get("torch")
            if torch_mod is None or _initializing(torch_mod):
                logger.info(
                    "procgroup.torch: torch.distributed is not loaded yet; `import procgroup.torch` "
                    "registers the backend later"
                )
                return
            import torch.distributed as dist

            if not dist.is_available():
                return
            c10d = sys.modules["torch.distributed.distributed_c10d"]
        _register_with(c10d.Backend)
        api = sys.modules.get("procgroup.api")
        if api is not None and api.is_initialized():  # torch imported after procgroup's init: share its store
            from ._store import share_store_with_torch

            share_store_with_torch(api.store_for_torch)
    except Exception as e:  # noqa: BLE001 - must never break `import torch`
        logger.warning(
            "procgroup.torch: could not register the 'procgroup' torch backend (%s: %s); "
            "`import procgroup.torch` retries and shows the full error",
            type(e).__name__,
            e,
        )


def _initializing(module: Any) -> bool:
    """True while ``module`` is still executing its own import (its spec is marked so by importlib)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def __getattr__(name: str) -> Any:
    if name == "Options":
        from .backend import Options

        return Options
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if _initializing(sys.modules.get("torch")):
    autoload()  # imported by torch's entry-point hook, inside `import torch`: never raise
else:
    register()
