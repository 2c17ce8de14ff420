"""Transports: reliable, ordered, tagged messages between ranks (see :mod:`.base`).

* :class:`MemoryTransport` -- ranks as threads of one process (reference, tests);
* :class:`ShmTransport` -- processes of one host, shared-memory rings;
* :class:`TcpTransport` -- processes anywhere, one authenticated TCP connection per pair;
* :class:`RouterTransport` -- per-peer dispatch over the above, with ANY_SOURCE across them;
* :func:`connect_transport` -- the collective factory used by ``init_process_group``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..config import ShmOptions, TcpOptions
from ..config import shm_options as _shm_options_from_env
from ..config import tcp_options as _tcp_options_from_env
from ..deadline import as_deadline
from ..errors import ConfigError, format_ranks
from ._engine import LoopbackTransport
from .base import ANY_SOURCE, CompletedRequest, Request, Status, Transport
from .memory import MemoryHub, MemoryTransport
from .router import RouterTransport
from .shm import ShmTransport, shm_supported
from .tcp import TcpTransport

__all__ = [
    "ANY_SOURCE",
    "Status",
    "Request",
    "CompletedRequest",
    "Transport",
    "MemoryHub",
    "MemoryTransport",
    "LoopbackTransport",
    "ShmTransport",
    "TcpTransport",
    "RouterTransport",
    "connect_transport",
    "MODES",
]

#: accepted values of ``mode`` (and of PROCGROUP_TRANSPORT)
MODES = ("auto", "shm", "tcp")


def connect_transport(
    store: Any,
    rank: int,
    world_size: int,
    *,
    secret: bytes,
    host_keys: Sequence[str],
    advertise_addr: str,
    job_id: str,
    deadline: Any,
    mode: str = "auto",
    prefix: str = "transport",
    ring_size: Optional[int] = None,
    max_frame_size: Optional[int] = None,
    shm_options: Optional[ShmOptions] = None,
    tcp_options: Optional[TcpOptions] = None,
) -> Transport:
    """Connect this rank to every other rank; collective (every rank calls it), bounded by ``deadline``.

    ``host_keys[i]`` is equal for ranks that share a host (memory).  ``mode``:
    ``"auto"`` uses shm within a host and tcp across hosts, ``"tcp"`` tcp
    everywhere, ``"shm"`` shm everywhere (:class:`ConfigError` if the ranks are
    on different hosts).  Store keys live under ``<prefix>/<generation>/``;
    the generation counts this rank's calls, so a later call (re-init with the
    same store) never reads an earlier call's keys.

    Returns a :class:`ShmTransport` or :class:`TcpTransport` when one
    transport reaches every peer, a :class:`RouterTransport` over both when
    the job spans several hosts, a :class:`LoopbackTransport` for world size 1.

    ``shm_options``: settings of the shm transport; None reads them from the
    environment once (``PROCGROUP_SHM_*``, a bad value is a ConfigError naming it); ``tcp_options`` likewise for
    the tcp transport (``PROCGROUP_TCP_*``).
    """
    mode = (mode or "auto").lower()
    if mode not in MODES:
        raise ConfigError(f"transport mode {mode!r} is not one of {', '.join(MODES)} (PROCGROUP_TRANSPORT)")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside [0, {world_size})")
    keys: List[str] = [str(k) for k in host_keys]
    if len(keys) != world_size:
        raise ConfigError(f"host_keys has {len(keys)} entries for a world of {world_size} ranks")
    dl = as_deadline(deadline)
    if world_size == 1:
        return LoopbackTransport(rank, world_size)
    mine = keys[rank]
    if mode == "shm":
        others = [r for r in range(world_size) if keys[r] != mine]
        if others:
            raise ConfigError(
                f"PROCGROUP_TRANSPORT=shm, but ranks {format_ranks(others)} are on another host than rank {rank}; "
                "shm only connects ranks of one host: use auto or tcp"
            )
        if not shm_supported():
            raise ConfigError("PROCGROUP_TRANSPORT=shm, but /dev/shm is not available here; use auto or tcp")
    use_shm = mode != "tcp" and shm_supported()
    local = [r for r in range(world_size) if keys[r] == mine] if use_shm else [rank]
    remote = [r for r in range(world_size) if r not in set(local)]
    gen = int(store.add(f"{prefix}/generation/{rank}", 1))
    pfx = f"{prefix}/{gen}"

    shm: Optional[ShmTransport] = None
    tcp: Optional[TcpTransport] = None
    try:
        if len(local) > 1:
            opts = shm_options if shm_options is not None else _shm_options_from_env()
            shm = ShmTransport(
                store,
                rank,
                world_size,
                local_ranks=local,
                job_id=job_id,
                deadline=dl,
                prefix=f"{pfx}/shm",
                ring_size=ring_size,
                options=opts,
            )
        if remote:
            kw = {} if max_frame_size is None else {"max_frame_size": max_frame_size}
            tcp = TcpTransport(
                store,
                rank,
                world_size,
                peers=remote,
                secret=secret,
                advertise_addr=advertise_addr,
                deadline=dl,
                prefix=f"{pfx}/tcp",
                options=tcp_options if tcp_options is not None else _tcp_options_from_env(),
                **kw,
            )
    except BaseException:
        if shm is not None:
            shm.close()
        raise
    if shm is not None and tcp is not None:
        per_peer: Dict[int, Transport] = {r: shm for r in local if r != rank}
        per_peer.update({r: tcp for r in remote})
        return RouterTransport(per_peer, LoopbackTransport(rank, world_size), rank, world_size)
    t = shm if shm is not None else tcp
    assert t is not None
    return t
