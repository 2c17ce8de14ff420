"""Reduce-scatter: sendbuf holds p blocks of n elements; rank r gets block r reduced over all ranks.

* :func:`reduce_scatter_ring` -- ring with partial sums in two block-sized
  scratch buffers (large: each rank sends (p-1) n elements, no copy of sendbuf).
* :func:`reduce_scatter_allreduce` -- recursive-doubling all-reduce of a
  scratch copy, keep block r (small: ceil(log2 p) + 2 rounds instead of p - 1).

``sendbuf`` is never modified.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from ._util import SLOT_WORK, scratch_as
from .allreduce import allreduce_recursive_doubling
from .reduction import ring_reduce_scatter_into

__all__ = ["reduce_scatter_ring", "reduce_scatter_allreduce"]

Kernel = Callable[[np.ndarray, np.ndarray], None]


def _check(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> int:
    n = recvbuf.shape[0]
    if sendbuf.shape[0] != comm.size * n:
        raise ConfigError(
            f"reduce_scatter: sendbuf has {sendbuf.shape[0]} elements, needs group size x len(recvbuf) = "
            f"{comm.size} x {n} = {comm.size * n}"
        )
    if sendbuf.dtype != recvbuf.dtype:
        raise ConfigError(f"reduce_scatter: sendbuf is {sendbuf.dtype} but recvbuf is {recvbuf.dtype}")
    return n


def reduce_scatter_ring(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Kernel) -> None:
    n = _check(comm, sendbuf, recvbuf)
    ring_reduce_scatter_into(comm, sendbuf, [i * n for i in range(comm.size + 1)], recvbuf, reduce)


def reduce_scatter_allreduce(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Kernel) -> None:
    n = _check(comm, sendbuf, recvbuf)
    r = comm.rank
    if comm.size == 1 or n == 0:
        np.copyto(recvbuf, sendbuf[r * n : (r + 1) * n])
        return
    work = scratch_as(comm, sendbuf.shape[0], sendbuf.dtype, SLOT_WORK)
    np.copyto(work, sendbuf)
    allreduce_recursive_doubling(comm, work, reduce)
    np.copyto(recvbuf, work[r * n : (r + 1) * n])
