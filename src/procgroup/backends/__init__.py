"""Backends: the interface and registry (:mod:`.base`), the built-in ones, and a factory without global state.

Importing this package registers "cpu" (alias "gloo"), "mpi" (mpi4py, imported only when a world forms)
and "nccl" (CUDA tensors through torch's NCCL; torch imported only when asked for).
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import Identity, RuntimeConfig, job_secret, to_seconds
from ..process_group import ProcessGroup, abort_world
from . import cpu as _cpu  # noqa: F401 - registers "cpu" and "gloo"
from . import mpi as _mpi  # noqa: F401 - registers "mpi"
from . import nccl as _nccl  # noqa: F401 - registers "nccl"
from .base import Backend, WorldSpec, describe_names, lookup, names, register

__all__ = ["Backend", "WorldSpec", "register", "lookup", "names", "describe_names", "create_group", "destroy_group"]


def create_group(
    name: str = "cpu",
    *,
    store: Any,
    rank: int,
    world_size: int,
    timeout: Any = None,
    job_id: str = "default",
    secret: Optional[bytes] = None,
    config: Optional[RuntimeConfig] = None,
    group_name: str = "WORLD",
    watchdog: bool = False,
) -> ProcessGroup:
    """Form a world of backend ``name`` over ``store`` and return its group of all ranks; no global state.

    Collective: every one of the ``world_size`` ranks calls it with the same store, ``job_id`` and secret.
    The default group of ``init_process_group`` is neither read nor changed, so a process may hold several
    such groups (one per torch process group, say); pass the result as ``group=`` to any collective,
    point-to-point op or object collective.  ``timeout`` (seconds or a timedelta) bounds the formation
    and is the group's default deadline; ``config`` defaults to :meth:`RuntimeConfig.load` (the environment),
    ``secret`` to :func:`~procgroup.config.job_secret`.  ``watchdog=True`` also runs mismatch detection
    through ``store``.  Release everything with :func:`destroy_group`.

    Raises :class:`~procgroup.errors.ConfigError` for an unknown or unavailable backend or a bad argument,
    and :class:`~procgroup.errors.RendezvousError` (or its timeout) when the ranks cannot form the world.
    """
    backend = lookup(name)
    cfg = config if config is not None else RuntimeConfig.load(timeout=timeout)
    tmo = to_seconds(timeout) or cfg.timeout
    spec = WorldSpec(
        store=store,
        identity=Identity(rank=int(rank), world_size=int(world_size), source="explicit"),
        timeout=tmo,
        where=f"the given {type(store).__name__}",
        master=None,
        secret=secret if secret is not None else job_secret(cfg, job_id),
        job_id=job_id,
        config=cfg,
    )
    world = backend.create_world(spec)
    world.timeout = tmo
    pg = ProcessGroup(world, list(range(world.size)), 0, group_name)
    if watchdog:
        from ..watchdog import Watchdog

        wd = Watchdog(store, world.rank, lambda: [pg.status()], lambda e: abort_world(world, e)).start()
        world.on_close.append(wd.stop)
    return pg


def destroy_group(pg: ProcessGroup) -> None:
    """Close a group made by :func:`create_group` and its world (transports, watchdog); idempotent."""
    try:
        pg.close()
    finally:
        pg.world.close()
