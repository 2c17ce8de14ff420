"""Every read of Linux's ``/proc`` in one place (a leaf module: it imports nothing from procgroup).

Each function answers ``None`` (or an empty result) where ``/proc`` or the entry is missing or
unreadable, so callers on other systems, or looking at other users' processes, degrade quietly.
The launcher, the library and the benchmarks all read ``/proc`` through here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

__all__ = [
    "ProcTable",
    "StatLine",
    "argv",
    "boot_id",
    "cmdline",
    "cpu_jiffies",
    "loadavg",
    "cpu_model",
    "mem_total_gib",
    "namespace_inode",
    "pid_alive",
    "pid_max",
    "pids",
    "pids_in_namespace",
    "port_holder_pid",
    "proc_table",
    "stat",
    "status_fields",
]

PROC = "/proc"


@dataclass(frozen=True)
class StatLine:
    """The fields of ``/proc/<pid>/stat`` that procgroup uses."""

    state: str
    ppid: int
    pgid: int
    session: int
    utime: int  # clock ticks
    stime: int
    starttime: int  # clock ticks after boot
    rss_pages: int


def stat(pid: int) -> Optional[StatLine]:
    """Parsed ``/proc/<pid>/stat``, or None when the process is gone or unreadable."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm is in parentheses and may itself contain spaces and ')'
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return StatLine(
            state=rest[0].decode(),
            ppid=int(rest[1]),
            pgid=int(rest[2]),
            session=int(rest[3]),
            utime=int(rest[11]),
            stime=int(rest[12]),
            starttime=int(rest[19]),
            rss_pages=int(rest[21]),
        )
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live process (not a zombie)?  Falls back to ``kill(pid, 0)`` where /proc says nothing."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    st = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
    return st not in (b"Z", b"X", b"x")


def argv(pid: int) -> list[str]:
    """The arguments of ``pid``'s command line (empty when it is gone or unreadable)."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def cmdline(pid: int, limit: int = 160) -> str:
    """The command line of ``pid`` on one line (its ``comm`` when empty; ``"?"`` when unreadable),
    cut to ``limit`` characters."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        raw = b""
    s = " ".join(raw.replace(b"\0", b" ").decode("utf-8", "replace").split())
    if not s:
        try:
            with open(f"{PROC}/{pid}/comm") as f:
                s = f.read().strip()
        except OSError:
            s = ""
    s = s or "?"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def pids() -> list[int]:
    """Every pid visible in /proc (empty where there is none)."""
    try:
        return [int(n) for n in os.listdir(PROC) if n.isdigit()]
    except OSError:
        return []


#: pid -> (state, ppid, pgid) of every process, read from /proc in one pass
ProcTable = Dict[int, Tuple[str, int, int]]


def proc_table() -> ProcTable:
    """One pass over /proc: pid -> (state, ppid, pgid) for every readable process."""
    table: ProcTable = {}
    for pid in pids():
        st = stat(pid)
        if st is not None:
            table[pid] = (st.state, st.ppid, st.pgid)
    return table


def boot_id() -> Optional[str]:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``)."""
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def namespace_inode(kind: str, pid: str = "self") -> Optional[int]:
    """Inode of ``/proc/<pid>/ns/<kind>`` (``"net"``, ``"pid"``, ...): equal for processes in the same namespace."""
    try:
        return os.stat(f"{PROC}/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _listen_inodes(port: int) -> Set[str]:
    """Socket inodes in LISTEN state (st == 0A) on ``port`` from /proc/net/tcp{,6}."""
    inodes: Set[str] = set()
    for name in ("net/tcp", "net/tcp6"):
        try:
            with open(f"{PROC}/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            local, state, inode = fields[1], fields[3], fields[9]
            try:
                lport = int(local.rsplit(":", 1)[1], 16)
            except (IndexError, ValueError):
                continue
            if lport == port and state == "0A" and inode != "0":
                inodes.add(inode)
    return inodes


def port_holder_pid(port: int) -> Optional[int]:
    """The pid of a process listening on TCP ``port``, or None.

    Matches the LISTEN socket's inode against ``/proc/*/fd``; processes of other users are not
    visible without privileges, so None is a normal answer.  Our own pid is looked at first.
    """
    inodes = _listen_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    candidates = pids()
    me = os.getpid()
    if me in candidates:
        candidates.remove(me)
        candidates.insert(0, me)
    for pid in candidates:
        fd_dir = f"{PROC}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link in targets:
                return pid
    return None


def cpu_jiffies() -> Optional[Tuple[int, int]]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open(f"{PROC}/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [int(v) for v in parts[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals[:8]) - idle, sum(vals[:8])


def cpu_model() -> Optional[str]:
    """The first ``model name`` of /proc/cpuinfo."""
    try:
        with open(f"{PROC}/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def mem_total_gib() -> Optional[float]:
    """MemTotal of /proc/meminfo in GiB (one decimal)."""
    try:
        with open(f"{PROC}/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def pids_in_namespace(kind: str, inodes: Set[int]) -> Set[int]:
    """The pids whose ``/proc/<pid>/ns/<kind>`` inode is one of ``inodes`` (e.g. every process of some netns)."""
    if not inodes:
        return set()
    return {pid for pid in pids() if namespace_inode(kind, str(pid)) in inodes}


def pid_max() -> Optional[int]:
    """``/proc/sys/kernel/pid_max``: one more than the largest process id the kernel hands out; None if unreadable."""
    try:
        with open(f"{PROC}/sys/kernel/pid_max", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where unreadable)."""
    try:
        with open(f"{PROC}/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return []


def status_fields(pid: str = "self", names: tuple[str, ...] = ("VmRSS", "RssAnon")) -> Dict[str, int]:
    """The named ``kB`` fields of ``/proc/<pid>/status``, in bytes (missing ones are left out)."""
    got: Dict[str, int] = {}
    try:
        with open(f"{PROC}/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in names:
                    got[k] = int(v.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return got
