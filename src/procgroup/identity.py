"""Who am I?  Map whatever launcher started this process onto :class:`~procgroup.config.Identity`.

:func:`detect_identity` is pure: it reads only the mapping it is given (default
``os.environ``) and imports the optional ``hostlist`` package lazily; it does no
I/O.  It is what makes ``init_process_group()`` with no arguments work under
torchrun / ``procgroup run``, srun, mpirun (Open MPI), mpiexec (MPICH/Hydra)
and Kubeflow PyTorchJob.

Precedence (first match wins)
-----------------------------
1. ``RANK`` + ``WORLD_SIZE`` (torchrun, ``procgroup run``, Kubeflow, or set by
   hand).  ``source`` is ``"procgroup"`` when ``PROCGROUP_RUN_ID`` is set,
   ``"torchrun"`` when ``TORCHELASTIC_RUN_ID`` is set, ``"kubeflow"`` when
   ``KUBERNETES_SERVICE_HOST`` or any ``PET_*`` variable is set, ``"ray"`` when
   ``RAY_JOB_ID`` or ``RAY_RAYLET_PID`` is set (Ray Train's workers), else
   ``"torchrun"`` (the torchrun variable convention, set by hand).
2. An MPI launcher that started this process *inside* a Slurm job: mpirun
   (``OMPI_COMM_WORLD_RANK`` plus ORTE's ``OMPI_MCA_orte_hnp_uri``) or Hydra
   (``PMI_RANK`` plus ``MPI_LOCALNRANKS``/``HYDI_CONTROL_FD``).  Both start
   their per-node daemons with srun, so their tasks carry the *daemon step's*
   ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS`` (captured: rank 4 of
   ``mpirun -np 6`` has ``SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2``); reading
   Slurm first would give two ranks 0.  Slurm's own PMI plugins never set
   these launcher variables, so ``srun --mpi=pmi2/pmix`` still lands in 3.
3. Slurm, only inside an srun step: ``SLURM_PROCID`` and ``SLURM_STEP_ID``
   (or ``SLURM_STEPID``).  An ``sbatch``/``salloc`` shell has ``SLURM_PROCID=0``
   and ``SLURM_NTASKS=N`` but no step id, and is *not* rank 0 of N.
4. Open MPI without a Slurm step: ``OMPI_COMM_WORLD_*``.
5. MPICH / Hydra (and Intel MPI): ``PMI_RANK``/``PMI_SIZE``.
6. Nothing: :class:`ConfigError` naming the variables looked for and how to
   start the program instead.

``MASTER_ADDR`` / ``MASTER_PORT`` from the environment always win.  Every value
that was derived rather than read is explained, as a sentence, in
``Identity.derived`` (logged at init by :func:`describe_identity`).

Master address and port per launcher
------------------------------------
* torchrun / procgroup / by hand: ``MASTER_ADDR``/``MASTER_PORT`` as given
  (``None`` when unset: init must get them elsewhere).  Kubeflow: also
  ``PET_MASTER_ADDR``/``PET_MASTER_PORT``.
* Slurm: the first host of ``SLURM_STEP_NODELIST`` (fallback
  ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``): Slurm places task 0 on the
  step's first node for the block, cyclic and plane distributions (not
  necessarily with ``--distribution=arbitrary``).  It is the Slurm *NodeName*;
  where NodeName is not resolvable (NodeAddr differs) set MASTER_ADDR.
  Port: :func:`derive_port` of ``SLURM_JOB_ID`` and the step id.
* Open MPI: ``127.0.0.1`` when every rank is on this host
  (``OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE``); otherwise
  mpirun's own host, the first ``tcp://`` address of
  ``OMPI_MCA_orte_hnp_uri`` -- the same on every rank.  That is rank 0's host
  when rank 0 runs on mpirun's node (the default inside an allocation: the
  batch script, hence mpirun, runs on the first node and ranks are mapped from
  there).  It is wrong with ``mpirun --nolocal`` or ``-H`` lists that leave
  mpirun's node without rank 0 -- from a remote rank's environment that case
  looks exactly like a job that merely spills onto a second node, so it cannot
  be detected; there the mpi4py path below (or MASTER_ADDR) is needed.  Open
  MPI 5 (PRRTE) has no ``hnp_uri``: no host is derived.  Port:
  :func:`derive_port` of ``OMPI_MCA_ess_base_jobid`` (or ``PMIX_NAMESPACE``).
* MPICH / Hydra: Hydra exports no host and no job id at all (``PMI_FD``
  mode; with ``-pmi-port`` the ``PMI_PORT`` host is *this node's* proxy).
  ``127.0.0.1`` when every rank is on this host (``MPI_LOCALNRANKS ==
  PMI_SIZE``), port :data:`DEFAULT_MASTER_PORT` (two single-host jobs on one
  host then need distinct ``MASTER_PORT``).  When Hydra runs inside an srun
  step (one proxy per node, as ``mpiexec`` in an ``sbatch`` does) the host is
  the first node of that step and the port derives from its job and step id.
  Otherwise no host is derived.
* Under MPI, when ``MASTER_ADDR`` is not in the environment, init calls
  :func:`resolve_master` (on every rank, right after :func:`detect_identity`:
  it is collective), which asks :func:`resolve_master_via_mpi` (only if
  ``mpi4py`` is importable) for rank 0's real address and a free port, MPI-
  broadcast to all ranks; that replaces the derived guess.  Without mpi4py and
  with no derived host, init fails with a message saying what to set.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping, Optional

from .config import (
    DEFAULT_MASTER_PORT,
    ENV,
    KUBEFLOW,
    MPICH,
    OPENMPI,
    SLURM,
    Identity,
    check_master_port,
    env_int,
    env_str,
)
from .errors import ConfigError, NoIdentityError
from .scheduler_formats import (
    PORT_BASE,
    PORT_SPAN,
    daemon_vpid,
    derive_port,
    expand_hostlist,
    hnp_host,
    parse_tasks_per_node,
)

__all__ = [
    "detect_identity",
    "describe_identity",
    "resolve_master",
    "torchelastic_launched",
    "resolve_master_via_mpi",
    "derive_port",
    "expand_hostlist",
    "parse_tasks_per_node",
    "PORT_BASE",
    "PORT_SPAN",
    "DEFAULT_MASTER_PORT",
]

_HOW_TO_START = (
    "set RANK and WORLD_SIZE (and MASTER_ADDR, MASTER_PORT), or start the program with "
    "`procgroup run`, torchrun, srun (inside a Slurm allocation), mpirun (Open MPI) or mpiexec (MPICH)"
)


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass
class _Draft:
    """Identity under construction, with the variable each field came from (for messages)."""

    source: str
    rank: int
    world_size: int
    rank_var: str
    world_var: str
    local_rank: int = 0
    local_world_size: int = 1
    local_rank_var: str = "local rank"
    local_world_var: str = "local world size"
    node_rank: int = 0
    num_nodes: Optional[int] = None
    node_rank_var: str = "node rank"
    num_nodes_var: str = "number of nodes"
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    job_id: Optional[str] = None
    derived: list[str] = dataclasses.field(default_factory=list)
    #: the local rank, local world size and node rank are unknown here: the group measures them at rendezvous
    layout_measured: bool = False

    def note(self, text: str) -> None:
        self.derived.append(text)


def _first(env: Mapping[str, str], *names: str) -> tuple[Optional[str], Optional[str]]:
    """(name, value) of the first set, non-empty variable."""
    for n in names:
        v = env_str(n, env)
        if v is not None:
            return n, v
    return None, None


def _first_int(env: Mapping[str, str], *names: str) -> tuple[Optional[str], Optional[int]]:
    for n in names:
        v = env_int(n, env)
        if v is not None:
            return n, v
    return None, None


def _require_int(env: Mapping[str, str], name: str, why: str) -> int:
    v = env_int(name, env)
    if v is None:
        raise ConfigError(f"{name} is not set; {why}")
    return v


def _check_range(value: int, var: str, upper: int, upper_var: str) -> None:
    if not 0 <= value < upper:
        raise ConfigError(
            f"{var}={value} is out of range: it must be in [0, {upper_var}={upper}); "
            f"the launcher's variables disagree: fix {var} or {upper_var}"
        )


def _validate(d: _Draft) -> None:
    if d.world_size < 1:
        raise ConfigError(
            f"{d.world_var}={d.world_size} is not a valid world size (it must be >= 1: the number of processes in "
            f"the job); set {d.world_var} to the job's process count on every rank"
        )
    _check_range(d.rank, d.rank_var, d.world_size, d.world_var)
    if d.local_world_size < 1:
        raise ConfigError(
            f"{d.local_world_var}={d.local_world_size} is not a valid local world size (it must be >= 1: the "
            f"processes on this node); fix {d.local_world_var}"
        )
    _check_range(d.local_rank, d.local_rank_var, d.local_world_size, d.local_world_var)
    if d.local_world_size > d.world_size:
        raise ConfigError(
            f"{d.local_world_var}={d.local_world_size} is larger than {d.world_var}={d.world_size}: "
            f"a node cannot hold more processes than the job; fix {d.local_world_var}"
        )
    if d.num_nodes is not None:
        if d.num_nodes < 1:
            raise ConfigError(
                f"{d.num_nodes_var}={d.num_nodes} is not a valid number of nodes (it must be >= 1); "
                f"fix {d.num_nodes_var}"
            )
        _check_range(d.node_rank, d.node_rank_var, d.num_nodes, d.num_nodes_var)
    elif d.node_rank < 0:
        raise ConfigError(f"{d.node_rank_var}={d.node_rank} is not a valid node rank (it must be >= 0); fix it")
    check_master_port(d.master_port)


def _apply_master_env(d: _Draft, env: Mapping[str, str]) -> None:
    """MASTER_ADDR / MASTER_PORT from the environment win over anything derived."""
    addr = env_str(ENV.MASTER_ADDR, env)
    port = env_int(ENV.MASTER_PORT, env)
    if addr is not None:
        d.derived = [n for n in d.derived if not n.startswith("MASTER_ADDR")]
        d.master_addr = addr
    if port is not None:
        d.derived = [n for n in d.derived if not n.startswith("MASTER_PORT")]
        d.master_port = port


def _finish(d: _Draft, env: Mapping[str, str]) -> Identity:
    _apply_master_env(d, env)
    run_id = env_str(ENV.RUN_ID, env)
    if run_id is not None:
        d.job_id = run_id
    _validate(d)
    return Identity(
        rank=d.rank,
        world_size=d.world_size,
        local_rank=d.local_rank,
        local_world_size=d.local_world_size,
        node_rank=d.node_rank,
        num_nodes=d.num_nodes,
        master_addr=d.master_addr,
        master_port=d.master_port,
        source=d.source,
        job_id=d.job_id,
        derived=tuple(d.derived),
        layout_measured=d.layout_measured,
    )


# --------------------------------------------------------------------------- torchrun / procgroup / kubeflow


def _is_kubeflow(env: Mapping[str, str]) -> bool:
    return env_str(KUBEFLOW.SERVICE_HOST, env) is not None or any(k.startswith("PET_") for k in env)


def _from_explicit(env: Mapping[str, str]) -> _Draft:
    rank = _require_int(env, ENV.RANK, "set it together with WORLD_SIZE")
    world = env_int(ENV.WORLD_SIZE, env)
    if world is None:
        raise ConfigError(f"{ENV.RANK}={rank} is set but {ENV.WORLD_SIZE} is not; set both (or neither)")
    if env_str(ENV.RUN_ID, env) is not None:
        source = "procgroup"
    elif env_str(ENV.TORCHELASTIC_RUN_ID, env) is not None:
        source = "torchrun"
    elif _is_kubeflow(env):
        source = "kubeflow"
    elif env_str("RAY_JOB_ID", env) is not None or env_str("RAY_RAYLET_PID", env) is not None:
        source = "ray"  # Ray Train's workers: the torchrun variables plus Ray's own; job id = MASTER_ADDR:MASTER_PORT
    else:
        source = "torchrun"
    d = _Draft(
        source,
        rank,
        world,
        ENV.RANK,
        ENV.WORLD_SIZE,
        local_rank_var=ENV.LOCAL_RANK,
        local_world_var=ENV.LOCAL_WORLD_SIZE,
    )
    d.job_id = env_str(ENV.RUN_ID, env) or env_str(ENV.TORCHELASTIC_RUN_ID, env) or env_str(KUBEFLOW.RDZV_ID, env)

    # nodes
    nvar, node_rank = _first_int(env, ENV.GROUP_RANK, ENV.NODE_RANK)
    mvar, num_nodes = _first_int(env, ENV.GROUP_WORLD_SIZE)
    kubeflow = _is_kubeflow(env)  # PET_* describe the pod, also when torchrun runs inside it
    if kubeflow:
        if node_rank is None:
            nvar, node_rank = _first_int(env, KUBEFLOW.NODE_RANK)
        if num_nodes is None:
            pn = env_str(KUBEFLOW.NNODES, env)
            if pn is not None and pn.isdigit():  # elastic jobs have "min:max"
                mvar, num_nodes = KUBEFLOW.NNODES, int(pn)
    if nvar is not None and node_rank is not None:  # (_first_int gives both or neither)
        d.node_rank, d.node_rank_var = node_rank, nvar
    if mvar is not None and num_nodes is not None:
        d.num_nodes, d.num_nodes_var = num_nodes, mvar

    # local
    lr = env_int(ENV.LOCAL_RANK, env)
    lws = env_int(ENV.LOCAL_WORLD_SIZE, env)
    if source == "kubeflow" and lr is None and lws is None:
        nproc = env_str(KUBEFLOW.NPROC_PER_NODE, env) or env_str(KUBEFLOW.N_PROC_PER_NODE, env)
        if nproc is not None and nproc.isdigit() and int(nproc) > 1:
            raise ConfigError(
                f"Kubeflow set nprocPerNode={nproc} ({KUBEFLOW.NPROC_PER_NODE}): then {ENV.RANK}={rank} is the "
                f"pod's index and {ENV.WORLD_SIZE}={world} counts processes, so they do not describe this process. "
                f"Start the pod's command with `procgroup run --nproc-per-node {nproc} ...` (or torchrun), "
                "which gives each process its own RANK, or set nprocPerNode to 1"
            )
        # a PyTorchJob pod runs one process: it is its own node
        d.local_rank, d.local_world_size = 0, 1
        if nvar is None:
            d.node_rank, d.node_rank_var = rank, f"{ENV.RANK} (one process per pod)"
        if mvar is None:
            d.num_nodes, d.num_nodes_var = world, f"{ENV.WORLD_SIZE} (one process per pod)"
    elif lr is None and lws is None:
        # two shells running `WORLD_SIZE=2 RANK=i python ...` on one host are two processes on one node:
        # take the layout from where the ranks really are once they meet, not from a guess of one per node
        d.layout_measured = True
        d.note(
            f"{ENV.LOCAL_RANK}=0, {ENV.LOCAL_WORLD_SIZE}=1 only until rendezvous counts the ranks on each host "
            "(neither is set)"
        )
    elif lr is not None and lws is not None:
        d.local_rank, d.local_world_size = lr, lws
    elif lr is not None:
        if d.num_nodes is not None and d.num_nodes > 0 and world % d.num_nodes == 0:
            d.local_rank, d.local_world_size = lr, world // d.num_nodes
            d.note(
                f"LOCAL_WORLD_SIZE={d.local_world_size} ({ENV.WORLD_SIZE}={world} / {d.num_nodes_var}={d.num_nodes})"
            )
        else:
            raise ConfigError(
                f"{ENV.LOCAL_RANK}={lr} is set but {ENV.LOCAL_WORLD_SIZE} is not; set {ENV.LOCAL_WORLD_SIZE} to the "
                "number of processes on this node (torchrun and `procgroup run` set both)"
            )
    else:
        if lws == 1:
            d.local_rank, d.local_world_size = 0, 1
        else:
            raise ConfigError(
                f"{ENV.LOCAL_WORLD_SIZE}={lws} is set but {ENV.LOCAL_RANK} is not; set {ENV.LOCAL_RANK} "
                "(torchrun and `procgroup run` set both)"
            )
    if d.num_nodes is None and d.local_world_size == world:
        d.num_nodes, d.num_nodes_var = 1, f"{ENV.LOCAL_WORLD_SIZE} == {ENV.WORLD_SIZE}"

    if kubeflow:
        d.master_addr = env_str(KUBEFLOW.MASTER_ADDR, env)
        d.master_port = env_int(KUBEFLOW.MASTER_PORT, env)
    return d


# --------------------------------------------------------------------------- Slurm


def _slurm_step(env: Mapping[str, str]) -> Optional[tuple[str, int]]:
    """(name, value) of the step id when this process is a task of an srun step."""
    if env_str(SLURM.PROCID, env) is None:
        return None
    n, v = _first_int(env, SLURM.STEP_ID, SLURM.STEPID)
    return None if n is None or v is None else (n, v)


def _slurm_job(env: Mapping[str, str]) -> tuple[Optional[str], Optional[str]]:
    return _first(env, SLURM.JOB_ID, SLURM.JOBID)


def _from_slurm(env: Mapping[str, str]) -> _Draft:
    step_var, step = _slurm_step(env)  # type: ignore[misc]  # srun sets SLURM_STEP_ID with SLURM_PROCID
    rank = _require_int(env, SLURM.PROCID, "srun sets it for every task")
    wvar, world = _first_int(env, SLURM.STEP_NUM_TASKS, SLURM.NTASKS, SLURM.NPROCS)
    if wvar is None or world is None:
        raise ConfigError(
            f"{SLURM.PROCID}={rank} is set but none of {SLURM.STEP_NUM_TASKS}, {SLURM.NTASKS}, {SLURM.NPROCS} is; "
            "this does not look like an srun task: start the program with srun, or set RANK and WORLD_SIZE"
        )
    d = _Draft("slurm", rank, world, SLURM.PROCID, wvar, local_rank_var=SLURM.LOCALID, node_rank_var=SLURM.NODEID)
    d.node_rank = env_int(SLURM.NODEID, env) or 0
    lr = env_int(SLURM.LOCALID, env)

    tvar, tspec = _first(env, SLURM.STEP_TASKS_PER_NODE, SLURM.TASKS_PER_NODE)
    counts = parse_tasks_per_node(tspec, var=tvar) if tvar is not None and tspec is not None else None
    nvar, nnodes = _first_int(env, SLURM.STEP_NUM_NODES)
    if counts is not None:
        if sum(counts) != world:
            raise ConfigError(
                f"{tvar}={tspec!r} places {sum(counts)} tasks but {wvar}={world}; "
                "the Slurm variables disagree (were they copied from another step?)"
            )
        if nnodes is not None and nnodes != len(counts):
            raise ConfigError(f"{tvar}={tspec!r} lists {len(counts)} nodes but {nvar}={nnodes}")
        nnodes, nvar = len(counts), nvar or f"{tvar} ({len(counts)} entries)"
    if nnodes is None:
        nvar, nnodes = _first_int(env, SLURM.NNODES)
    d.num_nodes, d.num_nodes_var = nnodes, nvar or "number of nodes"

    if counts is not None and 0 <= d.node_rank < len(counts):
        d.local_world_size, d.local_world_var = counts[d.node_rank], f"{tvar}[{SLURM.NODEID}={d.node_rank}]"
    else:
        gtids = env_str(SLURM.GTIDS, env)
        if gtids is None:
            raise ConfigError(
                f"cannot tell how many tasks run on this node: neither {SLURM.STEP_TASKS_PER_NODE} nor "
                f"{SLURM.GTIDS} is set; set LOCAL_WORLD_SIZE and LOCAL_RANK, or RANK and WORLD_SIZE"
            )
        d.local_world_size, d.local_world_var = len(gtids.split(",")), f"{SLURM.GTIDS} ({gtids})"
    d.local_rank = lr if lr is not None else 0
    if lr is None:
        d.note(f"local rank 0 ({SLURM.LOCALID} is not set)")

    _, job = _slurm_job(env)
    hvar, hspec = _first(env, SLURM.STEP_NODELIST, SLURM.JOB_NODELIST, SLURM.NODELIST)
    if env_str(ENV.MASTER_ADDR, env) is None:
        if hvar is None or hspec is None:
            raise ConfigError(
                f"cannot derive MASTER_ADDR under Slurm: {SLURM.STEP_NODELIST} is not set; set MASTER_ADDR"
            )
        hosts = expand_hostlist(hspec, var=hvar)
        d.master_addr = hosts[0]
        where = "where Slurm places task 0" if hvar == SLURM.STEP_NODELIST else f"{SLURM.STEP_NODELIST} is not set"
        d.note(f"MASTER_ADDR={hosts[0]} (first host of {hvar}={hspec}, {where})")
    if job is not None:
        d.job_id = f"{job}.{step}"
        if env_str(ENV.MASTER_PORT, env) is None:
            d.master_port = derive_port(job, step)
            d.note(
                f"MASTER_PORT={d.master_port} "
                f"({PORT_BASE} + ({SLURM.JOB_ID}={job} * 7 + {step_var}={step}) % {PORT_SPAN})"
            )
    elif env_str(ENV.MASTER_PORT, env) is None:
        raise ConfigError(f"cannot derive MASTER_PORT under Slurm: {SLURM.JOB_ID} is not set; set MASTER_PORT")
    return d


# --------------------------------------------------------------------------- Open MPI


def _from_openmpi(env: Mapping[str, str]) -> _Draft:
    rank = _require_int(env, OPENMPI.RANK, "mpirun sets it for every process")
    world = _require_int(env, OPENMPI.SIZE, f"mpirun sets it with {OPENMPI.RANK}")
    d = _Draft(
        "openmpi",
        rank,
        world,
        OPENMPI.RANK,
        OPENMPI.SIZE,
        local_rank_var=OPENMPI.LOCAL_RANK,
        local_world_var=OPENMPI.LOCAL_SIZE,
        node_rank_var="Open MPI node index",
    )
    lr, lws = env_int(OPENMPI.LOCAL_RANK, env), env_int(OPENMPI.LOCAL_SIZE, env)
    if lr is None or lws is None:
        raise ConfigError(
            f"{OPENMPI.RANK}={rank} is set but {OPENMPI.LOCAL_RANK}/{OPENMPI.LOCAL_SIZE} are not; "
            "start the program with mpirun/mpiexec, or set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE"
        )
    d.local_rank, d.local_world_size = lr, lws
    jvar, job = _first(env, OPENMPI.JOB_ID, OPENMPI.PMIX_NAMESPACE)
    d.job_id = job
    num_nodes = env_int(OPENMPI.NUM_NODES, env)
    vpid = daemon_vpid(env_str(OPENMPI.LOCAL_DAEMON_URI, env))
    if lws == world:
        d.node_rank, d.num_nodes, d.num_nodes_var = 0, 1, f"{OPENMPI.LOCAL_SIZE} == {OPENMPI.SIZE}"
    else:
        d.num_nodes, d.num_nodes_var = num_nodes, OPENMPI.NUM_NODES
        # mpirun (daemon 0) runs on the first node and starts one daemon per other allocated node, in order.
        if vpid is not None and (num_nodes is None or vpid < num_nodes):
            d.node_rank = vpid
            d.note(f"node rank {vpid} (this node's daemon number in {OPENMPI.LOCAL_DAEMON_URI}; mpirun's node is 0)")
        else:
            d.note(
                f"node rank unknown (daemon number {vpid} in {OPENMPI.LOCAL_DAEMON_URI} is not below "
                f"{OPENMPI.NUM_NODES}={num_nodes}: some allocated node runs no rank): reported as 0"
            )

    if env_str(ENV.MASTER_ADDR, env) is None:
        hnp = env_str(OPENMPI.HNP_URI, env)
        if lws == world:
            d.master_addr = "127.0.0.1"
            d.note(
                f"MASTER_ADDR=127.0.0.1 (all {world} ranks run on this host: {OPENMPI.LOCAL_SIZE} == {OPENMPI.SIZE})"
            )
        elif hnp is not None and hnp_host(hnp):
            d.master_addr = hnp_host(hnp)
            d.note(
                f"MASTER_ADDR={d.master_addr} (mpirun's host, from {OPENMPI.HNP_URI}: right when rank 0 "
                "runs on mpirun's node, the default; not with --nolocal)"
            )
        else:
            d.note(f"MASTER_ADDR unknown: ranks span hosts and {OPENMPI.HNP_URI} is not set (Open MPI 5?)")
    if env_str(ENV.MASTER_PORT, env) is None:
        if job is not None:
            d.master_port = derive_port(job)
            d.note(f"MASTER_PORT={d.master_port} (derived from {jvar}={job})")
        else:
            d.master_port = DEFAULT_MASTER_PORT
            d.note(f"MASTER_PORT={DEFAULT_MASTER_PORT} (default: no {OPENMPI.JOB_ID} to derive it from)")
    return d


# --------------------------------------------------------------------------- MPICH / Hydra


def _is_hydra(env: Mapping[str, str]) -> bool:
    return env_str(MPICH.LOCAL_SIZE, env) is not None or env_str(MPICH.HYDI_CONTROL_FD, env) is not None


def _from_mpich(env: Mapping[str, str]) -> _Draft:
    rvar, rank = _first_int(env, MPICH.RANK, MPICH.PMI_ID)
    assert rvar is not None and rank is not None
    world = env_int(MPICH.SIZE, env)
    if world is None:
        extra = (
            (
                f" ({MPICH.PMI_ID} without {MPICH.SIZE} is what `mpiexec -pmi-port` exports; run mpiexec "
                "without -pmi-port)"
            )
            if rvar == MPICH.PMI_ID
            else ""
        )
        raise ConfigError(
            f"{rvar}={rank} is set but {MPICH.SIZE} is not, so the world size is unknown{extra}; "
            "or set RANK and WORLD_SIZE"
        )
    d = _Draft(
        "mpich", rank, world, rvar, MPICH.SIZE, local_rank_var=MPICH.LOCAL_RANK, local_world_var=MPICH.LOCAL_SIZE
    )
    lr, lws = env_int(MPICH.LOCAL_RANK, env), env_int(MPICH.LOCAL_SIZE, env)
    if lr is not None and lws is not None:
        d.local_rank, d.local_world_size = lr, lws
    elif world == 1:
        pass
    else:
        d.note(f"local rank 0 of 1 ({MPICH.LOCAL_RANK}/{MPICH.LOCAL_SIZE} are not set by this process manager)")

    # Hydra inside an srun step of one proxy per node (mpiexec in an sbatch script):
    # the step describes the proxies, i.e. the nodes, and proxy 0 holds rank 0.
    step = _slurm_step(env)
    s_tasks, s_nodes = env_int(SLURM.STEP_NUM_TASKS, env), env_int(SLURM.STEP_NUM_NODES, env)
    _, s_hosts = _first(env, SLURM.STEP_NODELIST)
    _, job = _slurm_job(env)
    in_proxy_step = (
        step is not None
        and s_tasks is not None
        and s_tasks == s_nodes
        and s_hosts is not None
        and job is not None
        and lws is not None
        and lws < world
    )
    if lws is not None and lws == world:
        d.node_rank, d.num_nodes, d.num_nodes_var = 0, 1, f"{MPICH.LOCAL_SIZE} == {MPICH.SIZE}"
        if env_str(ENV.MASTER_ADDR, env) is None:
            d.master_addr = "127.0.0.1"
            d.note(f"MASTER_ADDR=127.0.0.1 (all {world} ranks run on this host: {MPICH.LOCAL_SIZE} == {MPICH.SIZE})")
        if env_str(ENV.MASTER_PORT, env) is None:
            d.master_port = DEFAULT_MASTER_PORT
            d.note(
                f"MASTER_PORT={DEFAULT_MASTER_PORT} (default: Hydra exports no job id; "
                "set MASTER_PORT to run two jobs on one host)"
            )
    elif in_proxy_step:
        assert step is not None and s_hosts is not None and job is not None  # in_proxy_step checked them
        step_var, step_id = step
        d.node_rank = env_int(SLURM.NODEID, env) or 0
        d.node_rank_var = SLURM.NODEID
        d.num_nodes, d.num_nodes_var = s_nodes, SLURM.STEP_NUM_NODES
        d.job_id = f"{job}.{step_id}"
        d.note(
            f"node rank {d.node_rank} of {s_nodes} ({SLURM.NODEID}/{SLURM.STEP_NUM_NODES} of the srun step "
            "that runs Hydra's proxies, one per node)"
        )
        if env_str(ENV.MASTER_ADDR, env) is None:
            d.master_addr = expand_hostlist(s_hosts, var=SLURM.STEP_NODELIST)[0]
            d.note(
                f"MASTER_ADDR={d.master_addr} (first host of the proxies' {SLURM.STEP_NODELIST}={s_hosts}, "
                "where Hydra places rank 0)"
            )
        if env_str(ENV.MASTER_PORT, env) is None:
            d.master_port = derive_port(job, step_id)
            d.note(
                f"MASTER_PORT={d.master_port} ({PORT_BASE} + ({SLURM.JOB_ID}={job} * 7 + {step_var}={step_id}) "
                f"% {PORT_SPAN})"
            )
    else:
        d.note("node rank unknown (Hydra exports no node index): reported as 0")
        if env_str(ENV.MASTER_ADDR, env) is None:
            d.note(
                "MASTER_ADDR unknown: ranks span hosts and Hydra exports no shared host "
                f"({MPICH.PMI_PORT}, if set, names this node's proxy)"
            )
    return d


# --------------------------------------------------------------------------- entry points


def detect_identity(environ: Optional[Mapping[str, str]] = None) -> Identity:
    """This process's :class:`Identity`, from the launcher's environment variables.

    Pure: reads only ``environ`` (default ``os.environ``).  Raises
    :class:`ConfigError` when no launcher is recognised, or when a variable is
    malformed or inconsistent (the message names the variable and its value).
    See the module docstring for the precedence and derivation rules.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    has = lambda name: env_str(name, env) is not None  # noqa: E731

    if has(ENV.RANK) or has(ENV.WORLD_SIZE):
        if not has(ENV.RANK):
            raise ConfigError(f"{ENV.WORLD_SIZE} is set but {ENV.RANK} is not; set both (or neither)")
        return _finish(_from_explicit(env), env)

    step = _slurm_step(env)
    ompi = has(OPENMPI.RANK)
    pmi = has(MPICH.RANK) or has(MPICH.PMI_ID)
    inside = (
        " (ignoring the SLURM_* variables: they describe the srun step that started the MPI launcher's "
        "daemons, not this process)"
    )
    if ompi and (step is None or has(OPENMPI.HNP_URI)):
        d = _from_openmpi(env)
        if step is not None:
            d.note("launched by mpirun inside a Slurm job" + inside)
        return _finish(d, env)
    if pmi and _is_hydra(env):
        d = _from_mpich(env)
        if step is not None:
            d.note("launched by Hydra (mpiexec) inside a Slurm job" + inside)
        return _finish(d, env)
    if step is not None:
        return _finish(_from_slurm(env), env)
    if ompi:
        return _finish(_from_openmpi(env), env)
    if pmi:
        return _finish(_from_mpich(env), env)

    _, job = _slurm_job(env)
    if job is not None:
        raise NoIdentityError(
            f"cannot tell this process's rank: {SLURM.JOB_ID}={job} is set but {SLURM.STEP_ID} is not, so this is "
            "an sbatch/salloc shell, not a task of an srun step (its SLURM_PROCID/SLURM_NTASKS describe the "
            "allocation, not this process). Start one task per process with `srun python ...`, or one "
            "`procgroup run` per node with `srun --ntasks-per-node=1 procgroup run ...`; "
            f"or {_HOW_TO_START}"
        )
    raise NoIdentityError(
        "cannot tell this process's rank and world size: none of RANK/WORLD_SIZE (torchrun, procgroup run, "
        "Kubeflow), SLURM_PROCID+SLURM_STEP_ID (srun), OMPI_COMM_WORLD_RANK/SIZE (Open MPI mpirun), "
        f"PMI_RANK/PMI_SIZE (MPICH mpiexec) is set; {_HOW_TO_START}"
    )


