"""The launcher's configuration: frozen dataclasses built from the command line and the environment.

:class:`LaunchConfig` is everything one node's agent needs, validated on construction;
:class:`Placement` is where one node's workers sit in the job; :func:`worker_env` is the launcher's
half of the environment contract (:class:`procgroup.config.ENV`): the exact variables one worker
receives, a pure function so that every rank/node combination is unit-tested without a process.
:mod:`.cli` builds these from ``argv`` (flag > ``PET_*`` > default); the head node's
:class:`~procgroup.launcher.hosts.HeadConfig` wraps a :class:`LaunchConfig` template.
This module imports nothing else of the launcher, so every other launcher module may import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..config import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, ENV
from ..errors import ConfigError

__all__ = [
    "LaunchConfig",
    "Placement",
    "worker_env",
    "new_run_id",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TERM_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_JOIN_WINDOW",
    "PREFIX_FIELDS",
    "SINGLE_NODE_PREFIX",
    "MULTI_NODE_PREFIX",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "OVERSUBSCRIBE_PER_CPU",
    "OVERSUBSCRIBE_FLOOR",
    "check_worker_count",
    "CPU_BIND_MODES",
    "cpu_binding",
    "LOCAL_RANK_ARG_FORMS",
]

DEFAULT_TERM_TIMEOUT = 3.0
#: seconds without a heartbeat before a node's agent is declared lost (--heartbeat-timeout)
DEFAULT_HEARTBEAT_TIMEOUT = 2.5
#: elastic: seconds a membership round stays open for more nodes once MIN joined (torchrun's last call)
DEFAULT_JOIN_WINDOW = 30.0
ROLE_NAME = "default"

#: Fields available to ``--prefix-format``.
PREFIX_FIELDS = ("rank", "local_rank", "node_rank", "host", "world_size")
SINGLE_NODE_PREFIX = "[{rank}] "
MULTI_NODE_PREFIX = "[{host}:{rank}] "

#: --local-rank-arg's forms -> the option each worker gets (torch.distributed.launch: --local-rank since
#: torch 2.0, --local_rank before)
LOCAL_RANK_ARG_FORMS = {"dash": "--local-rank", "underscore": "--local_rank"}

#: Not part of the contract table: OpenMP's and CPython's own variables.
OMP_NUM_THREADS = "OMP_NUM_THREADS"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"


#: ``--nproc-per-node`` above both this many workers per CPU and OVERSUBSCRIBE_FLOOR needs --oversubscribe
OVERSUBSCRIBE_PER_CPU = 8
OVERSUBSCRIBE_FLOOR = 64


def check_worker_count(
    n: int,
    *,
    cpus: Optional[int],
    nproc_limit: Optional[int],
    pid_max: Optional[int],
    source: str = "--nproc-per-node",
) -> None:
    """Refuse ``n`` workers on this node when it is absurd for the machine (pure: the caller reads the limits).

    Raises :class:`ConfigError` naming the limit and ``--oversubscribe`` when ``n`` exceeds the user's
    process limit (``nproc_limit``, RLIMIT_NPROC's soft value; None: unlimited), half the kernel's
    ``pid_max``, or ``max(OVERSUBSCRIBE_FLOOR, OVERSUBSCRIBE_PER_CPU * cpus)``.  Spawning that many
    would take minutes and end in a failed fork or a machine too loaded to answer a signal.
    """
    fix = "pass --oversubscribe to start them anyway"
    if nproc_limit is not None and n > nproc_limit:
        raise ConfigError(
            f"{source} {n}: more workers than this user may run processes (RLIMIT_NPROC, `ulimit -u`, is "
            f"{nproc_limit}); lower {source}, raise the limit, or {fix}"
        )
    if pid_max is not None and n > pid_max // 2:
        raise ConfigError(
            f"{source} {n}: more than half the process ids this kernel hands out "
            f"(/proc/sys/kernel/pid_max is {pid_max}); lower {source}, or {fix}"
        )
    if cpus is not None and cpus > 0 and n > max(OVERSUBSCRIBE_FLOOR, OVERSUBSCRIBE_PER_CPU * cpus):
        raise ConfigError(
            f"{source} {n}: {n / cpus:.0f} workers per CPU on this {cpus}-CPU host (more than "
            f"{OVERSUBSCRIBE_PER_CPU} per CPU and {OVERSUBSCRIBE_FLOOR} in all); use --nproc-per-node auto for one "
            f"per CPU, or {fix}"
        )


#: --cpu-bind / PROCGROUP_CPU_BIND: "auto" binds workers that outnumber the node's CPUs, "none" never binds
CPU_BIND_MODES = ("auto", "none")


def cpu_binding(nproc: int, cpus: Sequence[int], mode: str) -> Optional[list[tuple[int, ...]]]:
    """The CPUs each of ``nproc`` local workers is bound to (``[i]`` for local rank i), or None to leave them unbound.

    ``cpus`` are the CPUs the agent may use (its own affinity: what srun, mpirun, a cgroup or taskset gave it).
    ``mode`` "auto" binds only when the workers outnumber them: worker i to ``cpus[i % len(cpus)]``.  Unbound,
    workers that sleep and wake at every collective were stacked by the scheduler's wake-up placement (three on
    one CPU, one alone): 4 workers on 2 CPUs, jobs of 1000 reduces of 16 KiB ran at 13-15 or at 30-46 us a call
    (slowest rank, median), bound always at 11-14.  ``procgroup bench --nproc 4``, whole runs alternating (4
    rounds, pass 19), bound against unbound: all_reduce 4 B-1 MiB 0.54-0.91x, broadcast 16-256 KiB 0.83-0.87x,
    all_gather and reduce_scatter 1-64 KiB 0.78-0.90x, all_to_all 1-256 KiB 0.88-0.95x; all_to_all 1 MiB 1.07x and
    all_gather 1-4 MiB 1.09x; the rest within 0.95-1.06x.  Round-robin beat blocks (workers 0-1 on one CPU):
    a ping-pong of ranks 0 and 1 took 2-5x as long in blocks.  With a CPU each (2 workers on 2 CPUs) binding
    bought nothing (reduce 16 KiB 1.9 against 2.5-2.7 us), so "auto" then leaves them free.  Pure: the caller
    reads the affinity.
    """
    if mode not in CPU_BIND_MODES:
        raise ConfigError(f"--cpu-bind {mode!r} must be one of {', '.join(CPU_BIND_MODES)}")
    if mode == "none" or not cpus or nproc <= len(cpus):
        return None
    order = sorted(cpus)
    return [(order[i % len(order)],) for i in range(nproc)]


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one node's agent needs; validated on construction.

    ``master_port == 0`` means "pick a free port" (``--standalone``, or node 0
    of a head-node job, which then tells the head).  ``node_rank is None``
    (several nodes, ``--node-rank`` omitted): the agents' rendezvous assigns it.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: Optional[int] = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    standalone: bool = False
    run_id: str = "none"
    max_restarts: int = 0
    term_timeout: float = DEFAULT_TERM_TIMEOUT
    log_dir: Optional[str] = None
    tee: bool = False
    ranks_filter: Optional[frozenset[int]] = None
    prefix_format: str = SINGLE_NODE_PREFIX  # "" = no prefix
    module: bool = False
    no_python: bool = False
    #: file holding the job secret (--secret-file); PROCGROUP_SECRET wins over it
    secret_file: Optional[str] = None
    #: how long the agents of a multi-node job wait for each other (seconds)
    join_timeout: float = 300.0
    #: a multi-node agent whose heartbeat stops for this long is lost (seconds); a closed connection is sooner
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    #: elastic membership (--nnodes MIN:MAX): MIN, with ``nnodes`` the MAX; None: a fixed number of nodes
    min_nnodes: Optional[int] = None
    #: elastic: once MIN nodes joined, how long a round waits for more (up to MAX) before it closes (seconds)
    join_window: float = DEFAULT_JOIN_WINDOW
    #: started by a head node over ssh (hidden --from-head): secret on stdin, stdin EOF = stop, JSON report
    from_head: bool = False
    #: "JOBID.STEPID" when the node rank, node count and master were derived from srun's variables
    slurm_step: Optional[str] = None
    #: how values were derived ("node rank 1 from SLURM_NODEID=1"), printed once by node 0
    notes: tuple[str, ...] = ()
    #: --local-rank-arg: pass each worker --local-rank=N ("dash") or --local_rank=N ("underscore") after the
    #: program, as torch.distributed.launch did; None: not at all (the environment carries LOCAL_RANK)
    local_rank_arg: Optional[str] = None
    #: --cpu-bind: "auto" binds workers that outnumber this node's CPUs round-robin (:func:`cpu_binding`)
    cpu_bind: str = "auto"

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ConfigError("no program to run: give a script (procgroup run train.py) or -m module")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be >= 1")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} must be >= 1")
        if self.node_rank is None:
            if self.nnodes == 1:
                raise ConfigError("node_rank=None (assigned at the rendezvous) needs --nnodes > 1")
        elif not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"use 0..{self.nnodes - 1} (node 0 runs on --master-addr and hosts the store)"
            )
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port (0..65535)")
        if self.master_port == 0 and not self.standalone and not (self.from_head and self.node_rank == 0):
            raise ConfigError(
                "--master-port 0 is only meaningful with --standalone; give a fixed port every node can reach"
            )
        if self.standalone and self.nnodes != 1:
            raise ConfigError(
                f"--standalone runs a single-node job, but --nnodes is {self.nnodes}: drop --standalone and give "
                "--master-addr/--master-port (the address and port of node 0)"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0")
        if not self.term_timeout >= 0:
            raise ConfigError(f"--term-timeout {self.term_timeout} must be >= 0 seconds")
        if self.module and self.no_python:
            raise ConfigError(
                "-m/--module and --no-python exclude each other: -m runs a Python module, --no-python an executable"
            )
        if not self.run_id or any(c in self.run_id for c in "/\0"):
            raise ConfigError(f"--run-id {self.run_id!r} must be non-empty and contain no '/'")
        if self.min_nnodes is not None:
            self._check_elastic()
        if not self.heartbeat_timeout > 0:
            raise ConfigError(
                f"--heartbeat-timeout {self.heartbeat_timeout} must be > 0 seconds "
                f"(or set {ENV.HEARTBEAT_TIMEOUT}; default {DEFAULT_HEARTBEAT_TIMEOUT:g})"
            )
        if not self.join_timeout > 0:
            raise ConfigError(f"--join-timeout {self.join_timeout} must be > 0 seconds")
        if self.ranks_filter is not None and self.nnodes == 1:  # several nodes: checked after the rendezvous
            bad = sorted(r for r in self.ranks_filter if not 0 <= r < self.world_size)
            if bad:
                raise ConfigError(
                    f"--ranks-filter names rank(s) {bad} but the job has ranks 0..{self.world_size - 1} "
                    f"(--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node})"
                )
        _check_prefix_format(self.prefix_format)
        if self.cpu_bind not in CPU_BIND_MODES:
            raise ConfigError(
                f"--cpu-bind {self.cpu_bind!r} must be one of {', '.join(CPU_BIND_MODES)} (or set {ENV.CPU_BIND})"
            )
        if self.local_rank_arg is not None and self.local_rank_arg not in LOCAL_RANK_ARG_FORMS:
            raise ConfigError(
                f"--local-rank-arg={self.local_rank_arg}: use --local-rank-arg (passes --local-rank=N) or "
                "--local-rank-arg=underscore (passes --local_rank=N)"
            )

    def _check_elastic(self) -> None:
        spec = f"--nnodes {self.min_nnodes}:{self.nnodes}"
        assert self.min_nnodes is not None
        if not 1 <= self.min_nnodes <= self.nnodes:
            raise ConfigError(f"{spec}: MIN must be 1..MAX")
        if self.node_rank is not None:
            raise ConfigError(
                f"{spec} is elastic: node ranks are assigned at every rendezvous (node 0 is the agent on "
                "--master-addr); drop --node-rank"
            )
        if self.standalone or self.from_head:
            raise ConfigError(f"{spec}: elastic membership needs one `procgroup run` per node (no --standalone)")
        if self.slurm_step is not None:
            raise ConfigError(f"{spec}: elastic membership is not available inside an srun step")
        if not self.join_window >= 0:
            raise ConfigError(f"--join-window {self.join_window} must be >= 0 seconds")

    @property
    def elastic(self) -> bool:
        """Whether the membership may change (``--nnodes MIN:MAX`` with MIN < MAX, or any MIN:MAX range given)."""
        return self.min_nnodes is not None

    @property
    def world_size(self) -> int:
        """nnodes x nproc_per_node: the world size when every node runs as many workers as this one."""
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """The global rank when every node runs ``nproc_per_node`` workers (see :class:`Placement`)."""
        return (self.node_rank or 0) * self.nproc_per_node + local_rank

    def format_prefix(self, local_rank: int, host: str, placement: Optional["Placement"] = None) -> str:
        """The console prefix of worker ``local_rank`` on ``host`` (``--prefix-format`` filled in; "" for none)."""
        if not self.prefix_format:
            return ""
        pl = placement or Placement.uniform(self, self.master_port)
        return self.prefix_format.format(
            rank=pl.rank(local_rank),
            local_rank=local_rank,
            node_rank=pl.node_rank,
            host=host,
            world_size=pl.world_size,
        )

    def local_rank_argv(self, local_rank: int) -> tuple[str, ...]:
        """The arguments --local-rank-arg puts between the program and its own arguments (empty without it)."""
        if self.local_rank_arg is None:
            return ()
        return (f"{LOCAL_RANK_ARG_FORMS[self.local_rank_arg]}={local_rank}",)

    def shows_rank(self, rank: int) -> bool:
        """Whether ``rank``'s output goes to the console."""
        if self.log_dir is not None and not self.tee:
            return False
        return self.ranks_filter is None or rank in self.ranks_filter


