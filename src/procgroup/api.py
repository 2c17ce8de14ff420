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
from .errors import ConfigError, NotInitializedError, ProcGroupError, RendezvousError, StoreTimeoutError
from .group import GID_LIMIT, ProcessGroup, World
from .rendezvous import InitMethod, parse_init_method, setup_logging

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


@dataclass
class _State:
    world: Optional[World] = None
    default: Optional[ProcessGroup] = None
    groups: List[ProcessGroup] = field(default_factory=list)
    backend: str = "cpu"
    store_server: Any = None
    file_path: Optional[str] = None
    prefix_store: Any = None
    base_store: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)


_state = _State()


class _NonMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802 - torch's spelling
        return _state.default


class GroupMember(metaclass=_GroupMemberMeta):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` is returned to non-members."""

    NON_GROUP_MEMBER = _NonMember()


class group(metaclass=_GroupMemberMeta):  # noqa: N801 - torch's spelling: dist.group.WORLD
    pass


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
    from .watchdog import Watchdog

    if isinstance(base, store_mod.TCPStore) and master is not None:
        conn = store_mod.TCPStore(master[0], master[1], secret=secret, timeout=tmo)
        world.on_close.append(conn.close)
        wstore = store_mod.PrefixStore(f"pg/{restart}", conn)
    else:
        wstore = world.store
    wd = Watchdog(wstore, world.rank, lambda: list(_state.groups), world.transport.abort).start()
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
        from .group import FAILURE_KEY

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


# ---------------------------------------------------------------------------------------------
def default_group(what: str = "this call") -> ProcessGroup:
    if _state.default is None:
        raise NotInitializedError(what)
    return _state.default


def resolve_group(group: Optional[ProcessGroup], what: str) -> ProcessGroup:
    if group is None:
        return default_group(what)
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ConfigError(f"{what}: this rank is not a member of that group (new_group returned NON_GROUP_MEMBER here)")
    if not isinstance(group, ProcessGroup):
        raise ConfigError(f"{what}: group must be a ProcessGroup from new_group(), got {type(group).__name__}")
    return group


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


# ---------------------------------------------------------------------------------------------
def _alloc_gid(parent: ProcessGroup, ranks: Sequence[int], timeout: float) -> int:
    """Agree on a world-unique id for a new group: its lowest rank allocates it through the store."""
    world = parent.world
    k = parent._child_groups
    parent._child_groups += 1
    if world.store is None:  # no store (mpi backend): deterministic ids from the parent
        gid = (parent.gid * 131 + k + 1) % GID_LIMIT or 1
        return gid
    key = f"gid/{parent.gid}/{k}/{min(ranks)}"
    if world.rank == min(ranks):
        gid = int(world.store.add("gid_counter", 1))
        world.store.set(key, str(gid).encode())
        return gid
    if world.rank in ranks:
        return int(world.store.get(key, timeout=timeout))
    return -1


def new_group(
    ranks: Optional[Sequence[int]] = None,
    timeout: Any = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
) -> Any:
    """A group of the given global ranks; every rank of the world must call it, in the same order (as torch)."""
    parent = default_group("new_group")
    world = parent.world
    rs = sorted(set(range(world.size) if ranks is None else (int(r) for r in ranks)))
    if ranks is not None and len(rs) != len(list(ranks)):
        raise ConfigError(f"new_group(ranks={list(ranks)}) lists a rank twice")
    bad = [r for r in rs if not 0 <= r < world.size]
    if bad:
        raise ConfigError(f"new_group: ranks {bad} are outside [0, {world.size})")
    if not rs:
        raise ConfigError("new_group(ranks=[]): a group needs at least one rank")
    tmo = _timeout_seconds(timeout) if timeout is not None else world.timeout
    return _make_group(parent, rs, tmo, group_desc)


def _make_group(parent: ProcessGroup, rs: List[int], tmo: float, desc: Optional[str]) -> Any:
    gid = _alloc_gid(parent, rs, tmo)
    if gid < 0:
        return GroupMember.NON_GROUP_MEMBER
    pg = ProcessGroup(parent.world, rs, gid, desc or f"group{gid}{rs if len(rs) <= 8 else ''}", tmo)
    _state.groups.append(pg)
    return pg


def new_subgroups(group_size: Optional[int] = None, group: Optional[ProcessGroup] = None, timeout: Any = None, backend: Optional[str] = None, pg_options: Any = None, group_desc: Optional[str] = None) -> Tuple[Any, List[Any]]:
    """Split the world into subgroups: one per host by default, else consecutive blocks of ``group_size``.

    Returns (the subgroup of this rank, all subgroups this rank is a member of or knows) like torch.
    """
    parent = default_group("new_subgroups")
    world = parent.world
    if group_size is None:
        order: List[str] = []
        for h in world.hosts:
            if h not in order:
                order.append(h)
        blocks = [[r for r in range(world.size) if world.hosts[r] == h] for h in order]
    else:
        if group_size <= 0 or world.size % group_size:
            raise ConfigError(f"new_subgroups(group_size={group_size}): the world size {world.size} must be a positive multiple of it")
        blocks = [list(range(i, i + group_size)) for i in range(0, world.size, group_size)]
    tmo = _timeout_seconds(timeout) if timeout is not None else world.timeout
    mine = None
    groups = []
    for b in blocks:
        g = _make_group(parent, b, tmo, group_desc)
        groups.append(g)
        if world.rank in b:
            mine = g
    return mine, groups


def split_group(
    parent_pg: Optional[ProcessGroup] = None,
    split_ranks: Optional[Sequence[Sequence[int]]] = None,
    timeout: Any = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
    *,
    color: Optional[int] = None,
    key: Optional[int] = None,
) -> Any:
    """Split ``parent_pg`` (default: world) into disjoint groups.

    Either ``split_ranks`` (torch's form: a list of disjoint global-rank lists, the same on every member),
    or MPI's ``color``/``key``: members with the same colour form a group, ordered by (key, rank);
    ``color=None`` with ``split_ranks=None`` is an error; a negative colour opts out.
    Only members of the parent call it.  Returns this rank's new group or NON_GROUP_MEMBER.
    """
    parent = resolve_group(parent_pg, "split_group")
    if not parent.is_member():
        raise ConfigError("split_group must be called by members of the parent group only")
    tmo = _timeout_seconds(timeout) if timeout is not None else parent.timeout
    if split_ranks is not None:
        if color is not None:
            raise ConfigError("split_group: pass split_ranks= or color=, not both")
        seen: set = set()
        blocks = []
        for b in split_ranks:
            b = sorted(int(r) for r in b)
            for r in b:
                if r not in parent.ranks:
                    raise ConfigError(f"split_group: rank {r} is not in the parent group {parent.ranks}")
                if r in seen:
                    raise ConfigError(f"split_group: rank {r} appears in two splits; splits must be disjoint")
                seen.add(r)
            blocks.append(b)
    else:
        if color is None:
            raise ConfigError("split_group needs split_ranks=[[...], ...] or color= (and optionally key=)")
        from .objects import all_gather_object

        mine = (int(color), int(key if key is not None else parent.rank()), parent.world.rank)
        got: List[Any] = [None] * parent.size()
        all_gather_object(got, mine, group=parent)
        colors = sorted({c for c, _, _ in got if c >= 0})
        blocks = [[g for _, _, g in sorted(t for t in got if t[0] == c)] for c in colors]
    result: Any = GroupMember.NON_GROUP_MEMBER
    for b in blocks:
        g = _make_group(parent, b, tmo, group_desc) if parent.world.rank in b else None
        if g is None:
            parent._child_groups += 1  # keep the parent's counter in step with the members of b
        else:
            result = g
    return result


# torch's ``dist.group.WORLD`` must find the class above, not the ``procgroup.group`` submodule that the
# import system sets as the package attribute of the same name (already imported at the top of this file).
import sys as _sys  # noqa: E402

setattr(_sys.modules[__name__.rpartition(".")[0]], "group", group)
