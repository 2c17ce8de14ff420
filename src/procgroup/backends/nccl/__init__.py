"""The nccl backend ("nccl"): procgroup's own API carries CUDA torch tensors through torch's NCCL.

``init_process_group(backend="nccl")`` forms the cpu backend's world (shared memory within a host, TCP
across, the store, the control plane, deadlines, watchdog) and sets ``World.engine`` to a
:class:`~.engine.TorchDeviceEngine`: a collective or point-to-point op whose tensor is a CUDA torch tensor
runs through torch's ``ProcessGroupNCCL``, built per procgroup group on its first CUDA operation over
procgroup's store; numpy arrays and CPU tensors keep procgroup's own algorithms (as torch's
``"cpu:gloo,cuda:nccl"``).  Before a group's first NCCL operation its members check that no two of them
drive the same GPU (:mod:`.devices`).  torch is imported only when such a world forms (or when this
backend's availability is asked).  Details: ``docs/nccl.md``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

from ...process_group import World
from ..base import Backend, WorldSpec, register

__all__ = ["NcclBackend", "INSTALL_HINT", "build_device_world"]

INSTALL_HINT = (
    "for CUDA tensors: a CUDA build of torch (pip install torch; torch.distributed.is_nccl_available() must be "
    "True) on a machine with NVIDIA GPUs, one per rank"
)
_PREFIX = "backend='nccl' needs CUDA devices and an NCCL binding (torch's)"
_CPU = "use backend='cpu' (or 'gloo') for numpy arrays and CPU tensors"


def build_device_world(
    spec: WorldSpec, device_type: str, kind: str, name: str, device_id: Optional[Callable[[Any], str]] = None
) -> World:
    """The cpu backend's world with a :class:`~.engine.TorchDeviceEngine` carrying ``device_type`` tensors
    through torch's ``kind`` backend; the world reports backend ``name``.  Collective (every rank calls it)."""
    from ..cpu import build_world
    from .engine import TorchDeviceEngine

    world = build_world(spec)
    world.backend = name
    engine = TorchDeviceEngine(world, spec.job_id, device_type, kind, device_id)
    world.engine = engine
    world.on_close.append(engine.close)  # runs before the transport's close (on_close runs in reverse)
    return world


class NcclBackend(Backend):
    """CUDA torch tensors through torch's NCCL, everything else as the cpu backend (see the module)."""

    names = ("nccl",)

    def __init__(self) -> None:
        self._reason: Optional[str] = None
        self._checked = False

    def unavailable_reason(self) -> Optional[str]:
        """None when torch with NCCL and a CUDA device are here, else why not (checked once; imports torch)."""
        if not self._checked:
            self._reason = self._why_not()
            self._checked = True
        return self._reason

    @staticmethod
    def _why_not() -> Optional[str]:
        if importlib.util.find_spec("torch") is None:
            return f"{_PREFIX}: torch is not installed; {_CPU}"
        try:
            import torch
            import torch.distributed as dist
        except Exception as e:  # noqa: BLE001 - a broken torch install is a reason, not a crash
            return f"{_PREFIX}: importing torch failed ({type(e).__name__}: {e}); {_CPU}"
        if not dist.is_available() or not dist.is_nccl_available():
            return f"{_PREFIX}: this torch build ({torch.__version__}) has no NCCL (a CPU-only build); {_CPU}"
        if torch.cuda.device_count() < 1:
            return (
                f"{_PREFIX}: torch {torch.__version__} sees no CUDA device here (check nvidia-smi and "
                f"CUDA_VISIBLE_DEVICES); {_CPU}"
            )
        return None

    def install_hint(self) -> str:
        """What to install for the nccl backend."""
        return INSTALL_HINT

    def create_world(self, spec: WorldSpec) -> World:
        """The cpu backend's world, with CUDA tensors through torch's NCCL (see the module)."""
        return build_device_world(spec, "cuda", "nccl", "nccl")


register(NcclBackend(), replace=True)