@dataclass(frozen=True)
class Placement:
    """Where this node's workers sit in the job: decided by the agents' rendezvous (several nodes)
    or by the configuration alone (one node).  Nodes may run different numbers of workers
    (a hostfile's ``slots``): global ranks are numbered node by node, in node-rank order."""

    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def uniform(cls, cfg: LaunchConfig, master_port: int) -> "Placement":
        """The placement when every node runs ``cfg.nproc_per_node`` workers (one node, or before a rendezvous)."""
        node = cfg.node_rank or 0
        return cls(
            node_rank=node,
            nnodes=cfg.nnodes,
            rank_offset=node * cfg.nproc_per_node,
            world_size=cfg.world_size,
            local_world_size=cfg.nproc_per_node,
            master_addr=cfg.master_addr,
            master_port=master_port,
        )

    def rank(self, local_rank: int) -> int:
        """The global rank of this node's worker ``local_rank``."""
        return self.rank_offset + local_rank


def new_run_id() -> str:
    """A random job id for one node: 12 hex digits (``os.urandom``, not ``uuid``, whose import costs
    the launcher ~5 ms)."""
    return os.urandom(6).hex()


def _check_prefix_format(fmt: str) -> None:
    try:
        fmt.format(**{k: 0 for k in PREFIX_FIELDS})
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"--prefix-format {fmt!r} is not a valid format string ({type(e).__name__}: {e}); "
            f"use the fields {', '.join('{' + f + '}' for f in PREFIX_FIELDS)}, e.g. '[{{host}}:{{rank}}] '"
        ) from None


