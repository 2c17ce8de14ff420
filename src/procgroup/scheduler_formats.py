"""Pure parsers of what schedulers write, and the port derived from a job id (no environment, no I/O).

:mod:`procgroup.identity` reads the variables and calls these: Slurm's compressed host lists (``h[1-3,5]``) and
task counts (``2(x3),1``), Open MPI's contact URIs, and :func:`derive_port`.
"""

from __future__ import annotations

import re
import zlib
from typing import Optional

from .config import SLURM
from .errors import ConfigError

__all__ = [
    "PORT_BASE",
    "PORT_SPAN",
    "daemon_vpid",
    "derive_port",
    "expand_hostlist",
    "hnp_host",
    "parse_tasks_per_node",
]

#: Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): unprivileged and
#: below Linux's default ephemeral range (32768-60999), so a derived port never
#: collides with a port the kernel handed to some client socket.
PORT_BASE = 20000
PORT_SPAN = 10000


def derive_port(job_id: str, step: int = 0) -> int:
    """Deterministic rendezvous port for a scheduler job (and step).

    ``PORT_BASE + (J * 7 + step) % PORT_SPAN`` where ``J = int(job_id)`` for a
    decimal job id (Slurm, Open MPI's jobid) and ``J = zlib.crc32(job_id)``
    otherwise.  Every rank of a step computes the same port; consecutive steps
    of a job get consecutive ports; in a shell:
    ``echo $((20000 + (SLURM_JOB_ID * 7 + SLURM_STEP_ID) % 10000))``.
    Two jobs sharing a node collide only when ``7*(J1-J2) + (s1-s2)`` is a
    multiple of 10000; set MASTER_PORT if that bites.
    """
    s = str(job_id).strip()
    j = int(s) if s.isdigit() else zlib.crc32(s.encode())
    return PORT_BASE + (j * 7 + int(step)) % PORT_SPAN


_BARE_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")


def expand_hostlist(spec: str, *, var: str = "host list") -> list[str]:
    """Expand a Slurm compressed host list (``h[1-3,5]``, ``node[01-03],gpu7``).

    Uses the ``hostlist`` module of python-hostlist (an optional dependency,
    imported lazily).  Without it, bracket-free lists (``a,b,c``) still work
    and a bracketed one raises :class:`ConfigError` saying what to install.
    ``var`` names the variable in error messages.
    """
    spec = (spec or "").strip()
    if not spec:
        raise ConfigError(f"{var} is empty; expected a Slurm host list such as h[1-3]")
    try:
        import hostlist  # python-hostlist
    except ImportError:
        hostlist = None
    if hostlist is not None:
        try:
            hosts = list(hostlist.expand_hostlist(spec))
        except hostlist.BadHostlist as e:
            raise ConfigError(f"{var}={spec!r} is not a valid Slurm host list: {e}") from None
    else:
        if "[" in spec or "]" in spec:
            raise ConfigError(
                f"{var}={spec!r} is a compressed host list and expanding it needs the python-hostlist package: "
                "pip install python-hostlist (or procgroup[slurm]); or set MASTER_ADDR yourself"
            )
        hosts = [h.strip() for h in spec.split(",")]
        bad = [h for h in hosts if not _BARE_HOST.match(h)]
        if bad:
            raise ConfigError(f"{var}={spec!r} is not a valid host list: bad entry {bad[0]!r}")
    if not hosts:
        raise ConfigError(f"{var}={spec!r} names no host")
    return hosts


_TPN_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(spec: str, *, var: str = SLURM.STEP_TASKS_PER_NODE) -> list[int]:
    """Expand Slurm's tasks-per-node notation: ``2(x3)`` -> [2, 2, 2]; ``3,2``; ``2(x2),1``."""
    out: list[int] = []
    for item in (spec or "").split(","):
        m = _TPN_ITEM.match(item.strip())
        if not m:
            raise ConfigError(
                f"{var}={spec!r} is not in Slurm's tasks-per-node notation (e.g. '2(x3)', '3,2' or '2(x2),1')"
            )
        n, rep = int(m.group(1)), int(m.group(2) or 1)
        if rep < 1:
            raise ConfigError(f"{var}={spec!r}: repeat count must be >= 1")
        out.extend([n] * rep)
    return out


def hnp_host(uri: str) -> Optional[str]:
    """First address of mpirun's contact URI: "1234.0;tcp://10.0.0.1,10.1.0.1:5000;tcp6://[fd00::2]:5001"."""
    v6: Optional[str] = None
    for part in uri.split(";")[1:]:
        scheme, sep, rest = part.partition("://")
        if not sep:
            continue
        addrs = rest.rsplit(":", 1)[0]
        first = addrs.split(",")[0].strip()
        if scheme == "tcp" and first:
            return first
        if scheme == "tcp6" and first and v6 is None:
            v6 = first.strip("[]")
    return v6


def daemon_vpid(uri: Optional[str]) -> Optional[int]:
    """The daemon number in "JOBFAM.VPID;tcp://...": 0 is mpirun itself."""
    if not uri:
        return None
    name = uri.split(";", 1)[0]
    _, sep, vpid = name.partition(".")
    return int(vpid) if sep and vpid.isdigit() else None
