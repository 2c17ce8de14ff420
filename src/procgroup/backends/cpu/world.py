"""The CPU backend's world: rendezvous through the store, then shm within a host and TCP across hosts."""

from __future__ import annotations

import logging
import os
import socket
from typing import Optional

from ... import netutil
from ...config import RuntimeConfig
from ...deadline import Deadline
from ...process_group import World
from ...rendezvous import MemberInfo, host_key, new_nonce, process_start_time, rendezvous
from ...transport import connect_transport
from ..base import WorldSpec

__all__ = ["build_world"]

logger = logging.getLogger("procgroup")


def _advertise(master: Optional[tuple], cfg: RuntimeConfig) -> str:
    """The address this rank's peers dial: PROCGROUP_SOCKET_ADDR, PROCGROUP_SOCKET_IFNAME's, else routed."""
    if master is not None:
        return netutil.advertised_addr(
            master[0], master[1], socket_addr=cfg.socket_addr, socket_ifname=cfg.socket_ifname
        )
    if cfg.socket_addr:
        return cfg.socket_addr
    if cfg.socket_ifname:
        return netutil.interface_addr(cfg.socket_ifname)
    for addr in netutil.non_loopback_addrs():  # file:// init: no master to route towards
        return addr
    return "127.0.0.1"


def build_world(spec: WorldSpec) -> World:
    """Collective: every rank calls it; returns when the group has formed and transports are connected.

    Raises RendezvousError (and its timeout kin) when the members cannot agree, ConfigError for bad settings.
    """
    identity, store, cfg, where = spec.identity, spec.store, spec.config, spec.where
    deadline = Deadline.after(spec.timeout)
    hostname = cfg.hostname or socket.gethostname()
    me = MemberInfo(
        rank=identity.rank,
        world_size=identity.world_size,
        hostname=hostname,
        host_key=host_key(),
        addr=_advertise(spec.master, cfg),
        pid=os.getpid(),
        nonce=new_nonce(),
        local_rank=identity.local_rank,
        node_rank=identity.node_rank,
        start_time=process_start_time(),
    )
    members = rendezvous(store, me, deadline, where=where, progress_interval=cfg.progress_interval)
    transport = connect_transport(
        store,
        identity.rank,
        identity.world_size,
        secret=spec.secret,
        host_keys=[m.host_key for m in members],
        advertise_addr=me.addr,
        job_id=spec.job_id,
        deadline=deadline,
        mode=cfg.transport,
        shm_options=cfg.shm,
        tcp_options=cfg.tcp,
    )
    hosts = [m.host_key for m in members]
    local = [m for m in members if m.host_key == me.host_key]
    # explicit ranks and MPI launchers give no reliable node layout: take it from where ranks really are
    measured = identity.source in ("explicit", "openmpi", "mpich") or identity.layout_measured
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
        timeout=spec.timeout,
        native=cfg.shm.native,
    )
    world.on_close.append(transport.close)
    logger.info(
        "rank %d/%d formed the group at %s in %.2fs (%d host%s, transport %s)",
        identity.rank,
        identity.world_size,
        where,
        deadline.elapsed(),
        len(set(hosts)),
        "" if len(set(hosts)) == 1 else "s",
        getattr(transport, "kind", "?"),
    )
    return world
