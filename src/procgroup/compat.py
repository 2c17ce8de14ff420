"""Small top-level names of torch.distributed that procgroup lacked, with torch's semantics and no torch.

``default_pg_timeout``, ``get_node_local_rank``, ``get_pg_count``, ``is_backend_available``,
``is_ucc_available``, ``is_xccl_available``, ``supports_complex`` and ``get_default_backend_for_device``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from .errors import ConfigError

__all__ = [
    "default_pg_timeout",
    "get_default_backend_for_device",
    "get_node_local_rank",
    "get_pg_count",
    "is_backend_available",
    "is_ucc_available",
    "is_xccl_available",
    "supports_complex",
]

#: torch.distributed's default collective timeout (30 minutes); procgroup's own default is PROCGROUP_TIMEOUT
default_pg_timeout = timedelta(minutes=30)


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """This process's rank on its host, from the launcher's environment (torchrun's LOCAL_RANK, Slurm, MPI...).

    Works before ``init_process_group``, like torch's.  Returns ``fallback_rank`` when no launcher is
    recognised; raises RuntimeError then if no fallback was given (set LOCAL_RANK or pass fallback_rank=).
    """
    from .identity import detect_identity

    try:
        return detect_identity().local_rank
    except ConfigError as e:
        if fallback_rank is not None:
            return int(fallback_rank)
        raise RuntimeError(
            f"get_node_local_rank: no launcher identity found ({e}); set LOCAL_RANK or pass fallback_rank="
        ) from None


def get_pg_count() -> int:
    """Number of process groups created in this process and not destroyed (0 before init)."""
    from .state import _state

    return len(_state.groups)


def is_backend_available(backend: str) -> bool:
    """True when ``backend`` names a procgroup backend that can be used here (e.g. 'cpu', 'gloo', 'mpi')."""
    from .backends import base

    try:
        base.lookup(str(backend).lower())
    except ConfigError:
        return False
    return True


def is_ucc_available() -> bool:
    """False: procgroup has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: procgroup has no XCCL backend."""
    return False


def supports_complex(reduce_op: Any) -> bool:
    """True when ``reduce_op`` is defined on complex numbers (not MIN, MAX, BAND, BOR, BXOR), as in torch."""
    from .ops import ReduceOp

    return ReduceOp.coerce(reduce_op) not in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def get_default_backend_for_device(device: Any) -> str:
    """'gloo' for 'cpu' (procgroup's cpu backend answers to it), 'nccl' for 'cuda'; ValueError otherwise."""
    kind = str(getattr(device, "type", device)).split(":")[0].lower()
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"no default backend for device {device!r}: use 'cpu' or 'cuda'")
