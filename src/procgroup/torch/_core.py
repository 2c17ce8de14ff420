"""Every use of procgroup's internals by the torch plug-in, in one place.

The rest of ``procgroup.torch`` reaches procgroup's core only through the names defined here, so that a
restructuring of the core (``api``, ``group``, ``backends``, ``store``) is absorbed by editing this module alone.

What it uses from the core:

* ``procgroup.backends.create_group`` / ``destroy_group``: a standalone procgroup world over a given store,
  without touching procgroup's own default group; ``procgroup.process_group.ProcessGroup``, its type.
* ``procgroup.config`` (``RuntimeConfig``, ``job_secret``): the run id and the job secret, parsed once.
* ``procgroup.store.Store`` (the interface the adapter implements, with its ``_deadline`` and
  ``_timeout_error`` helpers).
* ``procgroup.errors``: the exception types raised and caught.
* ``procgroup.backends.nccl.devices.check_one_device_per_rank``: the one-GPU-per-rank verdict (torch-free), the
  same as procgroup's own ``backend="nccl"``.
* ``procgroup.collectives`` (the public collectives, called with ``group=`` a group from :func:`create_group`)
  and ``procgroup.ops.ReduceOp``.
* mismatch detection and roll call for the group (``create_group(..., watchdog=True)``), as
  ``init_process_group`` starts them for procgroup's own groups.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .. import collectives as collectives  # noqa: PLC0414 - re-exported for the backend module
from ..backends import create_group as _create_group
from ..backends import destroy_group as _destroy_group
from ..backends.nccl.devices import check_one_device_per_rank
from ..config import RuntimeConfig, job_secret
from ..errors import (
    BrokenError,
    ConfigError,
    ConnectError,
    DistTimeoutError,
    PortInUseError,
    ProcGroupError,
    StoreError,
)
from ..ops import ReduceOp
from ..process_group import ProcessGroup
from ..store import Store

__all__ = [
    "BrokenError",
    "ConfigError",
    "ConnectError",
    "DistTimeoutError",
    "PortInUseError",
    "ProcGroupError",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "StoreError",
    "check_one_device_per_rank",
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
    cfg = RuntimeConfig.load(timeout=timeout)
    job_id = f"{cfg.run_id}-{token[:8]}" if cfg.run_id else f"torch-{token}"
    # without PROCGROUP_SECRET the transports' key derives from the random token the members agreed on
    secret = job_secret(cfg, job_id) if cfg.secret is not None else ("procgroup-torch:" + token).encode()
    return _create_group(
        "cpu",
        store=store,
        rank=int(rank),
        world_size=int(world_size),
        timeout=float(timeout),
        job_id=job_id,
        secret=secret,
        config=cfg,
        group_name=name,
        watchdog=int(world_size) > 1,
    )


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
    _destroy_group(pg)
