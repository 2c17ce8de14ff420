"""The mpi backend's world: procgroup's store rendezvous, then MPI communicators in procgroup's rank order."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, MutableMapping, Optional

from ...config import OPENMPI, mpi_rank_of_agent
from ...deadline import Deadline
from ...errors import ConfigError, PeerFailureError, RendezvousError
from ...process_group import World
from ...rendezvous import MemberInfo, host_key, new_nonce, rendezvous
from ...transport.shm.peers import pid_namespace
from ..base import WorldSpec
from . import INSTALL_HINT
from ._waiting import Liveness
from .engine import MpiEngine
from .transport import MpiTransport

__all__ = ["build_world", "import_mpi", "refuse_agent_worker", "tune_openmpi", "IALLREDUCE_DEFAULT"]

logger = logging.getLogger("procgroup")


#: libnbc's MPI_Iallreduce algorithm under Open MPI unless the job chooses one: 4, recursive doubling.  Open MPI
#: picks its binomial tree (a reduce, then a broadcast: 2 log2(N) rounds, each one progress call or more away)
#: for every in-place call, and procgroup's all_reduce is in place; recursive doubling takes log2(N) rounds,
#: as Open MPI's blocking MPI_Allreduce does.  With 4 ranks on 2 CPUs a 4 B MPI_Iallreduce polled with Test
#: took ~11 us instead of ~15 (blocking: ~8); at N=2 it is one exchange instead of two messages in turn.
IALLREDUCE_DEFAULT = "4"


def tune_openmpi(environ: Optional[MutableMapping[str, str]] = None, started: Optional[bool] = None) -> bool:
    """Before MPI_Init: set Open MPI's libnbc MPI_Iallreduce algorithm to IALLREDUCE_DEFAULT where the job has
    not set ``OMPI_MCA_coll_libnbc_iallreduce_algorithm`` itself (its value wins; "0" restores Open MPI's own
    choice).  Returns whether it set it; nothing once mpi4py's MPI was imported (``started``; MPI read its
    parameters then).  Other MPI libraries ignore the variable."""
    env = os.environ if environ is None else environ
    if started is None:
        started = "mpi4py.MPI" in sys.modules
    if started or OPENMPI.IALLREDUCE_ALGORITHM in env:
        return False
    env[OPENMPI.IALLREDUCE_ALGORITHM] = IALLREDUCE_DEFAULT
    return True


def import_mpi() -> Any:
    """``mpi4py.MPI`` (importing it initializes MPI); ConfigError naming the fix when it cannot load."""
    tune_openmpi()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ConfigError(
            f"backend='mpi' cannot import mpi4py's MPI ({e}); {INSTALL_HINT}. With several MPI libraries "
            "installed, mpi4py picks one by MPI4PY_LIBMPI / MPI4PY_MPIABI (see docs/mpi.md)"
        ) from None
    return MPI


def refuse_agent_worker() -> None:
    """ConfigError, before MPI starts, in a worker of an agent launcher that runs under MPI.

    ``mpirun -npernode 1 procgroup run ...``: the agents are MPI processes, their workers are not, and they
    cannot become ones here: the worker inherits its agent's MPI identity (MPI_Init would abort the process,
    Open MPI: "An error occurred in MPI_Init_thread"); started clean it is a singleton, and singletons cannot
    join each other (Debian's Open MPI 4.1: MPI_Comm_connect and MPI_Comm_join fail with MPI_ERR_INTERN, and
    MPI_Init itself with an ompi-server; MPICH 4.0 ch4:ucx: MPI_Open_port, MPI_Comm_join and MPI_Comm_spawn
    fail with "not supported with ucx netmod"); MPI_Comm_spawn from the agents (Open MPI) would make the
    workers children of MPI's daemon, not of the agent that must watch and restart them (docs/mpi.md)."""
    inherited = mpi_rank_of_agent()
    if inherited is not None:
        raise ConfigError(
            f"backend='mpi': this process is a worker that `procgroup run` (or torchrun) started, and that agent "
            f"runs under an MPI launcher ({inherited} is the agent's MPI rank, inherited): the workers of such "
            "agents are not MPI processes and cannot join one. Use backend='cpu' there (the workers of every "
            "agent form one world over procgroup's own transport), or start the workers themselves as the MPI "
            "job: mpirun -np N python train.py, or srun --mpi=pmix -n N python train.py (docs/mpi.md)"
        )


