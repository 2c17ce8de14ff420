"""Registry entries for backends that this build cannot run, so that asking for them says why and what to do."""

from __future__ import annotations

from typing import Optional, Tuple

from ..errors import ConfigError
from ..process_group import World
from .base import Backend, WorldSpec, register

__all__ = ["UnavailableBackend"]


class UnavailableBackend(Backend):
    """A known backend name whose implementation is missing here; :meth:`create_world` raises its reason."""

    def __init__(self, names: Tuple[str, ...], reason: str, hint: str = "") -> None:
        self.names = names
        self._reason = reason
        self._hint = hint

    def unavailable_reason(self) -> Optional[str]:
        """Why this backend cannot run here (always a sentence)."""
        return self._reason

    def install_hint(self) -> str:
        """What would make it available."""
        return self._hint

    def create_world(self, spec: WorldSpec) -> World:
        """Never forms a world: raises :class:`~procgroup.errors.ConfigError` with the reason."""
        raise ConfigError(self._reason)


register(
    UnavailableBackend(
        ("nccl",),
        "backend='nccl' needs CUDA devices and an NCCL binding, and procgroup's own API does not carry CUDA "
        "tensors yet: use backend='cpu' (or 'gloo') for CPU tensors, and for CUDA tensors torch.distributed with "
        "init_process_group('cpu:procgroup,cuda:nccl') (procgroup for CPU tensors, torch's NCCL for CUDA ones)",
        "for CUDA tensors: a CUDA build of torch (pip install torch), and torch.distributed with backend "
        "'cpu:procgroup,cuda:nccl'",
    )
)