def worker_env(
    cfg: LaunchConfig,
    local_rank: int,
    *,
    master_port: int,
    secret: str,
    hostname: str,
    error_file: str,
    restart_count: int = 0,
    base: Optional[Mapping[str, str]] = None,
    placement: Optional[Placement] = None,
    tty: Optional[str] = None,
) -> dict[str, str]:
    """The complete environment of worker ``local_rank`` (``base`` plus the contract variables).

    ``MASTER_ADDR:MASTER_PORT`` is where rank 0 of the *workers* hosts its
    store (``procgroup`` rank 0, or torch's: an unmodified torch.distributed
    script binds it), never the launcher's own store: the agents of a
    multi-node job rendezvous on ``--master-port`` and give the workers a
    port node 0 picked.  Hence ``PROCGROUP_STORE_HOSTED=0``.
    """
    pl = placement or Placement.uniform(cfg, master_port)
    if not 0 <= local_rank < pl.local_world_size:
        raise ConfigError(f"local rank {local_rank} out of range 0..{pl.local_world_size - 1}")
    env = dict(os.environ if base is None else base)
    rank = pl.rank(local_rank)
    env.update(
        {
            ENV.RANK: str(rank),
            ENV.LOCAL_RANK: str(local_rank),
            ENV.WORLD_SIZE: str(pl.world_size),
            ENV.LOCAL_WORLD_SIZE: str(pl.local_world_size),
            ENV.GROUP_RANK: str(pl.node_rank),
            ENV.NODE_RANK: str(pl.node_rank),
            ENV.GROUP_WORLD_SIZE: str(pl.nnodes),
            ENV.ROLE_RANK: str(rank),
            ENV.ROLE_WORLD_SIZE: str(pl.world_size),
            ENV.ROLE_NAME: ROLE_NAME,
            ENV.MASTER_ADDR: pl.master_addr,
            ENV.MASTER_PORT: str(pl.master_port),
            ENV.TORCHELASTIC_RUN_ID: cfg.run_id,
            ENV.TORCHELASTIC_RESTART_COUNT: str(restart_count),
            ENV.TORCHELASTIC_MAX_RESTARTS: str(cfg.max_restarts),
            ENV.TORCHELASTIC_ERROR_FILE: error_file,
            ENV.SECRET: secret,
            ENV.STORE_HOSTED: "0",
            ENV.ERROR_FILE: error_file,
            ENV.RUN_ID: cfg.run_id,
            ENV.RESTART_COUNT: str(restart_count),
            ENV.HOSTNAME: hostname,
            PYTHONUNBUFFERED: "1",
        }
    )
    if tty:  # the launcher's terminal: dist.breakpoint() runs pdb there (workers have none of their own)
        env[ENV.TTY] = tty
    else:
        env.pop(ENV.TTY, None)
    if OMP_NUM_THREADS not in env:
        env[OMP_NUM_THREADS] = "1"
    return env
