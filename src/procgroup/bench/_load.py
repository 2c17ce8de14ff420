"""How busy the machine is with other people's work (a shared machine makes timings noisy)."""

from __future__ import annotations

import os
import resource
import time
from typing import Optional

from .. import procfs

__all__ = ["BackgroundMeter", "busy_fraction"]


def _cpu_jiffies() -> Optional[tuple[int, int]]:
    """(busy, total) jiffies of all CPUs since boot (None where unavailable)."""
    return procfs.cpu_jiffies()


def _our_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    return total


def busy_fraction(interval: float = 1.0) -> Optional[float]:
    """Fraction of the machine's CPU time in use over ``interval`` (by anyone)."""
    a = _cpu_jiffies()
    time.sleep(interval)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


class BackgroundMeter:
    """CPU used on the machine during a measurement by everything except us.

    ``fraction`` = (all CPUs' busy time - the CPU time of this process and its finished children)
    / (wall time x CPUs): the share of the machine that other users' work took while we measured.
    """

    def __init__(self) -> None:
        self.j0 = _cpu_jiffies()
        self.c0 = _our_cpu_s()
        self.t0 = time.monotonic()

    def fraction(self) -> Optional[float]:
        j1 = _cpu_jiffies()
        if self.j0 is None or j1 is None or j1[1] == self.j0[1]:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy_s = (j1[0] - self.j0[0]) / hz
        ours = _our_cpu_s() - self.c0
        wall = time.monotonic() - self.t0
        ncpu = (j1[1] - self.j0[1]) / hz / max(wall, 1e-9)  # CPUs, as /proc/stat counts them
        return max(0.0, busy_s - ours) / max(wall * max(ncpu, 1.0), 1e-9)
