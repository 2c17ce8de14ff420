"""Test backends: the nccl backend's delegation path on a machine without a GPU (torch's gloo on the CPU).

Importing this package registers two names:

* ``"torch_gloo"``: the world of ``backend="nccl"`` (:func:`procgroup.backends.nccl.build_device_world`) with
  the engine's (device type, torch backend) set to ("cpu", "gloo") and torch CPU tensors routed to that engine
  (:func:`procgroup.data.route_cpu_tensors`), so every call with a torch tensor runs the very code a CUDA
  tensor runs under ``backend="nccl"``: the engine's per-group torch group over procgroup's store, the
  device check, the polling wait with its deadline, probes and abort, the copies back.  numpy arrays keep
  procgroup's own path, as they do under ``backend="nccl"``.
* ``"torch_gloo_onedev"``: the same, but every rank reports the same device, so the one-device-per-rank check
  fires (what two ranks on one GPU get from ``backend="nccl"``).

Where gloo differs from NCCL: its group's constructor connects every pair (NCCL's forms communicators on first
use), so a group's first torch-tensor call must be one all members make (a collective; the tests' are); its
send, receive and reduce_scatter works complete only inside ``wait()`` (the engine waits for them in a thread).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from procgroup.backends import Backend, WorldSpec, register
from procgroup.process_group import World

__all__ = ["TorchGlooBackend", "NAME", "ONE_DEVICE"]

NAME = "torch_gloo"
ONE_DEVICE = "torch_gloo_onedev"


class TorchGlooBackend(Backend):
    """The nccl backend's engine with ("cpu", "gloo"): CPU torch tensors through torch's gloo."""

    def __init__(self, name: str, one_device: bool) -> None:
        self.names = (name,)
        self.one_device = one_device

    def unavailable_reason(self) -> Optional[str]:
        """Needs torch (any build: gloo is in the CPU one)."""
        if importlib.util.find_spec("torch") is None:
            return f"backend={self.names[0]!r} needs torch, which is not installed"
        return None

    def install_hint(self) -> str:
        """What to install."""
        return "pip install torch"

    def create_world(self, spec: WorldSpec) -> World:
        """The device world with the CPU stand-in engine; torch CPU tensors are routed to it in this process."""
        from procgroup import data
        from procgroup.backends.nccl import build_device_world

        data.route_cpu_tensors(True)
        if self.one_device:
            return build_device_world(spec, "cpu", "gloo", self.names[0], lambda dev: "cpu-shared")
        return build_device_world(spec, "cpu", "gloo", self.names[0], lambda dev: f"cpu-pid{os.getpid()}")


register(TorchGlooBackend(NAME, False), replace=True)
register(TorchGlooBackend(ONE_DEVICE, True), replace=True)
