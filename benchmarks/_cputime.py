"""The timing loop of the per-layer overhead scripts (overhead_cpu.py, overhead_mpi.py, results/mpi/layers.py).

:func:`per_call_us` times ``f`` over ``runs`` runs of ``calls`` calls and returns one number in microseconds
per call: by default CPU time of this thread and the best run (what the layer costs in Python, robust to other
users' load); the wall-clock scripts pass ``clock=time.perf_counter`` and ``pick=statistics.median``, and a
``before`` hook (an MPI barrier, so that the ranks start each run together).  :func:`print_layers` prints one
line per layer.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence, Tuple

__all__ = ["per_call_us", "print_layers"]


def per_call_us(
    f: Callable[[], object],
    calls: int = 20000,
    runs: int = 7,
    clock: Callable[[], float] = time.thread_time,
    pick: Callable[[Sequence[float]], float] = min,
    before: Optional[Callable[[], object]] = None,
) -> float:
    """Microseconds per call of ``f``: ``pick`` over ``runs`` runs of ``calls`` calls timed with ``clock``
    (``before`` runs ahead of each run, untimed)."""
    per_run = []
    for _ in range(runs):
        if before is not None:
            before()
        t = clock()
        for _ in range(calls):
            f()
        per_run.append((clock() - t) / calls * 1e6)
    return pick(per_run)


def print_layers(
    layers: Iterable[Tuple[str, Callable[[], object]]],
    show: bool = True,
    width: int = 28,
    **timing: object,
) -> list:
    """Time each ``(name, f)`` with :func:`per_call_us` (``timing``: its keyword arguments); print
    ``name  N.NN us`` lines when ``show`` (every rank times, rank 0 prints); returns [(name, us)]."""
    out = []
    for name, f in layers:
        us = per_call_us(f, **timing)  # type: ignore[arg-type]
        out.append((name, us))
        if show:
            print(f"{name:{width}s} {us:6.2f} us", flush=True)
    return out