def _check_launch(MPI: Any, world_size: int) -> Any:
    cw = MPI.COMM_WORLD
    cw.Set_errhandler(MPI.ERRORS_RETURN)
    if cw.Get_size() != world_size:
        raise ConfigError(
            f"backend='mpi': MPI's COMM_WORLD has {cw.Get_size()} process(es) but procgroup's world has "
            f"{world_size}: start every rank in one MPI job (mpirun -np {world_size} ..., mpiexec -n "
            f"{world_size} ..., or srun --mpi=pmix). Processes started by `procgroup run` or torchrun are not an "
            "MPI job (use backend='cpu' there); an mpi4py built for another MPI than the launcher's sees "
            "singletons (select the library with MPI4PY_LIBMPI / MPI4PY_MPIABI)"
        )
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ConfigError(
            "backend='mpi' needs MPI_THREAD_MULTIPLE (procgroup's async ops and watchdog run in threads), but "
            "MPI was initialized with a lower thread level: leave mpi4py.rc.thread_level at 'multiple' and use "
            "an MPI library built with thread support"
        )
    return cw


def build_world(spec: WorldSpec) -> World:
    """Collective: every rank calls it; returns when the store rendezvous is done and MPI's communicators exist.

    Raises ConfigError when this is not one MPI job of exactly the world's ranks (or MPI lacks thread
    support), RendezvousError (and its timeout kin) when the members cannot meet through the store.
    """
    MPI = import_mpi()
    ident, store, cfg = spec.identity, spec.store, spec.config
    deadline = Deadline.after(spec.timeout)
    cw = _check_launch(MPI, ident.world_size)
    me = MemberInfo(
        rank=ident.rank,
        world_size=ident.world_size,
        hostname=cfg.hostname or socket.gethostname(),
        host_key=host_key(),
        addr=f"mpi:{cw.Get_rank()}",  # nobody dials this backend's ranks: the field carries the MPI rank
        pid=os.getpid(),
        nonce=new_nonce(),
        local_rank=ident.local_rank,
        node_rank=ident.node_rank,
    )
    members = rendezvous(store, me, deadline, where=spec.where, progress_interval=cfg.progress_interval)
    mpi_ranks = [int(m.addr.split(":", 1)[1]) if m.addr.startswith("mpi:") else -1 for m in members]
    if sorted(mpi_ranks) != list(range(ident.world_size)):
        raise RendezvousError(
            f"backend='mpi': the ranks that met at {spec.where} are not the processes of one MPI job (their MPI "
            f"ranks are {mpi_ranks}); give every job its own MASTER_PORT or store"
        )
    store.set(f"mpi/pidns/{ident.rank}", str(pid_namespace() or 0))
    pidns = [int(v) for v in store.multi_get([f"mpi/pidns/{r}" for r in range(ident.world_size)], deadline.remaining())]
    # every member is here (the store said so): the blocking communicator calls below return promptly
    base = cw if mpi_ranks == list(range(ident.world_size)) else cw.Split(0, ident.rank)
    comms = [base.Dup() for _ in range(3)]  # transport, group 0's collectives, the user's point-to-point
    for c in comms:
        c.Set_errhandler(MPI.ERRORS_RETURN)
    hosts = [m.host_key for m in members]
    live = Liveness(
        ident.rank,
        hosts,
        [m.pid for m in members],
        [m.hostname for m in members],
        watch_pids=len(set(p for p, h in zip(pidns, hosts) if h == me.host_key)) == 1,
    )
    transport = MpiTransport(MPI, comms[0], live)
    engine = MpiEngine(MPI, comms[1], comms[2], live, int(comms[2].Get_attr(MPI.TAG_UB) or 32767))
    local = [m for m in members if m.host_key == me.host_key]
    world = World(
        rank=ident.rank,
        size=ident.world_size,
        transport=transport,
        store=store,
        hosts=hosts,
        hostnames=[m.hostname for m in members],
        local_rank=local.index(me),
        local_world_size=len(local),
        node_rank=list(dict.fromkeys(hosts)).index(me.host_key),
        backend="mpi",
        timeout=spec.timeout,
    )
    world.engine = engine
    raised: list = []
    world.on_close.append(lambda: _exit_after_failure(MPI, live, store, ident.world_size, raised))
    world.on_close.append(transport.close)
    world.on_close.append(engine.close)
    world.on_close.append(_install_excepthook(store, ident.rank, ident.world_size, me.hostname, raised))
    logger.info(
        "rank %d/%d formed the mpi group at %s in %.2fs (%s)",
        ident.rank,
        ident.world_size,
        spec.where,
        deadline.elapsed(),
        MPI.Get_library_version().strip().splitlines()[0],
    )
    return world


