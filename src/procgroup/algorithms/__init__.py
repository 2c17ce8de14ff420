"""Collective algorithms, written only against :class:`~procgroup.algorithms.comm.Comm`.

The entry points (``broadcast``, ``all_reduce``, ``reduce``, ``all_gather``,
``all_gatherv``, ``gather``, ``scatter``, ``reduce_scatter``, ``all_to_all``,
``barrier``) choose an algorithm by message and group size; the thresholds
and the selection table are in :mod:`procgroup.algorithms.select`.  Every
buffer is a 1-D C-contiguous numpy array; reductions take the in-place kernel
of :func:`procgroup.ops.reducer`.
"""

from .comm import Comm, ScratchPool
from .select import (
    all_gather,
    all_gatherv,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)

__all__ = [
    "Comm",
    "ScratchPool",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gatherv",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
]