def describe_identity(identity: Identity) -> str:
    """One log line: ``rank 3/6 (local 1/2, node 1/3) from slurm job 7.0; master h1:23456 [derived: ...]``."""
    i = identity
    nodes = "?" if i.num_nodes is None else str(i.num_nodes)
    s = (
        f"rank {i.rank}/{i.world_size} (local {i.local_rank}/{i.local_world_size}, node {i.node_rank}/{nodes}) "
        f"from {i.source}"
    )
    if i.job_id:
        s += f" job {i.job_id}"
    if i.master_addr is None and i.master_port is None:
        s += "; master not set"
    else:
        host = i.master_addr if i.master_addr is not None else "?"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        s += f"; master {host}:{i.master_port if i.master_port is not None else '?'}"
    if i.derived:
        s += " [derived: " + "; ".join(i.derived) + "]"
    return s


# --------------------------------------------------------------------------- MPI-assisted master


def resolve_master_via_mpi(
    *, comm=None, environ: Optional[Mapping[str, str]] = None, world_size: Optional[int] = None
) -> Optional[tuple[str, int]]:
    """Rank 0's address and a free port on it, MPI-broadcast to every rank; ``None`` without mpi4py.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank must call
    it.  Importing mpi4py initializes MPI (``MPI_Init_thread``) -- that is the
    point, and it is why this is only used under an MPI launcher.  All ranks
    report their host name; if they all match, the address is ``127.0.0.1``.
    Otherwise rank 0 advertises the address of its interface that routes to
    another rank's host (``PROCGROUP_SOCKET_ADDR`` / ``PROCGROUP_SOCKET_IFNAME``
    win), which avoids Debian's "hostname -> 127.0.1.1".  The port was free
    when chosen; whoever binds it (the store) must do so promptly.

    ``world_size`` (the launcher's): when the communicator's size differs --
    mpi4py built for another MPI than the launcher's (Open MPI's mpi4py under
    MPICH's mpiexec makes every process a singleton rank 0) -- a
    :class:`ConfigError` says so instead of handing each process its own master.
    """
    try:
        from mpi4py import MPI  # optional dependency: procgroup[mpi]
    except ImportError:
        return None
    comm = MPI.COMM_WORLD if comm is None else comm
    if world_size is not None and comm.Get_size() != world_size:
        raise ConfigError(
            f"mpi4py's MPI sees {comm.Get_size()} process(es) but the launcher started {world_size}: mpi4py was "
            "built for a different MPI than the one running this job (e.g. Open MPI's mpi4py under MPICH's "
            "mpiexec); rebuild mpi4py against this MPI, or set MASTER_ADDR and MASTER_PORT"
        )
    me = socket.gethostname()
    hosts = comm.allgather(me)
    msg: Optional[tuple[Optional[str], Optional[int], Optional[str]]] = None
    if comm.Get_rank() == 0:
        try:
            from . import netutil

            if all(h == me for h in hosts):
                addr = "127.0.0.1"
            else:
                peer = next(h for h in hosts if h != me)
                addr = netutil.advertised_addr(peer, 0, os.environ if environ is None else environ)
            msg = (addr, netutil.free_port(addr), None)
        except (OSError, ConfigError) as e:
            msg = (
                None,
                None,
                f"rank 0 on {me} could not pick a rendezvous address: {e}; set MASTER_ADDR and MASTER_PORT",
            )
    addr, port, err = comm.bcast(msg, root=0)
    if err is not None:
        raise ConfigError(err)
    return str(addr), int(port)


