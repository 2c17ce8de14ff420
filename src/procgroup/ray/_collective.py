"""A ``ray.util.collective`` backend named ``"procgroup"``: Ray actors' collectives over procgroup's transports.

Register it in the driver and in every actor (Ray's registry is per process), then use Ray's API::

    import ray.util.collective as col
    from procgroup.ray import register_collective_backend

    register_collective_backend()                       # in the driver and in each actor
    col.init_collective_group(2, rank, backend="procgroup", group_name="g")   # in each actor
    col.allreduce(x, group_name="g")                    # numpy arrays or torch CPU tensors, in place

Rendezvous: rank 0 picks its node address and a free port, makes a fresh run id and a random secret, and
publishes them in Ray's internal key-value store (GCS) under ``procgroup_collective_<group_name>``; the other
ranks read them there (within the group's timeout) and every rank forms procgroup's default group; rank 0
deletes the key once all have joined.  Limitation: procgroup has one default group per process, so an actor
can be in one ``procgroup`` collective group at a time (destroy it before creating another).
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional

from ..errors import ConfigError, RendezvousTimeoutError
from . import _worker

__all__ = ["BACKEND_NAME", "ProcGroupCollectiveGroup", "register_collective_backend"]

#: the name ``ray.util.collective`` knows this backend by (its registry upper-cases names)
BACKEND_NAME = "procgroup"
#: default deadline (seconds) of the rendezvous and of each call without a ``timeout_ms``
DEFAULT_TIMEOUT = 300.0


def _kv_key(group_name: str) -> str:
    return f"procgroup_collective_{group_name}"


def _base_group() -> Any:
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    return BaseGroup


def _op(ray_op: Any) -> Any:
    """Ray's ReduceOp as procgroup's (SUM, PRODUCT, MIN, MAX)."""
    import procgroup as dist

    return {
        "SUM": dist.ReduceOp.SUM,
        "PRODUCT": dist.ReduceOp.PRODUCT,
        "MIN": dist.ReduceOp.MIN,
        "MAX": dist.ReduceOp.MAX,
    }[ray_op.name]


def _seconds(options: Any) -> Optional[float]:
    """The options' ``timeout_ms`` in seconds, None when unset (procgroup's default deadline then)."""
    t = getattr(options, "timeout_ms", None)
    if t is None:
        return None
    ms = t.total_seconds() * 1000 if hasattr(t, "total_seconds") else float(t)
    return ms / 1000.0 if ms > 0 else None


def _one(tensors: List[Any], what: str) -> Any:
    """Ray wraps a tensor argument in a one-element list; unwrap it."""
    if not isinstance(tensors, list) or len(tensors) != 1:
        raise ConfigError(f"{what}: the procgroup backend takes one tensor per process (no multi-GPU lists)")
    return tensors[0]


class ProcGroupCollectiveGroup(_base_group()):  # type: ignore[misc]
    """One ``ray.util.collective`` group over procgroup (made by Ray's group manager, not by users).

    Tensors: numpy arrays and torch CPU tensors (anything procgroup's collectives take), written in place.
    Each call's deadline is its options' ``timeout_ms`` if set, else the group's (300 s).  Errors are
    procgroup's (PeerFailureError naming a failed rank, DistTimeoutError, CollectiveMismatchError ...).
    """

    def __init__(self, world_size: int, rank: int, group_name: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(world_size, rank, group_name)
        import procgroup as dist

        if dist.is_initialized():
            raise ConfigError(
                f"ray.util.collective group {group_name!r}: this process already has a procgroup group (one "
                "procgroup collective group per actor, or procgroup initialised otherwise): destroy it first "
                "(col.destroy_collective_group(name))"
            )
        spec = self._rendezvous(group_name, rank, world_size, timeout)
        _worker.join(spec, rank)
        if rank == 0:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(_kv_key(group_name))  # every rank has read it: init is collective

    @staticmethod
    def _rendezvous(group_name: str, rank: int, world_size: int, timeout: float) -> _worker.JobSpec:
        """Rank 0 publishes the job (address, port, run id, secret) in Ray's KV store; the others read it."""
        from ray.experimental import internal_kv

        key = _kv_key(group_name)
        if rank == 0:
            addr, port = _worker.free_address()
            spec = _worker.new_job(addr, port, world_size, timeout)
            internal_kv._internal_kv_put(key, json.dumps(spec.__dict__), overwrite=True)
            return spec
        t_end = time.monotonic() + timeout
        pause = 0.005
        while True:
            raw = internal_kv._internal_kv_get(key)
            if raw is not None:
                return _worker.JobSpec(**json.loads(raw))
            if time.monotonic() > t_end:
                raise RendezvousTimeoutError(
                    f"ray.util.collective group {group_name!r}: rank 0 did not publish the procgroup job within "
                    f"{timeout:.0f} s (key {key!r}); check that rank 0 called init_collective_group"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    @classmethod
    def backend(cls) -> str:
        """The backend's name in Ray's registry."""
        return BACKEND_NAME.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Always available (procgroup needs only numpy)."""
        return True

    def destroy_group(self) -> None:
        """Destroy procgroup's group in this process."""
        _worker.leave()

    def allreduce(self, tensor: List[Any], allreduce_options: Any = None) -> None:
        """In-place all-reduce of ``tensor[0]`` with ``allreduce_options.reduceOp`` (default SUM)."""
        from ray.util.collective.types import AllReduceOptions

        import procgroup as dist

        o = allreduce_options or AllReduceOptions()
        dist.all_reduce(_one(tensor, "allreduce"), op=_op(o.reduceOp), timeout=_seconds(o))

    def barrier(self, barrier_options: Any = None) -> None:
        """Wait until every rank has called barrier."""
        import procgroup as dist

        dist.barrier(timeout=_seconds(barrier_options))

    def reduce(self, tensor: List[Any], reduce_options: Any = None) -> None:
        """Reduce ``tensor[0]`` into the root rank's tensor; other ranks' tensors are left unchanged."""
        import numpy as np
        from ray.util.collective.types import ReduceOptions

        import procgroup as dist

        o = reduce_options or ReduceOptions()
        t = _one(tensor, "reduce")
        if self.rank != o.root_rank:  # procgroup, like torch, may use non-root buffers as scratch
            t = t.clone() if hasattr(t, "clone") else np.array(t, copy=True)
        dist.reduce(t, dst=o.root_rank, op=_op(o.reduceOp), timeout=_seconds(o))

    def allgather(self, tensor_list: List[List[Any]], tensor: List[Any], allgather_options: Any = None) -> None:
        """Gather every rank's ``tensor[0]`` into ``tensor_list[0]`` (one tensor per rank, in rank order)."""
        import procgroup as dist

        dist.all_gather(_one(tensor_list, "allgather"), _one(tensor, "allgather"), timeout=_seconds(allgather_options))

    def broadcast(self, tensor: List[Any], broadcast_options: Any = None) -> None:
        """Broadcast the root rank's ``tensor[0]`` into every rank's, in place."""
        from ray.util.collective.types import BroadcastOptions

        import procgroup as dist

        o = broadcast_options or BroadcastOptions()
        dist.broadcast(_one(tensor, "broadcast"), src=o.root_rank, timeout=_seconds(o))

    def reducescatter(self, tensor: List[Any], tensor_list: List[List[Any]], reducescatter_options: Any = None) -> None:
        """Reduce ``tensor_list[0]`` (one tensor per rank) across ranks; this rank's slot lands in ``tensor[0]``."""
        from ray.util.collective.types import ReduceScatterOptions

        import procgroup as dist

        o = reducescatter_options or ReduceScatterOptions()
        dist.reduce_scatter(
            _one(tensor, "reducescatter"), _one(tensor_list, "reducescatter"), op=_op(o.reduceOp), timeout=_seconds(o)
        )

    def send(self, tensor: List[Any], send_options: Any) -> None:
        """Send ``tensor[0]`` to ``send_options.dst_rank``."""
        import procgroup as dist

        dist.send(_one(tensor, "send"), dst=send_options.dst_rank)

    def recv(self, tensor: List[Any], recv_options: Any) -> None:
        """Receive into ``tensor[0]`` from ``recv_options.src_rank``."""
        import procgroup as dist

        dist.recv(_one(tensor, "recv"), src=recv_options.src_rank)


def register_collective_backend() -> None:
    """Register ``"procgroup"`` with ``ray.util.collective`` in this process (idempotent).

    Call it in the driver and in every actor before creating a group with ``backend="procgroup"``.
    Raises ImportError when ray is not installed.
    """
    from ray.util.collective.backend_registry import _global_registry
    from ray.util.collective.backend_registry import register_collective_backend as _register

    if not _global_registry.is_registered(BACKEND_NAME):
        _register(BACKEND_NAME, ProcGroupCollectiveGroup)
