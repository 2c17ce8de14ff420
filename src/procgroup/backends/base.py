"""The backend interface and its registry.

A backend forms a :class:`~procgroup.process_group.World` (transport, store, host layout) from a
:class:`WorldSpec`.  It says whether it can run here (:meth:`Backend.unavailable_reason`) and how to
make it available (:meth:`Backend.install_hint`).  Backends register under one or more names;
``init_process_group(backend=...)`` and :func:`procgroup.backends.create_group` look names up here.

Adding a backend: one folder (a package) whose import calls :func:`register` with an instance of a
:class:`Backend` subclass; see ``backends/cpu/`` and the test backend under ``tests/backends/``.

A backend whose library has collectives of its own (MPI, NCCL) also sets ``World.engine`` to a
:class:`CollectiveEngine`: the collectives ask it first, and run procgroup's own algorithms over the
world's transport for whatever it declines (see ``backends/mpi/``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import Identity, RuntimeConfig
from ..errors import ConfigError
from ..process_group import World

__all__ = ["Backend", "CollectiveEngine", "WorldSpec", "register", "lookup", "names", "describe_names"]


@dataclass(frozen=True)
class WorldSpec:
    """What a backend needs to form a world (every rank passes its own; see :meth:`Backend.create_world`)."""

    #: the rendezvous store (a procgroup Store: set/get/add/compare_set/check/wait/multi_get)
    store: Any
    #: this process's rank, world size and node layout
    identity: Identity
    #: seconds the whole formation may take
    timeout: float
    #: where the rendezvous happens, for error messages ("host:port", "file:///path", "the given HashStore")
    where: str
    #: (host, port) of the TCP store, or None (a file or a given store): the address peers route towards
    master: Optional[Tuple[str, int]]
    #: the job's HMAC key for the transports
    secret: bytes
    #: unique per job and restart: names shared-memory segments and keys
    job_id: str
    #: the configuration parsed by init (transport mode, advertised address, shm options, ...)
    config: RuntimeConfig


class Backend:
    """One way of running collectives: subclass it, set :attr:`names`, implement :meth:`create_world`."""

    #: the names that select this backend; the first is its own name, the others are aliases
    names: Tuple[str, ...] = ()

    def unavailable_reason(self) -> Optional[str]:
        """None when this backend can run here, else why not (a sentence naming what is missing)."""
        return None

    def install_hint(self) -> str:
        """What to install or configure to make this backend available (empty when nothing is needed)."""
        return ""

    def prepare(self) -> None:
        """Get ready to form a world, before any rendezvous: :func:`lookup` calls it for the backend it returns.

        A backend whose library must start before the ranks meet does it here: the mpi backend initializes
        MPI (``MPI_Init`` waits for every rank, and must not run while rank 0's store is needed by the others).
        Idempotent; raises :class:`~procgroup.errors.ConfigError` when the library cannot start.
        """

    def create_world(self, spec: WorldSpec) -> World:
        """Collective: form the world of ``spec`` (every rank calls it); returns when the members are connected.

        Raises :class:`~procgroup.errors.RendezvousError` and its kin when the members cannot agree, and
        :class:`~procgroup.errors.ConfigError` for a bad setting.
        """
        raise NotImplementedError(f"backend {self.names[0] if self.names else type(self).__name__} forms no world")


class CollectiveEngine:
    """A library's own collectives (MPI's, NCCL's) behind procgroup's API: ``World.engine``.

    Each collective of :mod:`procgroup.collectives` asks the world's engine (when it has one) for an
    implementation of that op for the group, dtype and reduce op of the call.  The engine answers with a
    function of the same signature as the matching entry point of :mod:`procgroup.algorithms`, less the
    reduce kernel (``all_reduce(comm, buf)`` rather than ``all_reduce(comm, buf, kernel)``), or with None
    to decline; a declined call runs procgroup's own algorithm over the world's transport.  The answer must
    depend only on values every member of the call shares (group, dtype, op), so that all members take the
    same path.

    The function runs inside :meth:`~procgroup.process_group.ProcessGroup.run`, so the call keeps its
    sequence number, flight record and error context.  It must return only once the operation is complete,
    and must honour ``comm.deadline`` (raise :class:`~procgroup.errors.DistTimeoutError`, the operation
    left pending), the transport's ``abort`` (raise that error), and dead peers
    (:class:`~procgroup.errors.PeerFailureError` naming the peer).  Reductions receive AVG as a sum: the
    caller divides.  ``dtype`` is a numpy dtype or the string ``"bfloat16"`` (buffers are then uint16).

    Point-to-point: :meth:`isend`/:meth:`irecv` return a :class:`~procgroup.transport.base.Request` (global
    ranks, ``ANY_SOURCE`` allowed for receives, ``Status.source`` a global rank) or None to use the
    transport; the choice must depend only on the group and the user's tag, so both sides agree.

    Every method of this base class declines; a subclass overrides what its library does well.
    """

    #: shown in diagnostics
    name: str = "engine"
    #: device types (torch's ``device.type``: "cuda") whose tensors this engine carries itself; a torch tensor on
    #: such a device hands the whole call to :attr:`device_ops` (see ``backends/nccl``), before any of the
    #: dtype-keyed methods below is asked.  Empty: device tensors raise ConfigError, as on the cpu backend
    device_types: Tuple[str, ...] = ()
    #: the object whose methods (named and ordered as the API's, after the group: ``all_reduce(g, tensor, op,
    #: async_op, timeout)``, ``isend(g, peer, tag, tensor)``...) run calls with device tensors
    device_ops: Any = None

    def all_reduce(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``f(comm, buf)``: reduce ``buf`` in place over the group, or None."""
        return None

    def broadcast(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``f(comm, buf, root)``: ``root``'s ``buf`` into every member's (group ranks), or None."""
        return None

    def reduce(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``f(comm, buf, root)``: the reduction into ``root``'s ``buf`` (others' may change), or None."""
        return None

    def all_gather(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``f(comm, sendbuf, recvbuf)``: every member's ``sendbuf`` concatenated into ``recvbuf``, or None."""
        return None

    def gather(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``f(comm, sendbuf, recvbuf_or_None, root)``: concatenated into ``root``'s ``recvbuf``, or None."""
        return None

    def scatter(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``f(comm, sendbuf_or_None, recvbuf, root)``: block i of ``root``'s ``sendbuf`` to member i, or None."""
        return None

    def reduce_scatter(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``f(comm, sendbuf, recvbuf)``: block i of the reduction of ``sendbuf`` into member i's ``recvbuf``."""
        return None

    def all_to_all(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``f(comm, sendbuf, sendcounts, recvbuf, recvcounts)`` (counts in elements, per member), or None."""
        return None

    def barrier(self, group: Any) -> Optional[Callable[..., None]]:
        """``f(comm)``: return once every member has entered, or None."""
        return None

    def post_first(
        self, group: Any, op: str, fpx: int, nbytes: int, dtype: Any = None, reduce_op: Any = None, root: int = -1
    ) -> Optional[Tuple[Callable[..., Any], Callable[..., bool], Callable[[BaseException], BaseException]]]:
        """For a planned call (:class:`procgroup.plans.Plan`) of ``op`` ("all_reduce", "broadcast", "reduce",
        "all_gather", "barrier") whose tag's fingerprint bits are ``fpx``: ``(post, done, fail)``, or None.

        ``post(a, b)`` starts the operation on the call's arrays without waiting and returns a handle, or
        None when this call must take the plan's full function (then it has started nothing).  The handle's
        ``Test()`` (MPI's name) returns whether the operation has completed, without waiting;
        ``ProcessGroup.run_plan`` calls it a few times itself, and any exception it raises that is not a
        ProcGroupError goes through ``fail(exc)``, which returns the error to raise (and breaks what must break).
        ``done(deadline, handle)`` completes a handle still pending after those tests, under ``deadline``, and
        returns whether it had to wait (False: it completed within a few more polls, microseconds, and the
        call's end time is taken as its start's).  ``run_plan`` calls ``post`` before its bookkeeping (sequence
        number, flight record, deadline) and tests the handle after it, so that the bookkeeping runs while the
        operation is in flight.  ``post`` must not wait for anything."""
        return None

    def isend(self, group: Any, dst: int, tag: int, buf: Any, code: int = 0) -> Any:
        """Start sending ``buf`` to global rank ``dst`` with the user's ``tag``: a Request, or None.

        ``code``: the dtype code (``process_group.dtype_code``); a receive must match it as well as the tag.
        """
        return None

    def irecv(self, group: Any, src: int, tag: int, out: Any, code: int = 0) -> Any:
        """Start receiving into ``out`` from global rank ``src`` (or ANY_SOURCE): a Request, or None."""
        return None

    def forget_group(self, gid: int) -> None:
        """Group ``gid`` was destroyed: drop what the engine keeps for it, so a later group given the same id
        starts afresh (ids are reused)."""

    def close(self) -> None:
        """Release the engine's resources (communicators); idempotent."""


_lock = threading.Lock()
_by_name: Dict[str, Backend] = {}
_order: List[Backend] = []


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Register ``backend`` under each of its names; returns it.

    Raises :class:`ConfigError` when it has no names, or when a name is taken by another backend and not
    ``replace``.
    """
    if not backend.names:
        raise ConfigError(f"backend {type(backend).__name__} has no names: set its `names` attribute")
    keys = [n.lower() for n in backend.names]
    with _lock:
        for k in keys:
            other = _by_name.get(k)
            if other is not None and other is not backend and not replace:
                raise ConfigError(
                    f"backend name {k!r} is already registered by {type(other).__name__}; pick another name "
                    "or pass replace=True"
                )
        for k in keys:
            old = _by_name.get(k)
            if old is not None and old is not backend and old in _order:
                _order.remove(old)
            _by_name[k] = backend
        if backend not in _order:
            _order.append(backend)
    return backend


def names() -> List[str]:
    """Every registered name (aliases included), in registration order."""
    with _lock:
        return [n.lower() for b in _order for n in b.names]


def describe_names() -> str:
    """ "'cpu' (alias 'gloo'), 'mpi', 'nccl'": every registered backend with its aliases."""
    with _lock:
        parts = []
        for b in _order:
            s = repr(b.names[0].lower())
            if len(b.names) > 1:
                alias = "alias" if len(b.names) == 2 else "aliases"
                s += f" ({alias} {', '.join(repr(n.lower()) for n in b.names[1:])})"
            parts.append(s)
        return ", ".join(parts)


def _available_summary() -> str:
    with _lock:
        ok = [repr(b.names[0].lower()) for b in _order if b.unavailable_reason() is None]
        missing = [
            f"{b.names[0].lower()!r}: {b.install_hint()}"
            for b in _order
            if b.unavailable_reason() is not None and b.install_hint()
        ]
    s = f"available here: {', '.join(ok) or 'none'}"
    if missing:
        s += f"; to enable the others, {'; '.join(missing)}"
    return s


def lookup(name: str, *, what: str = "backend") -> Backend:
    """The available backend registered as ``name`` (case-insensitive), prepared (:meth:`Backend.prepare`).

    Raises :class:`ConfigError` for an unknown name (listing every registered backend and those available
    here) and for a registered but unavailable one (its reason, and what to install).
    """
    with _lock:
        b = _by_name.get(str(name).lower())
    if b is None:
        raise ConfigError(f"{what}={name!r} is not one of {describe_names()}; {_available_summary()}")
    why = b.unavailable_reason()
    if why is not None:
        hint = b.install_hint()
        raise ConfigError(f"{why}{'; ' + hint if hint else ''} ({_available_summary()})")
    b.prepare()
    return b
