"""Every use of procgroup's internals by the torch plug-in, in one place.

The rest of ``procgroup.torch`` reaches procgroup's core only through the names defined here, so that a
restructuring of the core (``api``, ``group``, ``backends``, ``store``) is absorbed by editing this module alone.

What it uses from the core:

* ``procgroup.backends.cpu.build_world`` and ``procgroup.group.ProcessGroup``: :func:`create_group` forms a
  standalone procgroup world over a given store, without touching procgroup's own default group (the
  equivalent of ``procgroup.backends.create_group``, which the core is adding).
* ``procgroup.config`` (``ENV``, ``Identity``, ``env_str``), ``procgroup.protocol.auth.secret_from_env``:
  the job secret and job id.
* ``procgroup.store.Store`` (the interface the adapter implements, with its ``_deadline`` and
  ``_timeout_error`` helpers).
* ``procgroup.errors``: the exception types raised and caught.
* ``procgroup.collectives`` (the public collectives, called with ``group=`` a group from :func:`create_group`)
  and ``procgroup.ops.ReduceOp``.
* ``procgroup.watchdog.Watchdog``: mismatch detection and roll call for the group, as ``init_process_group``
  starts it for procgroup's own groups.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .. import collectives as collectives  # noqa: PLC0414 - re-exported for the backend module
from ..backends import cpu as _cpu
from ..config import ENV, Identity, env_str
from ..errors import (
    BrokenError,
    ConfigError,
    DistTimeoutError,
    ProcGroupError,
    StoreError,
)
from ..group import ProcessGroup
from ..ops import ReduceOp
from ..protocol.auth import secret_from_env
from ..store import Store
from ..watchdog import Watchdog

__all__ = [
    "BrokenError",
    "ConfigError",
    "DistTimeoutError",
    "ProcGroupError",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "StoreError",
    "close_group",
    "collectives",
    "create_group",
    "p2p_source",
    "rename_group",
    "set_group_timeout",
]

logger = logging.getLogger("procgroup.torch")

#: store key under which the first member publishes the group's random job token
_TOKEN_KEY = "token"


def _job_token(store: Any, timeout: float) -> str:
    """A random token every member of this group agrees on (the first writer wins, through the store)."""
    mine = os.urandom(12).hex().encode()
    got = store.compare_set(_TOKEN_KEY, b"", mine)
    if not got:
        got = store.get(_TOKEN_KEY, timeout=timeout)
    return got.decode()


def create_group(name: str, *, store: Any, rank: int, world_size: int, timeout: float) -> ProcessGroup:
    """Form a standalone procgroup world of ``world_size`` ranks over ``store``; return its ProcessGroup.

    Collective: every member calls it with the same store namespace.  It returns when the group has formed
    and its transports are connected (shared memory within a host, TCP across), or raises procgroup's
    RendezvousTimeoutError after ``timeout`` seconds naming the ranks that never joined.  procgroup's
    own default group (``procgroup.init_process_group``) is neither needed nor touched.
    """
    token = _job_token(store, timeout)
    run_id = env_str(ENV.RUN_ID)
    job_id = f"{run_id}-{token[:8]}" if run_id else f"torch-{token}"
    secret = secret_from_env(fallback=None if env_str(ENV.SECRET) else "procgroup-torch:" + token)
    ident = Identity(rank=int(rank), world_size=int(world_size), source="explicit", job_id=job_id)
    world = _cpu.build_world(
        store=store, identity=ident, timeout=float(timeout), where=f"torch's store ({name})", master=None,
        secret=secret, job_id=job_id,
    )
    world.timeout = float(timeout)
    pg = ProcessGroup(world, list(range(int(world_size))), 0, name, float(timeout))
    if int(world_size) > 1:
        wd = Watchdog(store, int(rank), lambda: [pg], world.transport.abort).start()
        world.on_close.append(wd.stop)
    return pg


def rename_group(pg: ProcessGroup, name: str) -> None:
    """The name procgroup's errors and flight records give the group."""
    pg.name = name


def set_group_timeout(pg: ProcessGroup, seconds: float) -> None:
    """The default deadline (seconds) of the group's later operations."""
    pg.timeout = float(seconds)


def p2p_source(work: Any) -> Optional[int]:
    """The sender's rank of a completed procgroup receive Work (what ``procgroup.recv`` returns), else None."""
    src = getattr(work, "_result", None)
    return src if isinstance(src, int) else None


def close_group(pg: ProcessGroup) -> None:
    """Close ``pg`` and the world under it (its transports and shared-memory segments); idempotent."""
    try:
        pg.close()
    finally:
        pg.world.close()