def torchelastic_launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when torchrun (torchelastic) started this process: TORCHELASTIC_RUN_ID is set."""
    return env_str(ENV.TORCHELASTIC_RUN_ID, os.environ if environ is None else environ) is not None


def resolve_master(identity: Identity, environ: Optional[Mapping[str, str]] = None) -> Identity:
    """Complete the master address/port of an MPI-launched identity (called by init).

    Only for ``source`` openmpi/mpich and only when ``MASTER_ADDR`` is not in
    the environment (the condition is the same on every rank, so the collective
    call in :func:`resolve_master_via_mpi` is made by all or none).  With mpi4py
    the broadcast address replaces the derived guess; ``MASTER_PORT`` from the
    environment still wins over the broadcast port.  Without mpi4py the derived
    values stay, and if there is no master address a :class:`ConfigError` says
    what to set.  Other sources are returned unchanged.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if identity.source not in ("openmpi", "mpich") or env_str(ENV.MASTER_ADDR, env) is not None:
        return identity
    try:
        got = resolve_master_via_mpi(environ=env, world_size=identity.world_size)
    except ConfigError as e:
        if identity.master_addr is None:
            raise
        # every rank sees the same mismatch, so every rank keeps the derived master
        return dataclasses.replace(identity, derived=identity.derived + (f"mpi4py not used: {e}",))
    if got is None:
        if identity.master_addr is None:
            launcher = "mpirun" if identity.source == "openmpi" else "mpiexec"
            flag = "-x" if identity.source == "openmpi" else "-genv"
            example = (
                f"{launcher} -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ..."
                if flag == "-x"
                else f"{launcher} -genv MASTER_ADDR <rank 0's host> -genv MASTER_PORT 29500 ..."
            )
            raise ConfigError(
                f"cannot find the rendezvous host: this {launcher} job spans hosts and its environment names no "
                f"host that runs rank 0. Set MASTER_ADDR and MASTER_PORT for every rank (e.g. `{example}`), "
                "or pip install mpi4py (procgroup[mpi]) so rank 0 can broadcast its address"
            )
        return identity
    addr, port = got
    port_env = env_int(ENV.MASTER_PORT, env)
    notes = [n for n in identity.derived if not n.startswith(("MASTER_ADDR", "MASTER_PORT"))]
    notes.append(f"MASTER_ADDR={addr} (rank 0's address, MPI-broadcast)")
    if port_env is None:
        notes.append(f"MASTER_PORT={port} (free port on rank 0, MPI-broadcast)")
    return dataclasses.replace(
        identity, master_addr=addr, master_port=port if port_env is None else port_env, derived=tuple(notes)
    )
