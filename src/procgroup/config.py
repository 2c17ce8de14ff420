"""Configuration: the launcher <-> library environment contract, and frozen config objects.

This module is the *one* table of environment variables.  The launcher
(``procgroup.launcher``) writes them, the library reads them; both import the
names from here and nowhere else.  Scheduler tables (Slurm, Open MPI, MPICH,
Kubeflow) list the variables those tools set for each process; identity
detection (:mod:`procgroup.identity`) maps them onto :class:`Identity`.

Precedence everywhere: explicit argument > environment variable > default.
A bad environment value is reported with its name and value
(:func:`env_int`, :func:`env_float`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from .errors import ConfigError

__all__ = [
    "EnvVar",
    "ENV",
    "TORCHRUN",
    "SLURM",
    "OPENMPI",
    "MPICH",
    "KUBEFLOW",
    "Identity",
    "DEFAULT_TIMEOUT",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "SHM_DIR",
    "SHM_SEGMENT_PREFIX",
    "env_int",
    "env_float",
    "env_str",
    "env_bool",
    "default_timeout",
    "to_seconds",
    "ShmOptions",
    "shm_options",
    "RuntimeConfig",
    "job_secret",
    "user_secret_path",
    "store_auth_timeout",
    "DEFAULT_STORE_AUTH_TIMEOUT",
    "top_interval",
    "torch_agent_store_in_use",
    "DEFAULT_TOP_INTERVAL",
]

#: Default deadline (seconds) for init, collectives and store waits.
#: torch uses 30 minutes; we use 5 so that a broken job fails while someone
#: is still looking.  Override with PROCGROUP_TIMEOUT or timeout=.
DEFAULT_TIMEOUT = 300.0

#: Where the store listens when nothing says otherwise (one host; torchrun's defaults).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500

#: Shared-memory segments live here, named ``SHM_SEGMENT_PREFIX<job>-...`` (the launcher's cleanup reads both).
SHM_DIR = "/dev/shm"
SHM_SEGMENT_PREFIX = "procgroup-"


@dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    written_by: str = "launcher"  # launcher | user | scheduler


class ENV:
    """Names of the variables of the launcher <-> library contract.

    torchrun-compatible identity (written by ``procgroup run`` exactly as
    torchrun writes them, read by ``init_process_group``):
    """

    RANK = "RANK"
    LOCAL_RANK = "LOCAL_RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    GROUP_RANK = "GROUP_RANK"  # torchrun's name for the node rank
    NODE_RANK = "NODE_RANK"
    GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # number of nodes
    ROLE_RANK = "ROLE_RANK"
    ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
    ROLE_NAME = "ROLE_NAME"
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
    TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
    TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
    TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
    TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

    # procgroup's own
    SECRET = "PROCGROUP_SECRET"  # per-job secret (hex); HMAC key for store + transport
    TIMEOUT = "PROCGROUP_TIMEOUT"  # seconds; default deadline for every blocking call
    SOCKET_IFNAME = "PROCGROUP_SOCKET_IFNAME"  # interface whose address this rank advertises
    SOCKET_ADDR = "PROCGROUP_SOCKET_ADDR"  # address this rank advertises (wins over IFNAME)
    TRANSPORT = "PROCGROUP_TRANSPORT"  # auto | shm | tcp : force the peer transport
    STORE_HOSTED = "PROCGROUP_STORE_HOSTED"  # "1": the launcher hosts the store; rank 0 is a client
    ERROR_FILE = "PROCGROUP_ERROR_FILE"  # where a failing worker writes its traceback (JSON)
    RUN_ID = "PROCGROUP_RUN_ID"  # job id (defaults to TORCHELASTIC_RUN_ID / scheduler job id)
    RESTART_COUNT = "PROCGROUP_RESTART_COUNT"
    HOSTNAME = "PROCGROUP_HOSTNAME"  # host label used in log prefixes and reports
    LOG_LEVEL = "PROCGROUP_LOG_LEVEL"
    PROGRESS_INTERVAL = "PROCGROUP_PROGRESS_INTERVAL"  # seconds between "3/4 joined" lines
    TTY = "PROCGROUP_TTY"  # the launcher's terminal, for dist.breakpoint() in a worker
    SHM_CMA = "PROCGROUP_SHM_CMA"  # "0": no cross-memory attach (process_vm_readv/writev) for large shm data
    SHM_SPIN_US = "PROCGROUP_SHM_SPIN_US"  # how long a shm wait spins before sleeping on a futex
    SHM_SPLIT = "PROCGROUP_SHM_SPLIT"  # "0": one thread copies a large single-copy message, not two
    SHM_ARENA = "PROCGROUP_SHM_ARENA"  # "0": small collectives within a host use messages, not the shared slots
    NATIVE = "PROCGROUP_NATIVE"  # "0": the pure-Python path even where the compiled arena fast path was built
    SHM_BIG_SLOT = "PROCGROUP_SHM_BIG_SLOT"  # bytes per big shared buffer (issue 14.1); 0: no big-slot collectives
    SHM_STREAM = "PROCGROUP_SHM_STREAM"  # auto | always | never: copies into shared slots bypass the caches
    TCP_SPIN_US = "PROCGROUP_TCP_SPIN_US"  # how long a TCP wait polls its socket (yielding) before it sleeps
    HEARTBEAT_TIMEOUT = "PROCGROUP_HEARTBEAT_TIMEOUT"  # seconds: a multi-node agent this silent is lost
    CPU_BIND = "PROCGROUP_CPU_BIND"  # auto | none: the launcher binds workers that outnumber the CPUs round-robin
    # -- secret policy and store admission (issue 11 items 12-14)
    SECRET_FILE = "PROCGROUP_SECRET_FILE"  # file holding the job secret; PROCGROUP_SECRET wins over it
    STORE_AUTH_TIMEOUT = "PROCGROUP_STORE_AUTH_TIMEOUT"  # seconds a store client has to prove the secret
    XDG_CONFIG_HOME = "XDG_CONFIG_HOME"  # where the per-user secret file lives (default ~/.config)
    HOME = "HOME"
    TOP_INTERVAL = "PROCGROUP_TOP_INTERVAL"  # seconds between a rank's status records for `procgroup top`; 0: off
    RUNTIME_DIR = "PROCGROUP_RUNTIME_DIR"  # where `procgroup run` leaves run-info files for `procgroup top`
    # -- safe mode of the object collectives (issue 11 item 17)
    SAFE_OBJECTS = "PROCGROUP_SAFE_OBJECTS"  # "1": object collectives unpickle with the restricted unpickler
    SAFE_OBJECTS_ALLOW = "PROCGROUP_SAFE_OBJECTS_ALLOW"  # "mod.Cls,mod2.*": more classes safe mode admits

    @classmethod
    def table(cls) -> list[EnvVar]:
        """Human-readable table (used by ``procgroup env`` and the README)."""
        return list(_TABLE)


_TABLE = (
    EnvVar(ENV.RANK, "global rank of this process, 0..WORLD_SIZE-1"),
    EnvVar(ENV.LOCAL_RANK, "rank of this process on its node"),
    EnvVar(ENV.WORLD_SIZE, "number of processes in the job"),
    EnvVar(ENV.LOCAL_WORLD_SIZE, "number of processes on this node"),
    EnvVar(ENV.GROUP_RANK, "rank of this node (torchrun's name)"),
    EnvVar(ENV.NODE_RANK, "rank of this node"),
    EnvVar(ENV.GROUP_WORLD_SIZE, "number of nodes"),
    EnvVar(ENV.ROLE_RANK, "rank within the role (== RANK: one role)"),
    EnvVar(ENV.ROLE_WORLD_SIZE, "size of the role (== WORLD_SIZE)"),
    EnvVar(ENV.ROLE_NAME, "role name ('default')"),
    EnvVar(ENV.MASTER_ADDR, "host of the rendezvous store"),
    EnvVar(ENV.MASTER_PORT, "port of the rendezvous store"),
    EnvVar(ENV.TORCHELASTIC_RUN_ID, "job id (torchrun compatibility)"),
    EnvVar(ENV.TORCHELASTIC_RESTART_COUNT, "how many times the gang was restarted"),
    EnvVar(ENV.TORCHELASTIC_MAX_RESTARTS, "--max-restarts"),
    EnvVar(ENV.TORCHELASTIC_ERROR_FILE, "where the worker writes its error (torchrun compatibility)"),
    EnvVar(ENV.TORCHELASTIC_USE_AGENT_STORE, "torchrun hosts a torch store on MASTER_PORT in its agent (true/1)"),
    EnvVar(ENV.SECRET, "per-job secret proven by HMAC on every store and transport connection", "launcher/user"),
    EnvVar(ENV.TIMEOUT, "default deadline in seconds for every blocking call", "user"),
    EnvVar(ENV.SOCKET_IFNAME, "network interface whose address this rank advertises", "user"),
    EnvVar(ENV.SOCKET_ADDR, "address this rank advertises to its peers", "user"),
    EnvVar(ENV.TRANSPORT, "auto|shm|tcp: transport between peers on one host", "user"),
    EnvVar(ENV.STORE_HOSTED, "1 when the launcher hosts the store (rank 0 connects as a client)"),
    EnvVar(ENV.ERROR_FILE, "file a failing worker writes its traceback to"),
    EnvVar(ENV.RUN_ID, "job id"),
    EnvVar(ENV.RESTART_COUNT, "restart generation of the gang"),
    EnvVar(ENV.HOSTNAME, "host label used in log prefixes and reports"),
    EnvVar(
        ENV.HEARTBEAT_TIMEOUT,
        "launcher: seconds without a heartbeat before a node's agent is declared lost (default 2.5)",
        "user",
    ),
    EnvVar(
        ENV.CPU_BIND,
        "launcher: auto (default) binds each worker to one CPU, round-robin, when a node runs more workers than "
        "it has CPUs; none leaves them to the scheduler (--cpu-bind)",
        "user",
    ),
    EnvVar(ENV.LOG_LEVEL, "DEBUG|INFO|WARNING: procgroup's log level", "user"),
    EnvVar(ENV.PROGRESS_INTERVAL, "seconds between rendezvous progress lines", "user"),
    EnvVar(ENV.TTY, "path of the launcher's terminal; dist.breakpoint() runs pdb there"),
    EnvVar(
        ENV.SHM_CMA,
        "0 turns off cross-memory attach: the single-copy (process_vm_readv) path for shm messages >= 4-8 MiB, the "
        "one-copy reads of large collectives and a pair's split broadcast (process_vm_writev)",
        "user",
    ),
    EnvVar(
        ENV.SHM_SPIN_US,
        "microseconds every shm wait spins before it sleeps on a futex (default 50; shared-slot waits 200, "
        "300 yielding the CPU at every poll when the host has fewer CPUs than local ranks, 20 for one host's "
        "members of a group spanning hosts)",
        "user",
    ),
    EnvVar(
        ENV.SHM_SPLIT,
        "0: a single-copy shm message of 4 MiB or more is read by one thread instead of two "
        "(the default uses a second core while the sender waits)",
        "user",
    ),
    EnvVar(
        ENV.SHM_ARENA,
        "0 sends small collectives among the ranks of one host as messages instead of through shared slots (the arena)",
        "user",
    ),
    EnvVar(
        ENV.NATIVE,
        "0: the pure-Python paths even where the optional compiled ones were built (shared slots, the TCP wait)",
        "user",
    ),
    EnvVar(
        ENV.SHM_BIG_SLOT,
        "bytes of each of the two big shared buffers a rank keeps per group for collectives above 32 KiB "
        "within a host (default 1048576, less when /dev/shm is small; a multiple of 4096 >= 65536; "
        "0: those collectives use messages)",
        "user",
    ),
    EnvVar(
        ENV.SHM_STREAM,
        "auto (default) | always | never: streaming stores for copies of 8 KiB+ into shm slots (see the README)",
        "user",
    ),
    EnvVar(
        ENV.TCP_SPIN_US,
        "microseconds a rank waiting for a TCP message keeps trying its socket, yielding the CPU between tries, "
        "before it sleeps in poll (default 200; 0: it sleeps at once)",
        "user",
    ),
    # -- secret policy and store admission (issue 11 items 12-14)
    EnvVar(
        ENV.SECRET_FILE,
        "file holding the job secret (PROCGROUP_SECRET wins); without either, $XDG_CONFIG_HOME/procgroup/secret",
        "user",
    ),
    EnvVar(ENV.STORE_AUTH_TIMEOUT, "seconds a new store connection has to prove the job secret (default 5)", "user"),
    EnvVar(ENV.XDG_CONFIG_HOME, "the per-user secret file is $XDG_CONFIG_HOME/procgroup/secret", "user"),
    EnvVar(ENV.HOME, "without XDG_CONFIG_HOME, the per-user secret file is ~/.config/procgroup/secret", "user"),
    EnvVar(
        ENV.TOP_INTERVAL,
        "seconds between the status records each rank publishes to the store for `procgroup top` (default 1; 0: off)",
        "user",
    ),
    EnvVar(
        ENV.RUNTIME_DIR,
        "directory of the run-info files `procgroup run` writes and `procgroup top` reads "
        "(default $XDG_RUNTIME_DIR/procgroup, else <tmp>/procgroup-<uid>)",
        "user",
    ),
    # -- safe mode of the object collectives (issue 11 item 17)
    EnvVar(
        ENV.SAFE_OBJECTS,
        "1: object collectives unpickle peers' objects with a restricted unpickler (builtins, numpy, torch "
        "tensors and the allow-list; anything else is refused); a call's safe= wins",
        "user",
    ),
    EnvVar(
        ENV.SAFE_OBJECTS_ALLOW,
        "comma-separated module.Qualname (or module.*) entries safe mode admits besides the built-in list",
        "user",
    ),
)


class TORCHRUN:
    """Variables torchrun (and ``procgroup run``) set."""

    VARS = (
        ENV.RANK,
        ENV.LOCAL_RANK,
        ENV.WORLD_SIZE,
        ENV.LOCAL_WORLD_SIZE,
        ENV.GROUP_RANK,
        ENV.NODE_RANK,
        ENV.MASTER_ADDR,
        ENV.MASTER_PORT,
        ENV.TORCHELASTIC_RUN_ID,
    )


class SLURM:
    """Variables srun sets for each task (see infra captures in tests/data)."""

    PROCID = "SLURM_PROCID"  # global rank
    LOCALID = "SLURM_LOCALID"  # local rank
    NODEID = "SLURM_NODEID"  # node rank
    NTASKS = "SLURM_NTASKS"  # world size (also SLURM_NPROCS)
    NPROCS = "SLURM_NPROCS"
    NNODES = "SLURM_NNODES"  # also SLURM_JOB_NUM_NODES
    STEP_NUM_NODES = "SLURM_STEP_NUM_NODES"
    STEP_NODELIST = "SLURM_STEP_NODELIST"  # compressed hostlist, e.g. h[1-3]
    JOB_NODELIST = "SLURM_JOB_NODELIST"
    NODELIST = "SLURM_NODELIST"
    STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"  # e.g. "2(x3)" or "3,2"
    TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
    JOB_ID = "SLURM_JOB_ID"
    STEP_ID = "SLURM_STEP_ID"
    NODENAME = "SLURMD_NODENAME"
    STEPID = "SLURM_STEPID"  # older alias of SLURM_STEP_ID (srun sets both)
    JOBID = "SLURM_JOBID"  # older alias of SLURM_JOB_ID
    STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"  # world size of the step (SLURM_NTASKS may be the job's)
    GTIDS = "SLURM_GTIDS"  # global ranks of the tasks on this node, e.g. "0,1,2,3"


class OPENMPI:
    RANK = "OMPI_COMM_WORLD_RANK"
    SIZE = "OMPI_COMM_WORLD_SIZE"
    LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
    LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
    NODE_RANK = "OMPI_COMM_WORLD_NODE_RANK"
    JOB_ID = "OMPI_MCA_ess_base_jobid"
    HNP_URI = "OMPI_MCA_orte_hnp_uri"  # "jobid;tcp://a.b.c.d,...:port" (ORTE, Open MPI 4)
    PMIX_SERVER_URI = "PMIX_SERVER_URI2"
    LOCAL_DAEMON_URI = "OMPI_MCA_orte_local_daemon_uri"  # "jobfam.VPID;tcp://...": VPID 0 = mpirun
    NUM_NODES = "OMPI_MCA_orte_num_nodes"  # nodes that run ranks of this job
    PMIX_NAMESPACE = "PMIX_NAMESPACE"  # == ess_base_jobid under Open MPI 4
    PMIX_RANK = "PMIX_RANK"  # mpirun (Open MPI 4/5) and srun --mpi=pmix give it to every process they start
    #: libnbc's MPI_Iallreduce algorithm; backend="mpi" sets "4" (recursive doubling) before MPI_Init unless the
    #: job sets it (backends/mpi/world.py: tune_openmpi)
    IALLREDUCE_ALGORITHM = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"


class MPICH:
    """MPICH / Hydra (mpiexec.mpich) and Intel MPI."""

    RANK = "PMI_RANK"
    SIZE = "PMI_SIZE"
    LOCAL_RANK = "MPI_LOCALRANKID"
    LOCAL_SIZE = "MPI_LOCALNRANKS"
    PMI_FD = "PMI_FD"
    PMI_PORT = "PMI_PORT"  # "host:port" of the Hydra proxy
    PMI_ID = "PMI_ID"  # the rank under `mpiexec -pmi-port` (which exports no PMI_RANK / PMI_SIZE)
    HYDI_CONTROL_FD = "HYDI_CONTROL_FD"  # set by hydra_pmi_proxy only: marks a Hydra launch


class KUBEFLOW:
    """Kubeflow training-operator PyTorchJob.

    It sets MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK (one process per pod) and,
    for torchrun-style elastic jobs, the PET_* defaults of torchrun's flags.
    """

    NNODES = "PET_NNODES"
    NPROC_PER_NODE = "PET_NPROC_PER_NODE"
    NODE_RANK = "PET_NODE_RANK"
    MASTER_ADDR = "PET_MASTER_ADDR"
    MASTER_PORT = "PET_MASTER_PORT"
    RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
    RDZV_ID = "PET_RDZV_ID"
    N_PROC_PER_NODE = "PET_N_PROC_PER_NODE"  # training-operator < 1.7's name of PET_NPROC_PER_NODE
    SERVICE_HOST = "KUBERNETES_SERVICE_HOST"  # tells us we are in a pod


@dataclass(frozen=True)
class Identity:
    """Who this process is, whoever launched it."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    #: torchrun | procgroup | slurm | openmpi | mpich | kubeflow | explicit
    source: str = "explicit"
    job_id: Optional[str] = None
    #: human-readable notes about values that were derived rather than read
    #: ("MASTER_ADDR=h1 derived from SLURM_STEP_NODELIST=h[1-3]"); logged at init.
    derived: tuple[str, ...] = field(default=())
    #: no launcher said how many ranks share this node (no LOCAL_RANK/LOCAL_WORLD_SIZE): the local rank,
    #: local world size and node rank above are placeholders that the group replaces with what it
    #: measures at rendezvous
    layout_measured: bool = False


