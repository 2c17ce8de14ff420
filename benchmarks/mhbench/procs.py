"""Processes in the hosts' namespaces: liveness, stopping, and the CPU share other users took.

Every /proc read goes through procgroup.procfs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Dict, List, Optional, Sequence

from procgroup import procfs

loadavg = procfs.loadavg


def alive(pid: int) -> bool:
    """Is ``pid`` a live process (not a zombie)?"""
    st = procfs.stat(pid)
    return st is not None and st.state not in ("Z", "X")


def netns_inodes(names: Sequence[str]) -> set:
    """The inodes of the named network namespaces (``/run/netns/NAME``)."""
    out = set()
    for n in names:
        try:
            out.add(os.stat(f"/run/netns/{n}").st_ino)
        except OSError:
            pass
    return out


def pids_in_netns(inodes: set) -> set:
    """Every process inside one of these network namespaces."""
    return procfs.pids_in_namespace("net", inodes)


def cmdline(pid: int) -> str:
    """``pid``'s command line, or "" when it is gone."""
    s = procfs.cmdline(pid, limit=4096)
    return "" if s == "?" else s


def stop_pids(pids: Sequence[int], grace: float = 5.0) -> List[str]:
    """SIGTERM, up to ``grace`` s, SIGKILL; returns descriptions of those that needed killing or stayed."""
    pids = [p for p in pids if alive(p)]
    if not pids:
        return []
    desc = {p: cmdline(p)[:160] for p in pids}
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    end = time.monotonic() + grace
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 5
    while time.monotonic() < end and any(alive(p) for p in left):
        time.sleep(0.1)
    return [f"pid {p}: {desc[p]}" for p in pids]


def _cpu_ticks(pid: int) -> Optional[int]:
    st = procfs.stat(pid)
    return None if st is None else st.utime + st.stime  # clock ticks


class OthersMeter:
    """The share of the machine's CPU that other users took while one run ran.

    procgroup.bench's BackgroundMeter counts this process's waited-for descendants as ours, which
    misses what Open MPI's orted daemons and their ranks use (so MPI runs would look loaded).  Here a
    thread samples, every 0.25 s, the CPU time of every process in the hosts' network namespaces
    (everything a run starts lives there) plus this process's own; others = all CPUs' busy time
    (/proc/stat) minus that, over wall time x CPUs.  A process's last < 0.25 s before it exits is
    missed, so the share is an upper bound by a little.
    """

    def __init__(self, inodes: set) -> None:
        import threading

        self.inodes = inodes
        self.hz = os.sysconf("SC_CLK_TCK")
        self.base: Dict[int, int] = {p: t for p in pids_in_netns(inodes) if (t := _cpu_ticks(p)) is not None}
        self.last: Dict[int, int] = dict(self.base)
        self.j0 = self._jiffies()
        self.own0 = _cpu_ticks(os.getpid()) or 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    _jiffies = staticmethod(procfs.cpu_jiffies)

    def _sample(self) -> None:
        for p in pids_in_netns(self.inodes):
            t = _cpu_ticks(p)
            if t is not None:
                self.last[p] = t

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def fraction(self) -> Optional[float]:
        self._sample()
        self._stop.set()
        self._t.join()
        j1 = self._jiffies()
        if self.j0 is None or j1 is None or j1[1] == self.j0[1]:
            return None
        ours = sum(t - self.base.get(p, 0) for p, t in self.last.items())
        ours += (_cpu_ticks(os.getpid()) or 0) - self.own0
        wall = time.monotonic() - self.t0
        ncpu = (j1[1] - self.j0[1]) / self.hz / max(wall, 1e-9)
        return max(0.0, (j1[0] - self.j0[0] - ours) / self.hz) / max(wall * max(ncpu, 1.0), 1e-9)
