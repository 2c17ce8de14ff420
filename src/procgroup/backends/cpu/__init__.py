"""The built-in CPU backend ("cpu", alias "gloo"): shared memory within a host, TCP across hosts."""

from __future__ import annotations

from ...process_group import World
from ..base import Backend, WorldSpec, register
from .world import build_world

__all__ = ["CpuBackend", "build_world"]


class CpuBackend(Backend):
    """numpy arrays over procgroup's own transports; needs nothing beyond numpy, so it is always available."""

    names = ("cpu", "gloo")

    def create_world(self, spec: WorldSpec) -> World:
        """Rendezvous through ``spec.store``, then connect shm/TCP transports (see :func:`build_world`)."""
        return build_world(spec)


register(CpuBackend())
