"""Process-group lifecycle and queries: init, destroy, ranks (torch.distributed-shaped).

The global state lives in :mod:`procgroup.state`, subgroup creation in :mod:`procgroup.subgroups`, and
the backends behind the registry of :mod:`procgroup.backends`.  ``init_process_group`` parses the
configuration once (:class:`~procgroup.config.RuntimeConfig`) and passes it down.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from . import store as store_mod
from .backends import WorldSpec, lookup
from .config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    Identity,
    RuntimeConfig,
    job_secret,
    torch_agent_store_in_use,
)
from .deadline import Deadline
from .debug import install_signal_handler
from .errors import (
    CollectiveMismatchError,
    ConfigError,
    DistTimeoutError,
    PeerFailureError,
    ProcGroupError,
    RendezvousError,
    StoreTimeoutError,
)
from .file_rendezvous import open_file_store
from .identity import torchelastic_launched
from .identity_guard import publish_identity_failure, resolve_identity
from .netutil import is_literal_loopback
from .process_group import ProcessGroup, World, abort_world
from .rendezvous import InitMethod, parse_init_method, setup_logging
from .state import GroupMember, _state, default_group, group, resolve_group
from .subgroups import new_group, new_subgroups, release_gid, split_group
from .telemetry import start_publisher
from .watchdog import FAILURE_KEY, Watchdog, abort_key

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


class Backend(str):
    """Backend names (torch's ``dist.Backend``)."""

    CPU = "cpu"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"


# ---------------------------------------------------------------------------------------------
def _backend_name(backend: Optional[str]) -> str:
    """torch's backend spelling ("gloo", "cpu:gloo,cuda:nccl", "undefined", None) as a registry name."""
    if backend is None:
        return "cpu"
    b = str(backend).lower()
    if ":" in b:  # torch's "cpu:gloo,cuda:nccl"
        parts = dict(p.split(":", 1) for p in b.split(",") if ":" in p)
        b = parts.get("cpu", next(iter(parts.values())))
    return "cpu" if b == "undefined" else b


@dataclass
class _Rendezvous:
    """Where the members meet: the store (and the server this rank hosts), its address, the job's key."""

    base: Any
    where: str
    job_id: str
    secret: bytes
    master: Optional[Tuple[str, int]] = None
    server: Any = None
    file_path: Optional[str] = None
    #: opens one more client connection to the store (the watchdog's); None: it has no separate connections
    connect: Optional[Callable[[], Any]] = None


def _master_address(im: InitMethod, ident: Identity) -> Tuple[str, int]:
    """The TCP store's address: tcp://host:port, else MASTER_ADDR/MASTER_PORT (or what was derived)."""
    if im.scheme == "tcp":
        assert im.host is not None and im.port is not None
        return im.host, int(im.port)
    host, port = ident.master_addr, ident.master_port
    if host is None:
        host = DEFAULT_MASTER_ADDR
        logger.info(
            "MASTER_ADDR is not set: using %s (one host); set MASTER_ADDR to rank 0's host for a multi-host job", host
        )
    if port is None:
        port = DEFAULT_MASTER_PORT
        logger.info("MASTER_PORT is not set: using %d; set MASTER_PORT to choose another", port)
    for note in ident.derived:
        (logger.warning if ident.rank == 0 else logger.info)("derived %s", note)
    return host, int(port)


def _adapt_store(store: Any) -> Any:
    """``store`` as a procgroup Store: a torch ``Store`` is wrapped (one port per job); TypeError otherwise."""
    if isinstance(store, store_mod.Store):
        return store
    if type(store).__module__.split(".")[0] == "torch":
        from .torch._store import TorchStoreAdapter

        return TorchStoreAdapter(store)
    raise TypeError(f"store= must be a procgroup or torch.distributed Store, got {type(store).__name__}")


def _torch_default_store() -> Any:
    """torch's default group's store (adapted) when torch is imported and its default group exists, else None."""
    if "torch.distributed" not in sys.modules:
        return None
    from .torch._store import default_torch_store

    return default_torch_store()


def _torch_dist_loaded() -> bool:
    """True when this process has imported torch.distributed and it is usable (never imports torch)."""
    mod = sys.modules.get("torch.distributed")
    try:
        return mod is not None and bool(mod.is_available())
    except Exception:  # noqa: BLE001 - a half-imported torch: procgroup's own store
        return False


def _torch_agent_store(host: str, port: int, timeout: float) -> Any:
    """Under torchrun, a client of the agent's torch store on MASTER_PORT (adapted), or None (no torch/agent store).

    Asks the environment first: ``procgroup run`` also sets TORCHELASTIC_RUN_ID but hosts no agent store, and
    importing torch to find that out cost every init 3-4 s on this machine.
    """
    import importlib.util

    if not torch_agent_store_in_use() or importlib.util.find_spec("torch") is None:
        return None
    from .torch._store import torch_agent_store

    return torch_agent_store(host, port, timeout)


def _open_store(im: InitMethod, store: Any, ident: Identity, cfg: RuntimeConfig, deadline: Deadline) -> _Rendezvous:
    """The given store, a FileStore (file://), or a TCPStore (tcp://, env://) hosted by rank 0.

    Raises ConnectError/PortInUseError (and kin) when the TCP store cannot be reached or hosted.
    """
    if store is not None:
        store = _adapt_store(store)
        job_id = cfg.run_id or ident.job_id or "default"
        return _Rendezvous(store, f"the given {type(store).__name__}", job_id, job_secret(cfg, job_id))
    if im.scheme == "file":
        assert im.path is not None, "parse_init_method gives every file:// URL a path"
        job_id = cfg.run_id or ident.job_id or im.path or "file"
        fstore = open_file_store(im.path, cfg.timeout, f"pg/{cfg.restart_count}")  # a stale file is moved aside
        return _Rendezvous(fstore, str(im), job_id, job_secret(cfg, job_id), file_path=im.path)
    host, port = _master_address(im, ident)
    where = f"{host}:{port}"
    shared = _torch_default_store() if im.scheme == "env" else None
    if shared is None and im.scheme == "env" and torchelastic_launched() and not cfg.store_hosted:
        shared = _torch_agent_store(host, port, deadline.remaining())
    if shared is not None:  # torch's group already holds MASTER_PORT in this process: one store per job
        job_id = cfg.run_id or ident.job_id or where
        return _Rendezvous(shared, f"torch's default store at {where}", job_id, job_secret(cfg, job_id))
    job_id = cfg.run_id or ident.job_id or where
    secret = job_secret(cfg, job_id, loopback=is_literal_loopback(host))
    server = None
    if ident.rank == 0 and not cfg.store_hosted:
        server = store_mod.StoreServer("127.0.0.1" if is_literal_loopback(host) else "0.0.0.0", port, secret=secret)
        server.start()
    try:
        base = store_mod.TCPStore(host, port, secret=secret, timeout=cfg.timeout, connect_timeout=deadline.remaining())
    except BaseException:
        if server is not None:
            server.close()
        raise
    return _Rendezvous(
        base,
        where,
        job_id,
        secret,
        master=(host, port),
        server=server,
        connect=lambda: store_mod.TCPStore(host, port, secret=secret, timeout=cfg.timeout),
    )


def _form_world(
    backend_name: str, rdv: _Rendezvous, ident: Identity, cfg: RuntimeConfig, deadline: Deadline
) -> Tuple[World, Any]:
    """Collective: the backend forms the world over the store's ``pg/<restart>`` namespace.

    On failure the store is closed; a hosting rank first lets the others read a rendezvous error.
    """
    pstore = store_mod.PrefixStore(f"pg/{cfg.restart_count}", rdv.base)
    spec = WorldSpec(
        store=pstore,
        identity=ident,
        timeout=deadline.remaining(),
        where=rdv.where,
        master=rdv.master,
        secret=rdv.secret,
        job_id=f"{rdv.job_id}/{cfg.restart_count}",
        config=cfg,
    )
    try:
        world = lookup(backend_name).create_world(spec)
        world.timeout = cfg.timeout
        world.store_host = 0 if rdv.master is not None and not cfg.store_hosted else None
    except BaseException as e:
        _close_quietly(rdv.base)
        if rdv.server is not None:
            if isinstance(e, RendezvousError):
                # let the other members read the error before the store goes away -- also those still starting
                _linger(rdv.server, at_least=RENDEZVOUS_ERROR_LINGER_S)
            rdv.server.close()
        raise
    return world, pstore


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

    ``backend``: a registered name (:mod:`procgroup.backends`; default "cpu", alias "gloo").
    ``init_method``: ``env://`` (default; MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, or the variables of
    srun / mpirun / mpiexec / Kubeflow), ``tcp://host:port`` or ``file:///path``.  ``timeout`` (seconds or a
    timedelta; default PROCGROUP_TIMEOUT or 300 s) bounds this call and is every later call's default deadline.
    The environment is parsed here, once (:meth:`RuntimeConfig.load`).

    Raises ProcGroupError when already initialized; ConfigError for an unknown or unavailable backend, a bad
    argument or a bad environment variable (named); RendezvousError and kin when the members cannot meet.
    """
    with _state.lock:
        if _state.world is not None and _state.world.forked():
            _forget_forked()  # the parent's world, inherited by fork: this child makes its own
        if _state.world is not None:
            raise ProcGroupError(
                "init_process_group was called twice: the default process group is already initialized; "
                "call destroy_process_group() first, or use new_group() for another group"
            )
        if store is not None and init_method is not None:
            raise ConfigError("pass either init_method= or store=, not both")
        name = _backend_name(backend)
        lookup(name)  # an unknown or unavailable backend fails before anything is opened
        cfg = RuntimeConfig.load(timeout=timeout)
        setup_logging(cfg.log_level)
        im = parse_init_method(init_method)
        try:
            ident = resolve_identity(im, rank, world_size)
        except ConfigError as e:  # tell the other members, who would otherwise wait their whole deadline
            args = (rank, world_size, im.rank, im.world_size)
            given = _adapt_store(store) if isinstance(store, store_mod.Store) else None
            publish_identity_failure(im, given, cfg, e, from_env=all(a in (None, -1) for a in args))
            raise
        deadline = Deadline.after(cfg.timeout)
        rdv = _open_store(im, store, ident, cfg, deadline)
        world, pstore = _form_world(name, rdv, ident, cfg, deadline)
        _state.config = cfg
        _state.store_server = rdv.server
        _state.file_path = rdv.file_path
        _state.prefix_store = pstore
        _state.base_store = rdv.base
        if rdv.connect is not None and rdv.master is not None:  # procgroup's own TCPStore: torch may share it
            _state.store_for_torch = (rdv.master, rdv.connect)
            if _torch_dist_loaded():
                from .torch._store import share_store_with_torch

                share_store_with_torch(store_for_torch)
        _install(world, group_name)
        _start_watchdog(world, rdv, cfg)


#: store connections of the process hosting the store: its client and the watchdog's
_OWN_STORE_CONNECTIONS = 2


#: after a rendezvous error, the store's host keeps serving at least this long, so members still starting up
#: (a slow interpreter start under load) connect, read the error and raise at once instead of waiting their
#: whole deadline for a store that has gone
RENDEZVOUS_ERROR_LINGER_S = 2.0


def _linger(server: Any, grace: float = 5.0, own: int = 0, at_least: float = 0.0) -> None:
    """Keep serving until every other client has gone (``own``: this process's connections), at most ``grace`` s,
    and at least ``at_least`` s."""
    dl = Deadline.after(grace)
    while not dl.expired() and (dl.elapsed() < at_least or getattr(server, "num_connections", 0) > own):
        time.sleep(0.05)


def _start_watchdog(world: World, rdv: _Rendezvous, cfg: RuntimeConfig) -> None:
    """Mismatch detection and roll call (``procgroup.watchdog``), on a store connection of its own, which
    the status records of ``procgroup top`` (``procgroup.telemetry``) share."""
    if rdv.connect is not None:
        conn = rdv.connect()
        world.on_close.append(conn.close)
        start_publisher(conn, world, lambda: [g.status() for g in list(_state.groups)], cfg.top_interval)
        wstore = store_mod.PrefixStore(f"pg/{cfg.restart_count}", conn)
    else:
        wstore = world.store
    wd = Watchdog(
        wstore, world.rank, lambda: [g.status() for g in list(_state.groups)], lambda e: abort_world(world, e)
    )
    world.on_close.append(wd.start().stop)


def _install(world: World, group_name: str) -> None:
    """Make ``world``'s group of all ranks the default group; destroy at exit; SIGUSR1 dumps state."""
    _state.world = world
    _state.backend = world.backend
    pg = ProcessGroup(world, list(range(world.size)), 0, group_name or "WORLD")
    pg.set_home_thread()
    _state.default = pg
    _state.groups = [pg]
    atexit.register(_atexit)
    install_signal_handler()


def _atexit() -> None:
    """At interpreter exit: tell the peers if an uncaught exception is ending this process, then destroy.

    Nothing in a child forked after init: the world, its store and its peers are the parent's."""
    if _state.world is not None and not _state.world.forked():
        try:
            _publish_uncaught(_state.world)
            destroy_process_group()
        except Exception as e:  # noqa: BLE001 - at exit, report and go
            logger.warning("destroy_process_group at exit: %s", e)


def _uncaught_exception() -> Optional[BaseException]:
    """The exception ending this process, if any: Python's ``sys.last_exc`` (3.12+) or ``sys.last_value``,
    which the interpreter -- and the launcher's bootstrap -- set after printing an uncaught traceback.
    None for a normal exit or ``sys.exit()``."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException) or isinstance(exc, SystemExit):
        return None
    return exc


#: set at exit when this rank's uncaught exception is the job's first failure (then a launcher stops everyone,
#: and a peer that finds this rank's store gone rightly blames it: no need to keep the store up)
_exit_state = {"first_failure_is_mine": False}


def _publish_uncaught(world: World) -> None:
    """Exit handshake, failure side: when an uncaught exception ends this rank, record it as the job's failure
    (first writer wins, as :func:`~procgroup.watchdog.first_failure`), so the peers' watchdogs fail their waits
    within one watchdog interval, naming this rank, and :func:`_leave` lingers only until they have left
    instead of waiting for a goodbye that never comes.  An uncaught PeerFailureError is an echo: it is recorded
    naming the rank that failed; a mismatch or a deadline error, which every member raises itself, is not
    recorded.  Store errors are logged and ignored (the store may be gone); nothing is raised."""
    exc = _uncaught_exception()
    st = _state.prefix_store
    if exc is None or st is None or isinstance(exc, (CollectiveMismatchError, DistTimeoutError)):
        return  # every member raises these itself (a mismatch is recorded already): nothing to tell
    if isinstance(exc, PeerFailureError) and isinstance(exc.peer, int):  # an echo: name the rank that failed
        rec = {"peer": exc.peer, "text": str(exc)}
    else:
        rec = {"peer": world.rank, "text": f"uncaught {type(exc).__name__}: {exc} (the process is exiting)"}
    try:
        first = st.compare_set(FAILURE_KEY, b"", json.dumps(rec).encode())
        _exit_state["first_failure_is_mine"] = json.loads(first).get("peer") == world.rank
    except Exception as e:  # noqa: BLE001 - any store (a user's too) may fail at exit; the handshake still runs
        logger.info("rank %d: could not record its uncaught exception in the store: %s", world.rank, e)


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - shutting down after another error
        pass


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Destroy ``group``, or everything (the default group and every subgroup) when None.

    ``GroupMember.NON_GROUP_MEMBER`` (what ``new_group`` returns to a rank outside the group) is accepted and
    nothing happens, so every rank can run the same cleanup.
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    with _state.lock:
        if _state.world is not None and _state.world.forked():
            _forget_forked()  # no goodbye, no closing: the parent still uses all of it
            return
        if group is not None and group is not _state.default:
            group.close()
            release_gid(group)
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
                if _state.torch_store_users:
                    # torch's group runs over this store (its env:// rendezvous borrowed it): keep serving it
                    # until this process exits, as torch's own rank 0 serves torch's store
                    _LENT_SERVERS.append(_state.store_server)
                else:
                    _state.store_server.close()
            _state.__init__()  # type: ignore[misc]  # reset the module state in place


#: store servers that outlive destroy_process_group because torch's group still uses them (see above)
_LENT_SERVERS: List[Any] = []


def store_for_torch(host: str, port: int) -> Any:
    """A new authenticated connection to procgroup's default-group store when it is the TCPStore at ``host:port``.

    torch's ``env://`` rendezvous calls this through :func:`procgroup.torch._store.share_store_with_torch`: when
    procgroup's group was initialized first on the same MASTER_ADDR:MASTER_PORT, torch's group runs over
    procgroup's store (keys under ``torch/``) instead of failing to bind the port procgroup's rank 0 holds.
    Returns (store, procgroup's rank, world size), or None when procgroup is not initialized or its store is
    elsewhere (torch's own handler then runs).
    """
    with _state.lock:
        shared = _state.store_for_torch
        if shared is None or _state.world is None:
            return None
        (mhost, mport), connect = shared
        if int(port) != int(mport) or not _same_host(host, mhost):
            return None
        conn = connect()
        _state.torch_store_users += 1
        return store_mod.PrefixStore("torch", conn), _state.world.rank, _state.world.size


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return set(socket.gethostbyname_ex(a)[2]) & set(socket.gethostbyname_ex(b)[2]) != set()
    except OSError:
        return False


def _forget_forked() -> None:
    """In a child forked after init: drop the parent's world without touching it (no store traffic, no
    socket shutdown, no shared memory unlinked); the groups the user still holds raise ForkedProcessError."""
    for g in _state.groups:
        g._halt = "forked"
    if _state.world is not None:
        _state.world.on_close.clear()
    _state.__init__()  # type: ignore[misc]  # reset the module state in place


def _after_fork_in_child() -> None:
    """A lock held by a thread of the parent at fork time would never be released in the child."""
    _state.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _leave(world: World) -> None:
    """Exit handshake: the rank hosting the store (or the file) waits for the others to leave."""
    st = _state.prefix_store
    if st is None:
        return
    try:
        n = st.add("left", 1)
        if n == world.size:
            st.set("all_left", b"1")
        if st.check([FAILURE_KEY]) or st.check([abort_key(_state.default.gid if _state.default else 0)]):
            # a member died or the job aborted: nobody else is coming to say goodbye, but the survivors may
            # still read the failure record from the store this rank hosts -- unless a launcher is about to stop
            # them all anyway because this rank failed first: then exit at once, with its own status
            if _state.store_server is not None and not (
                torchelastic_launched() and _exit_state["first_failure_is_mine"]
            ):
                _linger(_state.store_server, own=_OWN_STORE_CONNECTIONS + _state.torch_store_users)
            return
        if _state.store_server is not None or (_state.file_path and world.rank == 0):
            st.wait(["all_left"], timeout=min(world.timeout, 30.0))
        if _state.file_path and world.rank == 0:
            try:
                os.unlink(_state.file_path)
            except OSError:
                pass
    except StoreTimeoutError:
        logger.warning(
            "rank %d: not every rank called destroy_process_group within the exit deadline; closing the store anyway",
            world.rank,
        )
    except ProcGroupError as e:
        logger.info("rank %d: exit handshake skipped: %s", world.rank, e)


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return _state.world is not None


def is_available() -> bool:
    """Always True: procgroup's distributed package is always built."""
    return True


def is_gloo_available() -> bool:
    """True: the built-in cpu backend answers to 'gloo'."""
    return True


def is_mpi_available() -> bool:
    """True when mpi4py can be imported (torch's meaning: an MPI is usable)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def is_nccl_available() -> bool:
    """False: this build has no NCCL backend (see procgroup.backends)."""
    return False


def is_torchelastic_launched() -> bool:
    """True when torchrun started this process (TORCHELASTIC_RUN_ID is set)."""
    return torchelastic_launched()


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when not a member (as torch)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, "get_rank").rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 when not a member (as torch)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return resolve_group(group, "get_world_size").size()


def get_local_rank() -> int:
    """This process's rank among the ranks on its host; NotInitializedError before init."""
    w = default_group("get_local_rank").world
    return w.local_rank


def get_local_world_size() -> int:
    """Number of ranks on this host; NotInitializedError before init."""
    return default_group("get_local_world_size").world.local_world_size


def get_node_rank() -> int:
    """Index of this host among the job's hosts; NotInitializedError before init."""
    return default_group("get_node_rank").world.node_rank


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    """The backend name of ``group`` ('gloo' for the cpu backend, as torch reports it)."""
    g = resolve_group(group, "get_backend")
    return "gloo" if g.world.backend == "cpu" else g.world.backend


def get_process_group_ranks(group: Optional[ProcessGroup]) -> List[int]:
    """The global ranks of ``group``, in group-rank order."""
    return list(resolve_group(group, "get_process_group_ranks").ranks)


def get_group_rank(group: Optional[ProcessGroup], global_rank: int) -> int:
    """The rank within ``group`` of ``global_rank``; ConfigError when it is not a member."""
    return resolve_group(group, "get_group_rank").group_rank_of(global_rank)


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``; ConfigError when out of range."""
    g = resolve_group(group, "get_global_rank")
    if not 0 <= group_rank < g.size():
        raise ConfigError(f"group rank {group_rank} is outside [0, {g.size()}) for group {g.name}")
    return g.ranks[group_rank]
