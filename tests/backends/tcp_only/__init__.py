"""A test backend in one folder: the CPU backend with the TCP transport forced, even within a host.

Importing this package registers it as "tcp_only"; then ``init_process_group(backend="tcp_only")``
(or ``procgroup.backends.create_group("tcp_only", ...)``) forms its worlds.  It shows everything a new
backend needs: a :class:`~procgroup.backends.Backend` subclass with names, availability, an install hint
and ``create_world``, and one :func:`~procgroup.backends.register` call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from procgroup.backends import Backend, WorldSpec, register
from procgroup.backends.cpu import build_world
from procgroup.process_group import World

__all__ = ["TcpOnlyBackend", "NAME"]

NAME = "tcp_only"


class TcpOnlyBackend(Backend):
    """Every pair of ranks talks over TCP, whatever PROCGROUP_TRANSPORT says."""

    names = (NAME,)

    def unavailable_reason(self) -> Optional[str]:
        """Always available: it needs only what the CPU backend needs."""
        return None

    def install_hint(self) -> str:
        """Nothing to install."""
        return ""

    def create_world(self, spec: WorldSpec) -> World:
        """The CPU backend's world over the TCP transport; the world reports this backend's name."""
        tcp = dataclasses.replace(spec, config=dataclasses.replace(spec.config, transport="tcp"))
        world = build_world(tcp)
        world.backend = NAME
        return world


register(TcpOnlyBackend(), replace=True)