def env_str(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The variable's value, or None when unset or empty."""
    env = os.environ if environ is None else environ
    v = env.get(name)
    if v is None:
        return None
    v = v.strip()
    return v or None


def env_int(name: str, environ: Optional[Mapping[str, str]] = None, *, minimum: Optional[int] = None) -> Optional[int]:
    v = env_str(name, environ)
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        raise ConfigError(
            f"{name}={v!r} is not an integer (environment variable); set {name} to a whole number or unset it"
        ) from None
    if minimum is not None and n < minimum:
        raise ConfigError(f"{name}={n} is too small: it must be >= {minimum} (environment variable); fix {name}")
    return n


def _env_number(name: str, environ: Optional[Mapping[str, str]], bad: str, check: Any, bound: str) -> Optional[float]:
    """A numeric variable: None when unset; ConfigError ``bad`` when not a number, ``bound`` when ``check`` fails."""
    v = env_str(name, environ)
    if v is None:
        return None
    try:
        x = float(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} {bad}") from None
    if not check(x):  # comparisons also reject NaN
        raise ConfigError(f"environment variable {name}={v!r} {bound}")
    return x


def env_float(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """A variable in seconds (> 0); None when unset."""
    return _env_number(name, environ, f"is not a number of seconds; set e.g. {name}=60", lambda x: x > 0, "must be > 0")


def env_choice(name: str, choices: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> str:
    """One of ``choices`` (the first when unset); ConfigError naming the variable and the choices otherwise."""
    v = (env_str(name, environ) or choices[0]).lower()
    if v not in choices:
        raise ConfigError(f"environment variable {name}={v!r} must be one of {', '.join(choices)}")
    return v


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, environ: Optional[Mapping[str, str]] = None, default: bool = False) -> bool:
    """Parse a boolean variable; "0"/"false" are False (unlike ``bool(os.environ[...])``)."""
    v = env_str(name, environ)
    if v is None:
        return default
    lv = v.lower()
    if lv in _TRUE:
        return True
    if lv in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={v!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def check_master_port(port: Optional[int]) -> None:
    """ConfigError headed ``MASTER_PORT=99999 is not a valid TCP port (1-65535)`` unless None or in range."""
    if port is not None and not 0 < port < 65536:
        raise ConfigError(
            f"{ENV.MASTER_PORT}={port} is not a valid TCP port (1-65535); set {ENV.MASTER_PORT} to a free port "
            "on rank 0's host, e.g. 29500, the same on every rank"
        )


def master_env(environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], Optional[int]]:
    """(MASTER_ADDR, MASTER_PORT) as the environment sets them, None where unset; ConfigError (headed by the
    variable and its value) for a port that is not an integer in 1-65535."""
    port = env_int(ENV.MASTER_PORT, environ)
    check_master_port(port)
    return env_str(ENV.MASTER_ADDR, environ), port


def launcher_run_id(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The run id a launcher exported: PROCGROUP_RUN_ID, TORCHELASTIC_RUN_ID or Kubeflow's PET_RDZV_ID."""
    names = (ENV.RUN_ID, ENV.TORCHELASTIC_RUN_ID, KUBEFLOW.RDZV_ID)
    return next((v for v in (env_str(n, environ) for n in names) if v is not None), None)


def mpi_rank_of_agent(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``NAME=value`` of an MPI launcher's rank variable in the environment of a worker that an agent launcher
    (``procgroup run``, torchrun: it exports a run id and RANK) started, or None: the agent ran under
    mpirun/mpiexec/srun --mpi and its worker inherited the agent's MPI identity (issue 13 item B)."""
    if launcher_run_id(environ) is None or env_str(ENV.RANK, environ) is None:
        return None
    for name in (OPENMPI.RANK, MPICH.RANK, MPICH.PMI_ID, OPENMPI.PMIX_RANK):
        v = env_str(name, environ)
        if v is not None:
            return f"{name}={v}"
    return None


def default_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """PROCGROUP_TIMEOUT or DEFAULT_TIMEOUT."""
    t = env_float(ENV.TIMEOUT, environ)
    return DEFAULT_TIMEOUT if t is None else t


# ------------------------------------------------------------------------------------------------- parsed once
def to_seconds(value: Any, name: str = "timeout") -> Optional[float]:
    """``value`` (seconds as a number, or a ``datetime.timedelta`` as torch takes) as float seconds > 0.

    None stays None (the caller's default applies).  Anything else is a :class:`ConfigError` naming ``name``.
    """
    if value is None:
        return None
    total = getattr(value, "total_seconds", None)
    if callable(total):
        value = total()
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number of seconds or a timedelta") from None
    if not t > 0:  # also rejects NaN
        raise ConfigError(f"{name}={value!r} must be > 0 seconds")
    return t


def env_micros(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """A variable in microseconds (>= 0); None when unset."""
    return _env_number(
        name, environ, f"is not a number of microseconds; e.g. {name}=50", lambda x: x >= 0, "must be >= 0 microseconds"
    )


@dataclass(frozen=True)
class ShmOptions:
    """Settings of the shared-memory transport (``PROCGROUP_SHM_*``), parsed once and passed down."""

    #: single-copy (process_vm_readv) path for large messages
    cma: bool = True
    #: microseconds a wait spins before it sleeps on a futex; None: the transport's default
    spin_us: Optional[float] = None
    #: read a large single-copy message in two threads
    split: bool = True
    #: small collectives among the ranks of one host through shared slots
    arena: bool = True
    #: the shared slots' compiled fast path, where it was built (``PROCGROUP_NATIVE``)
    native: bool = True
    #: bytes of each big shared buffer for the larger collectives within a host (None: default; 0: none)
    big_slot: Optional[int] = None
    #: copies into the shared slots with streaming stores: "auto" | "always" | "never" (``arena.set_streaming``)
    stream: str = "auto"


def shm_options(environ: Optional[Mapping[str, str]] = None) -> ShmOptions:
    """:class:`ShmOptions` from the environment (each bad value is a ConfigError naming its variable)."""
    return ShmOptions(
        cma=env_bool(ENV.SHM_CMA, environ, default=True),
        spin_us=env_micros(ENV.SHM_SPIN_US, environ),
        split=env_bool(ENV.SHM_SPLIT, environ, default=True),
        arena=env_bool(ENV.SHM_ARENA, environ, default=True),
        native=env_bool(ENV.NATIVE, environ, default=True),
        big_slot=env_int(ENV.SHM_BIG_SLOT, environ, minimum=0),
        stream=env_choice(ENV.SHM_STREAM, ("auto", "always", "never"), environ),
    )


#: microseconds a TCP wait polls its socket before it sleeps (PROCGROUP_TCP_SPIN_US; see TcpReading._pump).  Two netns
#: hosts, ping-pong, one way: 36-44 us sleeping in poll at once, 13-14 with 200 us of spin (Open MPI: 14).  Pass 13,
#: whole jobs alternating, 500 against 200 us, 3 hosts x 2 ranks all_reduce: 64 KiB 0.92x, 256 KiB 0.98x, 1 MiB 0.95x
DEFAULT_TCP_SPIN_US = 500.0


@dataclass(frozen=True)
class TcpOptions:
    """Settings of the TCP transport (``PROCGROUP_TCP_*``), parsed once and passed down."""

    #: microseconds a wait polls its socket (yielding the CPU between tries) before it sleeps in poll
    spin_us: float = DEFAULT_TCP_SPIN_US
    #: the compiled wait for several receives at once, where it was built (``PROCGROUP_NATIVE``)
    native: bool = True


def tcp_options(environ: Optional[Mapping[str, str]] = None) -> TcpOptions:
    """:class:`TcpOptions` from the environment (a bad value is a ConfigError naming its variable)."""
    spin = env_micros(ENV.TCP_SPIN_US, environ)
    return TcpOptions(
        spin_us=DEFAULT_TCP_SPIN_US if spin is None else spin, native=env_bool(ENV.NATIVE, environ, default=True)
    )


_TRANSPORTS = ("auto", "shm", "tcp")
_LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}

#: seconds between rendezvous progress lines when PROCGROUP_PROGRESS_INTERVAL is unset
DEFAULT_PROGRESS_INTERVAL = 10.0

#: seconds between a rank's status records for `procgroup top` when PROCGROUP_TOP_INTERVAL is unset
DEFAULT_TOP_INTERVAL = 1.0


@dataclass(frozen=True)
class SafeObjects:
    """Safe mode of the object collectives: on or off, and the classes it admits besides its own list."""

    enabled: bool = False
    allowed: "tuple[str, ...]" = ()


def safe_objects(environ: Optional[Mapping[str, str]] = None) -> SafeObjects:
    """:class:`SafeObjects` from PROCGROUP_SAFE_OBJECTS and PROCGROUP_SAFE_OBJECTS_ALLOW.

    Raises ConfigError naming the variable for a value that is not a boolean, or an allow-list entry
    that is not ``module.Qualname`` / ``module.*``.
    """
    allowed = tuple(x.strip() for x in (env_str(ENV.SAFE_OBJECTS_ALLOW, environ) or "").split(",") if x.strip())
    for a in allowed:
        if "." not in a or a.startswith(".") or a.endswith("."):
            raise ConfigError(
                f"environment variable {ENV.SAFE_OBJECTS_ALLOW} has the entry {a!r}, which is not module.Qualname; "
                f"write e.g. {ENV.SAFE_OBJECTS_ALLOW}=mypkg.Point,otherpkg.*"
            )
    return SafeObjects(env_bool(ENV.SAFE_OBJECTS, environ), allowed)


def torch_agent_store_in_use(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether torchrun said it hosts a torch store in its agent (TORCHELASTIC_USE_AGENT_STORE true or 1)."""
    return (env_str(ENV.TORCHELASTIC_USE_AGENT_STORE, environ) or "").lower() in ("true", "1")


def top_interval(environ: Optional[Mapping[str, str]] = None) -> float:
    """PROCGROUP_TOP_INTERVAL (seconds >= 0; 0 turns the status records off), else DEFAULT_TOP_INTERVAL.

    Raises ConfigError naming the variable for a value that is not a number >= 0.
    """
    v = _env_number(
        ENV.TOP_INTERVAL,
        environ,
        f"is not a number of seconds; e.g. {ENV.TOP_INTERVAL}=1, or 0 to turn the status records off",
        lambda x: x >= 0,
        "must be >= 0 seconds (0 turns the status records off)",
    )
    return DEFAULT_TOP_INTERVAL if v is None else v


def _log_level(environ: Optional[Mapping[str, str]]) -> Optional[int]:
    v = env_str(ENV.LOG_LEVEL, environ)
    if v is None:
        return None
    if v.isdigit():
        return int(v)
    lv = _LOG_LEVELS.get(v.upper())
    if lv is None:
        raise ConfigError(
            f"environment variable {ENV.LOG_LEVEL}={v!r} is not a log level; use DEBUG, INFO, WARNING or ERROR"
        )
    return lv


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the library takes from the environment, read once at ``init_process_group``.

    Precedence: explicit argument > environment variable > default.  Only this module and
    :mod:`procgroup.identity` read the environment; everything below init receives this object
    (or the part of it it needs, e.g. :class:`ShmOptions`).
    """

    timeout: float = DEFAULT_TIMEOUT
    transport: str = "auto"
    socket_addr: Optional[str] = None
    socket_ifname: Optional[str] = None
    hostname: Optional[str] = None
    log_level: Optional[int] = None
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL
    store_hosted: bool = False
    run_id: Optional[str] = None
    torchelastic_run_id: Optional[str] = None
    restart_count: int = 0
    tty: Optional[str] = None
    secret: Optional[str] = field(default=None, repr=False)
    #: PROCGROUP_SECRET_FILE (used when PROCGROUP_SECRET is unset)
    secret_file: Optional[str] = None
    #: the per-user secret file, used (and created) when neither of the above is set; None: no such file
    #: (a key derived from the job id, logged)
    user_secret_file: Optional[str] = None
    shm: ShmOptions = field(default_factory=ShmOptions)
    tcp: TcpOptions = field(default_factory=TcpOptions)
    #: seconds between this rank's status records for `procgroup top` (0: none are published)
    top_interval: float = DEFAULT_TOP_INTERVAL

    @classmethod
    def load(cls, environ: Optional[Mapping[str, str]] = None, *, timeout: Any = None) -> "RuntimeConfig":
        """Parse the environment (default ``os.environ``); ``timeout`` (explicit) wins over PROCGROUP_TIMEOUT."""
        env = os.environ if environ is None else environ
        transport = (env_str(ENV.TRANSPORT, env) or "auto").lower()
        if transport not in _TRANSPORTS:
            raise ConfigError(f"environment variable {ENV.TRANSPORT}={transport!r} is not one of auto, shm, tcp")
        explicit = to_seconds(timeout)
        restart = env_int(ENV.RESTART_COUNT, env, minimum=0)
        if restart is None:
            restart = env_int(ENV.TORCHELASTIC_RESTART_COUNT, env, minimum=0)
        return cls(
            timeout=explicit if explicit is not None else default_timeout(env),
            transport=transport,
            socket_addr=env_str(ENV.SOCKET_ADDR, env),
            socket_ifname=env_str(ENV.SOCKET_IFNAME, env),
            hostname=env_str(ENV.HOSTNAME, env),
            log_level=_log_level(env),
            progress_interval=env_float(ENV.PROGRESS_INTERVAL, env) or DEFAULT_PROGRESS_INTERVAL,
            store_hosted=env_bool(ENV.STORE_HOSTED, env),
            run_id=env_str(ENV.RUN_ID, env),
            torchelastic_run_id=env_str(ENV.TORCHELASTIC_RUN_ID, env),
            restart_count=restart or 0,
            tty=env_str(ENV.TTY, env),
            secret=env_str(ENV.SECRET, env),
            secret_file=env_str(ENV.SECRET_FILE, env),
            user_secret_file=user_secret_path(env),
            shm=shm_options(env),
            tcp=tcp_options(env),
            top_interval=top_interval(env),
        )


_log = logging.getLogger("procgroup")


# --------------------------------------------------------------------------- secret policy (issue 11 items 12-14)

#: seconds a new store connection has to complete the HMAC handshake (PROCGROUP_STORE_AUTH_TIMEOUT)
DEFAULT_STORE_AUTH_TIMEOUT = 5.0


def store_auth_timeout(environ: Optional[Mapping[str, str]] = None) -> float:
    """PROCGROUP_STORE_AUTH_TIMEOUT in seconds (> 0), else :data:`DEFAULT_STORE_AUTH_TIMEOUT`; ConfigError if bad."""
    v = env_float(ENV.STORE_AUTH_TIMEOUT, environ)
    if v is None:
        return DEFAULT_STORE_AUTH_TIMEOUT
    if not v > 0:
        raise ConfigError(f"environment variable {ENV.STORE_AUTH_TIMEOUT}={v} must be a number of seconds > 0")
    return v


def user_secret_path(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``$XDG_CONFIG_HOME/procgroup/secret``, else ``$HOME/.config/procgroup/secret``; None when neither is set."""
    from .secretfile import USER_SECRET_RELPATH  # noqa: PLC0415 - file I/O helpers, needed only here

    base = env_str(ENV.XDG_CONFIG_HOME, environ)
    if base is None or not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        home = env_str(ENV.HOME, environ)
        if home is None:
            return None
        base = os.path.join(home, ".config")
    return os.path.join(base, USER_SECRET_RELPATH)


def job_secret(cfg: RuntimeConfig, job_id: str, *, loopback: bool = False) -> bytes:
    """The HMAC key of the store and the transports.

    In order: PROCGROUP_SECRET; PROCGROUP_SECRET_FILE (ConfigError when missing or empty); the per-user
    secret file (created on first use; ConfigError when it has group/other permissions); and only when
    that can be neither read nor created (e.g. a read-only home), a key derived from ``job_id`` -- which
    stops accidental cross-talk, not an attacker, so it is logged at WARNING unless the store is on a
    loopback address (``loopback``).  Where the key came from is noted for authentication errors
    (:func:`procgroup.secretfile.secret_source`).
    """
    from .secretfile import load_or_create_user_secret, note_secret_source  # noqa: PLC0415

    if cfg.secret is not None:
        key = cfg.secret.encode()
        note_secret_source(key, ENV.SECRET)
        return key
    if cfg.secret_file is not None:
        from .secretfile import read_named_secret  # noqa: PLC0415

        value = read_named_secret(cfg.secret_file, ENV.SECRET_FILE)
        if value is None:
            raise ConfigError(
                f"{ENV.SECRET_FILE}={cfg.secret_file}: no such file; create it (e.g. python -c 'import secrets; "
                f"print(secrets.token_hex(32))' > FILE; chmod 600 FILE) or unset {ENV.SECRET_FILE}"
            )
        key = value.encode()
        note_secret_source(key, f"{ENV.SECRET_FILE}={cfg.secret_file}")
        return key
    why = f"no home directory to keep a per-user secret file in (set {ENV.HOME} or {ENV.XDG_CONFIG_HOME})"
    if cfg.user_secret_file is not None:
        try:
            value, created = load_or_create_user_secret(cfg.user_secret_file)
        except OSError as e:
            why = f"the per-user secret file {cfg.user_secret_file} can be neither read nor created ({e.strerror or e})"
        else:
            if created:
                _log.info("created the per-user secret file %s (mode 0600)", cfg.user_secret_file)
            key = value.encode()
            note_secret_source(key, f"the per-user secret file {cfg.user_secret_file}")
            return key
    (_log.info if loopback else _log.warning)(
        "%s is not set and %s: the store and transport authenticate with a key derived from the job id %r, which "
        "stops accidental cross-talk but not an attacker who can reach the port; set %s (`procgroup run` sets a "
        "random one) or %s",
        ENV.SECRET,
        why,
        job_id,
        ENV.SECRET,
        ENV.SECRET_FILE,
    )
    key = ("procgroup-derived:" + job_id).encode()
    note_secret_source(key, f"a key derived from the job id {job_id!r} ({ENV.SECRET} is not set)")
    return key