#: seconds a failed job's rank waits, at close, for the other survivors to leave (they print their errors)
EXIT_GRACE_S = 3.0


def _exit_after_failure(MPI: Any, live: Liveness, store: Any, size: int, raised: list) -> None:
    """After a failure, end the process with MPI_Abort at exit instead of MPI_Finalize.

    MPI_Finalize may wait for a dead peer or a collective that can no longer complete, so a rank that saw
    a peer fail (or a mismatch), or raised itself, asks mpi4py to call MPI_Abort at exit: the launcher then
    ends the whole job and nothing hangs.  First it waits (at most EXIT_GRACE_S) until the other live ranks
    have left the group, so that their own error reports get printed.
    """
    if live.aborted is None and not live.failed and not raised:
        return
    deadline = Deadline.after(EXIT_GRACE_S)
    want = size - len(live.failed)
    while not deadline.expired():
        try:
            if int(store.add("left", 0)) >= want:
                break
        except Exception:  # noqa: BLE001 - the store went away with its host: nobody left to wait for
            break
        time.sleep(0.05)
    set_abort = getattr(MPI, "_set_abort_status", None)  # mpi4py >= 3.1 (what `python -m mpi4py` uses)
    if set_abort is not None:
        set_abort(1)


def _install_excepthook(store: Any, rank: int, size: int, host: str, raised: list) -> Callable[[], None]:
    """Record an unhandled exception of this rank in the store, so that the others raise naming it.

    Under plain mpirun a raising rank would otherwise leave its peers blocked in the collective it never
    joins (the "python -m mpi4py" problem): the watchdog of every other rank reads the record within its
    interval and fails their waits with a PeerFailureError naming this rank.  Returns the uninstaller.
    """
    from ...watchdog import first_failure

    previous = sys.excepthook

    def hook(tp: Any, value: Any, tb: Any) -> None:
        raised.append(tp)
        if not isinstance(value, (KeyboardInterrupt, SystemExit)):
            text = "".join(traceback.format_exception_only(tp, value)).strip()
            if not (isinstance(value, PeerFailureError) and value.peer not in (None, rank)):
                try:
                    first_failure(store, PeerFailureError(f"rank {rank} raised {text}", peer=rank))
                except Exception:  # noqa: BLE001 - the store may be gone; the traceback still prints
                    pass
            sys.stderr.write(f"### procgroup rank {rank} of {size} on {host}\n")
        previous(tp, value, tb)

    sys.excepthook = hook

    def uninstall() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous

    return uninstall
