"""Process-group lifecycle and queries: init, destroy, ranks, subgroups (torch.distributed-shaped)."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .config import ENV, Identity, default_timeout, env_bool, env_int, env_str
from .deadline import Deadline
from .watchdog import FAILURE_KEY, Watchdog
from .errors import ConfigError, ProcGroupError, RendezvousError, StoreTimeoutError
from .process_group import ProcessGroup, World
from .rendezvous import InitMethod, parse_init_method, setup_logging
from .state import GroupMember, _state, default_group, group, resolve_group
from .subgroups import new_group, new_subgroups, split_group

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_backend",
    "new_group",
    "new_subgroups",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "GroupMember",
    "group",
    "Backend",
    "default_group",
    "resolve_group",
]

logger = logging.getLogger("procgroup")

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class Backend(str):
    """Backend names (torch's ``dist.Backend``)."""

    CPU = "cpu"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"


# ---------------------------------------------------------------------------------------------
def _timeout_seconds(timeout: Any) -> float:
    if timeout is None:
        return default_timeout()
    if hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    t = float(timeout)
    if not t > 0:
        raise ConfigError(f"timeout={timeout!r} must be > 0 seconds")
    return t


def _normalize_backend(backend: Optional[str]) -> str:
    if backend is None:
        return "cpu"
    b = str(backend).lower()
    if ":" in b:  # torch's "cpu:gloo,cuda:nccl"
        parts = dict(p.split(":", 1) for p in b.split(",") if ":" in p)
        b = parts.get("cpu", next(iter(parts.values())))
    if b in ("cpu", "gloo", "undefined"):
        return "cpu"
    if b == "mpi":
        raise ConfigError(
            "backend='mpi' (through mpi4py) is not built yet; under mpirun/mpiexec use backend='cpu' (the default): "
            "it reads the rank and world size from Open MPI's and MPICH's variables"
        )
    if b == "nccl":
        raise ConfigError(
            "backend='nccl' needs CUDA devices and an NCCL binding, which this machine does not provide; "
            "use backend='cpu' (or 'gloo') for CPU tensors"
        )
    raise ConfigError(f"backend={backend!r} is not one of 'cpu' (alias 'gloo'), 'mpi', 'nccl'")


def _identity(im: InitMethod, rank: int, world_size: int) -> Identity:
    rank = im.rank if rank in (-1, None) and im.rank is not None else rank
    world_size = im.world_size if world_size in (-1, None) and im.world_size is not None else world_size
    explicit = rank not in (-1, None) and world_size not in (-1, None)
    from .identity import detect_identity, resolve_master

    try:
        ident = detect_identity(os.environ)
        if im.scheme == "env":
            ident = resolve_master(ident)  # collective under MPI without MASTER_ADDR (uses mpi4py if present)
    except ConfigError as e:
        if not explicit:
            raise ConfigError(
                f"init_process_group({str(im)!r}) does not know this process's rank and world size: pass rank= and "
                f"world_size=, or set RANK and WORLD_SIZE, or start the program with `procgroup run`, srun or mpirun. ({e})"
            ) from None
        ident = Identity(rank=int(rank), world_size=int(world_size), source="explicit")
    if explicit and (ident.rank != rank or ident.world_size != world_size):
        ident = replace(ident, rank=int(rank), world_size=int(world_size), source="explicit")
    elif rank not in (-1, None) and ident.rank != rank:
        ident = replace(ident, rank=int(rank), source="explicit")
    elif world_size not in (-1, None) and ident.world_size != world_size:
        ident = replace(ident, world_size=int(world_size), source="explicit")
    return ident


def _job_secret(job_id: str) -> bytes:
    from .protocol.auth import secret_from_env

    return secret_from_env(fallback=None if env_str(ENV.SECRET) else _insecure_secret(job_id))


def _insecure_secret(job_id: str) -> str:
    logger.info(
        "%s is not set: the store and transport authenticate with a key derived from the job id %r, which stops "
        "accidental cross-talk but not an attacker; `procgroup run` sets a random secret", ENV.SECRET, job_id,
    )
    return "procgroup-derived:" + job_id


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Any = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Form the default group; returns only when all ``world_size`` members have joined.

    ``init_method``: ``env://`` (default; MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or the variables of
    srun / mpirun / mpiexec / Kubeflow), ``tcp://host:port`` or ``file:///path``.  ``timeout`` (seconds or a
    timedelta; default PROCGROUP_TIMEOUT or 300 s) bounds this call and is every later call's default deadline.
    """
    setup_logging()
    with _state.lock:
        if _state.world is not None:
            raise ProcGroupError(
                "init_process_group was called twice: the default process group is already initialized; "
                "call destroy_process_group() first, or use new_group() for another group"
            )
        if store is not None and init_method is not None:
            raise ConfigError("pass either init_method= or store=, not both")
        be = _normalize_backend(backend)
        tmo = _timeout_seconds(timeout)
        im = parse_init_method(init_method)
        ident = _identity(im, rank, world_size)
        deadline = Deadline.after(tmo)
        from . import store as store_mod

        server = None
        secret: Optional[bytes] = None
        master: Optional[Tuple[str, int]] = None
        if store is not None:
            base = store
            where = f"the given {type(store).__name__}"
            job_id = env_str(ENV.RUN_ID) or ident.job_id or "default"
        elif im.scheme == "file":
            base = store_mod.FileStore(im.path, timeout=tmo)
            where = str(im)
            job_id = env_str(ENV.RUN_ID) or ident.job_id or im.path or "file"
            _state.file_path = im.path
        else:
            if im.scheme == "tcp":
                host, port = im.host, im.port
            else:
                host, port = ident.master_addr, ident.master_port
                if host is None:
                    host = DEFAULT_MASTER_ADDR
                    logger.info("MASTER_ADDR is not set: using %s (one host); set MASTER_ADDR to rank 0's host for a multi-host job", host)
                if port is None:
                    port = DEFAULT_MASTER_PORT
                    logger.info("MASTER_PORT is not set: using %d; set MASTER_PORT to choose another", port)
                for note in ident.derived:
                    (logger.warning if ident.rank == 0 else logger.info)("derived %s", note)
            assert host is not None and port is not None
            master = (host, int(port))
            where = f"{host}:{port}"
            job_id = env_str(ENV.RUN_ID) or ident.job_id or where
            secret = _job_secret(job_id)
            if ident.rank == 0 and not env_bool(ENV.STORE_HOSTED):
                from . import netutil

                bind_host = "127.0.0.1" if netutil.is_literal_loopback(host) else "0.0.0.0"
                server = store_mod.StoreServer(bind_host, int(port), secret=secret)
                server.start()
            try:
                base = store_mod.TCPStore(host, int(port), secret=secret, timeout=tmo, connect_timeout=deadline.remaining())
            except BaseException:
                if server is not None:
                    server.close()
                raise
        if secret is None:
            secret = _job_secret(job_id)
        restart = env_int(ENV.RESTART_COUNT) or env_int(ENV.TORCHELASTIC_RESTART_COUNT) or 0
        pstore = store_mod.PrefixStore(f"pg/{restart}", base)
        try:
            from .backends import cpu

            world = cpu.build_world(
                store=pstore, identity=ident, timeout=deadline.remaining(), where=where, master=master,
                secret=secret, job_id=f"{job_id}/{restart}",
            )
            world.timeout = tmo
            world.store_host = 0 if master is not None and not env_bool(ENV.STORE_HOSTED) else None
        except BaseException as e:
            _close_quietly(base)
            if server is not None:
                if isinstance(e, RendezvousError):
                    _linger(server)  # let the other members read the error before the store goes away
                server.close()
            raise
        _state.store_server = server
        _state.prefix_store = pstore
        _state.base_store = base
        _install(world, group_name)
        _start_watchdog(world, base, master, secret, restart, tmo)


#: store connections of the process hosting the store: its client and the watchdog's
_OWN_STORE_CONNECTIONS = 2


def _linger(server: Any, grace: float = 5.0, own: int = 0) -> None:
    """Keep serving until every other client has disconnected (``own``: this process's connections), at most ``grace`` s."""
    dl = Deadline.after(grace)
    while not dl.expired() and getattr(server, "num_connections", 0) > own:
        time.sleep(0.05)


def _start_watchdog(world: World, base: Any, master: Optional[Tuple[str, int]], secret: bytes, restart: int, tmo: float) -> None:
    """Mismatch detection and roll call (``procgroup.watchdog``), on a store connection of its own."""
    from . import store as store_mod

    if isinstance(base, store_mod.TCPStore) and master is not None:
        conn = store_mod.TCPStore(master[0], master[1], secret=secret, timeout=tmo)
        world.on_close.append(conn.close)
        wstore = store_mod.PrefixStore(f"pg/{restart}", conn)
    else:
        wstore = world.store
    wd = Watchdog(wstore, world.rank, lambda: [g.status() for g in list(_state.groups)], world.transport.abort).start()
    world.on_close.append(wd.stop)


def _install(world: World, group_name: str) -> None:
    _state.world = world
    _state.backend = world.backend
    pg = ProcessGroup(world, list(range(world.size)), 0, group_name or "WORLD")
    pg._next_gid = 1  # type: ignore[attr-defined]
    _state.default = pg
    _state.groups = [pg]
    atexit.register(_atexit)
    from .debug import install_signal_handler

    install_signal_handler()


def _atexit() -> None:
    if _state.world is not None:
        try:
            destroy_process_group()
        except Exception as e:  # noqa: BLE001 - at exit, report and go
            logger.warning("destroy_process_group at exit: %s", e)


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - shutting down after another error
        pass


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Destroy ``group``, or everything (the default group and every subgroup) when None."""
    with _state.lock:
        if group is not None and group is not _state.default:
            group.close()
            if group in _state.groups:
                _state.groups.remove(group)
            return
        world = _state.world
        if world is None:
            return
        for g in _state.groups:
            g.close()
        try:
            _leave(world)
        finally:
            world.close()
            if _state.base_store is not None:
                _close_quietly(_state.base_store)
            if _state.store_server is not None:
                _state.store_server.close()
            _state.__init__()  # type: ignore[misc]


def _leave(world: World) -> None:
    """Exit handshake: the rank hosting the store (or the file) waits for the others to leave."""
    st = _state.prefix_store
    if st is None:
        return
    try:
        n = st.add("left", 1)
        if n == world.size:
            st.set("all_left", b"1")
        if st.check([FAILURE_KEY]) or st.check([f"wd/abort/{_state.default.gid if _state.default else 0}"]):
            # a member died or the job aborted: nobody else is coming to say goodbye, but the survivors may
            # still read the failure record from the store this rank hosts
            if _state.store_server is not None:
                _linger(_state.store_server, own=_OWN_STORE_CONNECTIONS)
            return
        if _state.store_server is not None or (_state.file_path and world.rank == 0):
            st.wait(["all_left"], timeout=min(world.timeout, 30.0))
        if _state.file_path and world.rank == 0:
            try:
                os.unlink(_state.file_path)
            except OSError:
                pass
    except StoreTimeoutError:
        logger.warning("rank %d: not every rank called destroy_process_group within the exit deadline; closing the store anyway", world.rank)
    except ProcGroupError as e:
        logger.info("rank %d: exit handshake skipped: %s", world.rank, e)


def is_initialized() -> bool:
    return _state.world is not None


def is_available() -> bool:
    return True


def is_gloo_available() -> bool:
    return True


def is_mpi_available() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def is_nccl_available() -> bool:
    return False


def is_torchelastic_launched() -> bool:
    return env_str(ENV.TORCHELASTIC_RUN_ID) is not None


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when not a member (as torch)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, "get_rank").rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, "get_world_size").size()


def get_local_rank() -> int:
    w = default_group("get_local_rank").world
    return w.local_rank


def get_local_world_size() -> int:
    return default_group("get_local_world_size").world.local_world_size


def get_node_rank() -> int:
    return default_group("get_node_rank").world.node_rank


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    g = resolve_group(group, "get_backend")
    return "gloo" if g.world.backend == "cpu" else g.world.backend


def get_process_group_ranks(group: Optional[ProcessGroup]) -> List[int]:
    return list(resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: Optional[ProcessGroup], global_rank: int) -> int:
    return resolve_group(group, "get_group_rank").group_rank_of(global_rank)


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    g = resolve_group(group, "get_global_rank")
    if not 0 <= group_rank < g.size():
        raise ConfigError(f"group rank {group_rank} is outside [0, {g.size()}) for group {g.name}")
    return g.ranks[group_rank]
