"""Barrier: dissemination (Hensgen, Finkel & Manber), ceil(log2 p) rounds of zero-byte messages."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._util import P_BARRIER, step

__all__ = ["barrier_dissemination"]


def barrier_dissemination(comm: Any) -> None:
    """Round k: signal rank r + 2^k, wait for rank r - 2^k.  Works for every size."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    rnd = 0
    dist = 1
    while dist < p:
        # a fresh zero-length receive buffer per round (shared ones would be harmless too)
        comm.sendrecv((r + dist) % p, b"", (r - dist) % p, np.empty(0, dtype=np.uint8), step(P_BARRIER, rnd))
        dist <<= 1
        rnd += 1
