"""The built-in CPU backend ("cpu", alias "gloo"): rendezvous, then shm within a host and TCP across hosts."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Optional

from ..config import ENV, Identity, env_str
from ..deadline import Deadline
from ..errors import ConfigError
from ..process_group import World
from ..rendezvous import MemberInfo, host_key, new_nonce, rendezvous

__all__ = ["build_world", "NAMES"]

logger = logging.getLogger("procgroup")

#: names that select this backend
NAMES = ("cpu", "gloo")


def _advertise(master: Optional[tuple]) -> str:
    from .. import netutil

    if master is not None:
        return netutil.advertised_addr(master[0], master[1])
    a = env_str(ENV.SOCKET_ADDR)
    if a:
        return a
    ifn = env_str(ENV.SOCKET_IFNAME)
    if ifn:
        return netutil.interface_addr(ifn)
    for addr in netutil.non_loopback_addrs():  # file:// init: no master to route towards
        return addr
    return "127.0.0.1"


def build_world(
    *,
    store: Any,
    identity: Identity,
    timeout: float,
    where: str,
    master: Optional[tuple],
    secret: bytes,
    job_id: str,
) -> World:
    """Collective: every rank calls it; returns when the group has formed and transports are connected."""
    from ..transport import connect_transport

    deadline = Deadline.after(timeout)
    hostname = env_str(ENV.HOSTNAME) or socket.gethostname()
    me = MemberInfo(
        rank=identity.rank,
        world_size=identity.world_size,
        hostname=hostname,
        host_key=host_key(),
        addr=_advertise(master),
        pid=os.getpid(),
        nonce=new_nonce(),
        local_rank=identity.local_rank,
        node_rank=identity.node_rank,
    )
    members = rendezvous(store, me, deadline, where=where)
    mode = (env_str(ENV.TRANSPORT) or "auto").lower()
    if mode not in ("auto", "shm", "tcp"):
        raise ConfigError(f"{ENV.TRANSPORT}={mode!r} is not one of auto, shm, tcp")
    transport = connect_transport(
        store,
        identity.rank,
        identity.world_size,
        secret=secret,
        host_keys=[m.host_key for m in members],
        advertise_addr=me.addr,
        job_id=job_id,
        deadline=deadline,
        mode=mode,
    )
    hosts = [m.host_key for m in members]
    local = [m for m in members if m.host_key == me.host_key]
    # explicit ranks and MPI launchers give no reliable node layout: take it from where ranks really are
    measured = identity.source in ("explicit", "openmpi", "mpich")
    world = World(
        rank=identity.rank,
        size=identity.world_size,
        transport=transport,
        store=store,
        hosts=hosts,
        hostnames=[m.hostname for m in members],
        local_rank=local.index(me) if measured else identity.local_rank,
        local_world_size=len(local) if measured else identity.local_world_size,
        node_rank=list(dict.fromkeys(hosts)).index(me.host_key) if measured else identity.node_rank,
        backend="cpu",
        timeout=timeout,
    )
    world.on_close.append(transport.close)
    logger.info(
        "rank %d/%d formed the group at %s in %.2fs (%d host%s, transport %s)",
        identity.rank, identity.world_size, where, deadline.elapsed(), len(set(hosts)),
        "" if len(set(hosts)) == 1 else "s", getattr(transport, "kind", "?"),
    )
    return world
