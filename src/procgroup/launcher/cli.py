"""``procgroup run`` command line -> a frozen :class:`~procgroup.launcher.config.LaunchConfig`.

Flags follow torchrun's.  One spelling is shown in ``--help``; torchrun's
underscore spellings (``--nproc_per_node``...) are accepted silently so that
existing command lines keep working.  Precedence: explicit flag > ``PET_*``
environment variable (Kubeflow's torchrun defaults, see
:class:`procgroup.config.KUBEFLOW`) > built-in default.

:mod:`.config` holds the dataclasses and :func:`~.config.worker_env` (the
launcher's half of the environment contract); they are re-exported here.

Modes (chosen here, from the flags and the environment):

* one node (default; ``--standalone`` picks a free port);
* per-node multi-node (``--nnodes M``; one ``procgroup run`` per node, torchrun's
  static rendezvous): the agents rendezvous through a store that node 0's
  agent hosts at ``--master-addr:--master-port``; ``--node-rank`` omitted
  means "by host name, the master host first" (see :mod:`.gang`);
* srun (inside an ``srun --ntasks-per-node=1`` step, with none of
  ``--nnodes/--node-rank/--master-addr/--master-port/--standalone``): the
  same, with every value derived from Slurm's variables (:mod:`.slurm`);
* head node (``--hostfile``): :class:`procgroup.launcher.hosts.HeadConfig`,
  one agent per host started over ssh (:mod:`.hosts`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Mapping, Optional, Sequence, Union

from ..config import ENV, KUBEFLOW, default_timeout, env_float, env_str
from ..errors import ConfigError
from .config import (
    CPU_BIND_MODES,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_JOIN_WINDOW,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_TERM_TIMEOUT,
    LOCAL_RANK_ARG_FORMS,
    MULTI_NODE_PREFIX,
    OMP_NUM_THREADS,
    PREFIX_FIELDS,
    PYTHONUNBUFFERED,
    SINGLE_NODE_PREFIX,
    LaunchConfig,
    Placement,
    check_worker_count,
    new_run_id,
    worker_env,
)
from .hosts import DEFAULT_ENV_PREFIXES, EnvPolicy, HeadConfig, parse_hostfile

__all__ = [
    "LaunchConfig",
    "Placement",
    "build_parser",
    "parse_args",
    "worker_env",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TERM_TIMEOUT",
    "PREFIX_FIELDS",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "new_run_id",
]

# --------------------------------------------------------------------------- argparse


def _pet(dest: str, environ: Mapping[str, str]) -> Optional[str]:
    """The Kubeflow ``PET_*`` default for a flag, when :class:`KUBEFLOW` lists one."""
    name = getattr(KUBEFLOW, dest.upper(), None)
    return env_str(name, environ) if isinstance(name, str) else None


def build_parser(prog: str = "procgroup run") -> argparse.ArgumentParser:
    """The argparse parser of ``procgroup run`` (torchrun's flags; underscore spellings hidden)."""
    p = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description=(
            "Start NPROC copies of a Python program on this node as one process group "
            "(the torchrun equivalent; with --nnodes, --hostfile or under srun, on several nodes). "
            f"Each worker gets {ENV.RANK}, {ENV.WORLD_SIZE}, {ENV.LOCAL_RANK}, "
            f"{ENV.MASTER_ADDR}, {ENV.MASTER_PORT}, {ENV.SECRET} ... (see `procgroup env`). "
            "If any worker fails, the others are "
            "stopped and the first failure is reported with its traceback."
        ),
        epilog=(
            "Examples: one node: procgroup run --nproc-per-node 4 train.py --epochs 3 | "
            "one per node: PROCGROUP_SECRET=... procgroup run --nnodes 3 --node-rank K --master-addr h1 "
            "--nproc-per-node 2 train.py | head node: procgroup run --hostfile hosts train.py (lines 'HOST slots=N') | "
            "Slurm: srun -N3 --ntasks-per-node=1 procgroup run --nproc-per-node 2 train.py"
        ),
    )

    def alias(*names: str, dest: str, **kw: Any) -> None:
        # torchrun's underscore spellings: accepted, not advertised.
        p.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)

    g = p.add_argument_group("job shape")
    g.add_argument(
        "--nproc-per-node",
        dest="nproc_per_node",
        metavar="N|auto",
        default=None,
        help=f"workers on this node; 'auto' = number of CPUs (default 1, or ${KUBEFLOW.NPROC_PER_NODE})",
    )
    alias("--nproc_per_node", dest="nproc_per_node")
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        help="start --nproc-per-node workers even beyond the CPUs (8 per CPU and 64 in all), the user's "
        "process limit or half of pid_max (refused by default)",
    )
    g.add_argument(
        "--cpu-bind",
        dest="cpu_bind",
        choices=CPU_BIND_MODES,
        default=None,
        help="auto: when a node runs more workers than it has CPUs, bind worker i to CPU i mod CPUs (steadier "
        f"collectives); none: leave them to the scheduler (default ${ENV.CPU_BIND} or auto)",
    )
    g.add_argument(
        "--nnodes",
        dest="nnodes",
        metavar="M|MIN:MAX",
        default=None,
        help="number of nodes, each running one `procgroup run`; MIN:MAX for elastic membership (nodes may "
        f"come and go; see --join-window) (default 1, or ${KUBEFLOW.NNODES})",
    )
    g.add_argument(
        "--node-rank",
        dest="node_rank",
        metavar="K",
        default=None,
        help="rank of this node, 0..M-1; node 0 hosts the agents' store (default: 0 on one node; with "
        f"several, ${KUBEFLOW.NODE_RANK}, else assigned at the rendezvous: the master host first, "
        "then by host name)",
    )
    alias("--node_rank", dest="node_rank")
    g.add_argument(
        "--hostfile",
        dest="hostfile",
        metavar="FILE",
        default=None,
        help="head-node mode: start one agent per host of FILE over ssh; lines 'HOST [slots=N]' "
        "(slots default: --nproc-per-node, else 1)",
    )

    g = p.add_argument_group("rendezvous")
    g.add_argument("--standalone", action="store_true", help="single-node job on 127.0.0.1 with a free MASTER_PORT")
    g.add_argument(
        "--master-addr",
        dest="master_addr",
        metavar="ADDR",
        default=None,
        help=f"address of node 0 (default {DEFAULT_MASTER_ADDR}, or ${KUBEFLOW.MASTER_ADDR})",
    )
    alias("--master_addr", dest="master_addr")
    g.add_argument(
        "--master-port",
        dest="master_port",
        metavar="PORT",
        default=None,
        help="one node: the workers' MASTER_PORT; several: where node 0's agent hosts the agents' store "
        f"(the workers then get a free port node 0 picks) (default {DEFAULT_MASTER_PORT}, "
        f"or ${KUBEFLOW.MASTER_PORT})",
    )
    alias("--master_port", dest="master_port")
    g.add_argument(
        "--run-id",
        dest="run_id",
        metavar="ID",
        default=None,
        help="job id, the same on every node (default: random on one node, 'none' on several)",
    )
    alias("--run_id", dest="run_id")
    g.add_argument(
        "--secret-file",
        dest="secret_file",
        metavar="FILE",
        default=None,
        help=f"read the job secret from FILE (several nodes need a shared one; ${ENV.SECRET} wins)",
    )
    g.add_argument(
        "--join-timeout",
        dest="join_timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help=f"how long the nodes' agents wait for each other (default ${ENV.TIMEOUT} or 300)",
    )
    g.add_argument(
        "--join-window",
        dest="join_window",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_JOIN_WINDOW,
        help="elastic --nnodes MIN:MAX: once MIN nodes joined, wait this long for more (up to MAX) before "
        f"starting (default {DEFAULT_JOIN_WINDOW:g})",
    )
    p.add_argument("--from-head", dest="from_head", action="store_true", help=argparse.SUPPRESS)

    g = p.add_argument_group("head node (--hostfile)")
    g.add_argument(
        "--ssh-command",
        dest="ssh_command",
        metavar="CMD",
        default="ssh",
        help="ssh client command line (split like a shell would), e.g. 'ssh -F ./ssh_config' (default ssh)",
    )
    g.add_argument("--ssh-port", dest="ssh_port", metavar="PORT", type=int, default=None, help="ssh port of the hosts")
    g.add_argument(
        "--ssh-option",
        dest="ssh_options",
        metavar="OPT",
        action="append",
        default=[],
        help="extra ssh -o option, repeatable (BatchMode=yes is always set)",
    )
    g.add_argument(
        "--env",
        dest="env_names",
        metavar="KEY[=VALUE]",
        action="append",
        default=[],
        help="forward this variable to every host (repeatable)",
    )
    g.add_argument(
        "--env-prefix",
        dest="env_prefixes",
        metavar="PREFIX",
        action="append",
        default=None,
        help="forward variables whose names start with PREFIX (repeatable; replaces the default "
        "PROCGROUP_, PYTHON, OMP_, MKL_, OPENBLAS_, NCCL_, GLOO_, TORCH_)",
    )
    g.add_argument(
        "--env-all",
        dest="env_all",
        action="store_true",
        help="forward every variable except host-local ones (HOSTNAME, PWD, SSH_*, ...)",
    )

    g = p.add_argument_group("failures")
    g.add_argument(
        "--max-restarts",
        dest="max_restarts",
        metavar="R",
        default=None,
        help="restart the whole gang up to R times after a failure (default 0)",
    )
    alias("--max_restarts", dest="max_restarts")
    g.add_argument(
        "--term-timeout",
        dest="term_timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_TERM_TIMEOUT,
        help=f"grace period between SIGTERM and SIGKILL when stopping workers (default {DEFAULT_TERM_TIMEOUT:g})",
    )
    g.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="several nodes: declare a node lost after this long without its agent's heartbeat; a closed "
        f"connection is noticed sooner (default ${ENV.HEARTBEAT_TIMEOUT} or {DEFAULT_HEARTBEAT_TIMEOUT:g})",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--log-dir",
        dest="log_dir",
        metavar="DIR",
        default=None,
        help="write each rank's output to DIR/rank<N>.log (and keep error files there); "
        "the console then shows only the report unless --tee",
    )
    alias("--log_dir", dest="log_dir")
    g.add_argument("--tee", action="store_true", help="with --log-dir: also show worker output on the console")
    g.add_argument(
        "--ranks-filter",
        dest="ranks_filter",
        metavar="R,R,...",
        default=None,
        help="show only these global ranks' output on the console, e.g. 0,3 or 0-3 (log files get all)",
    )
    g.add_argument("--no-prefix", dest="no_prefix", action="store_true", help="do not prefix worker lines")
    g.add_argument(
        "--prefix-format",
        dest="prefix_format",
        metavar="FMT",
        default=None,
        help="line prefix, with fields {rank} {local_rank} {node_rank} {host} {world_size} "
        f"(default {SINGLE_NODE_PREFIX!r}, {MULTI_NODE_PREFIX!r} with --nnodes > 1)",
    )

    g = p.add_argument_group("program")
    g.add_argument(
        "-m",
        "--module",
        dest="module",
        action="store_true",
        help="run the program as a module (python -m), not a script",
    )
    g.add_argument(
        "--no-python",
        dest="no_python",
        action="store_true",
        help="run the program as an executable, without the Python interpreter",
    )
    alias("--no_python", dest="no_python", action="store_true")
    g.add_argument(
        "--local-rank-arg",
        dest="local_rank_arg",
        metavar="dash|underscore",
        nargs="?",
        const="dash",
        default=None,
        help="pass each worker --local-rank=N after the program, before its own arguments, as "
        "torch.distributed.launch did (its scripts parse it from argv); --local-rank-arg=underscore passes "
        "--local_rank=N (torch < 2.0's spelling)",
    )
    p.add_argument("entrypoint", metavar="program", help="script path, module name (-m) or executable (--no-python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the program unchanged")
    return p


def _int(flag: str, value: object, source: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{flag}: {value!r} (from {source}) is not a whole number") from None


def _resolve(ns: argparse.Namespace, dest: str, environ: Mapping[str, str], default: object) -> tuple[object, str]:
    """(value, where it came from): flag > PET_* > default."""
    v = getattr(ns, dest, None)
    if v is not None:
        return v, "--" + dest.replace("_", "-")
    pet = _pet(dest, environ)
    if pet is not None:
        return pet, getattr(KUBEFLOW, dest.upper())
    return default, "the default"


def parse_nproc(value: object, source: str = "--nproc-per-node") -> int:
    """``--nproc-per-node``: a positive number or ``auto``/``cpu``; raises ConfigError naming ``source``."""
    s = str(value).strip().lower()
    if s in ("auto", "cpu"):
        return os.cpu_count() or 1
    if s == "gpu":
        raise ConfigError(f"{source}: 'gpu' is not supported (procgroup has no GPU detection); give a number or 'auto'")
    n = _int("--nproc-per-node", value, source)
    if n < 1:
        raise ConfigError(f"--nproc-per-node {n} (from {source}) must be >= 1, or 'auto' for one per CPU")
    return n


def _check_this_host(nproc: int, source: str) -> None:
    """:func:`check_worker_count` against this host's CPUs, RLIMIT_NPROC and pid_max; raises ConfigError."""
    import resource  # noqa: PLC0415

    from .. import procfs  # noqa: PLC0415

    try:
        cpus: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    limit = None if soft == resource.RLIM_INFINITY or os.geteuid() == 0 else int(soft)  # root is not held to it
    check_worker_count(
        nproc,
        cpus=cpus,
        nproc_limit=limit,
        pid_max=procfs.pid_max(),
        source="--nproc-per-node" if source.startswith("--") else f"--nproc-per-node (from {source})",
    )


def parse_nnodes(value: object, source: str = "--nnodes") -> int:
    """``--nnodes``: a whole number, or ``N:N``; an elastic range ``MIN:MAX`` raises ConfigError (see
    :func:`parse_nnodes_range`, which the per-node mode uses)."""
    lo, hi = parse_nnodes_range(value, source)
    if lo != hi:
        raise ConfigError(
            f"--nnodes {value} (from {source}): an elastic range MIN:MAX needs one `procgroup run` per node"
        )
    return hi


def parse_nnodes_range(value: object, source: str = "--nnodes") -> tuple[int, int]:
    """``--nnodes``: ``N`` -> (N, N); ``MIN:MAX`` -> (MIN, MAX); raises ConfigError naming ``source``."""
    s = str(value).strip()
    lo, sep, hi = s.partition(":")
    lo_n = _int("--nnodes", lo.strip(), source)
    hi_n = _int("--nnodes", hi.strip(), source) if sep else lo_n
    if sep and not 1 <= lo_n <= hi_n:
        raise ConfigError(f"--nnodes {s} (from {source}): MIN:MAX needs 1 <= MIN <= MAX")
    return lo_n, hi_n


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_ranks(value: str) -> frozenset[int]:
    """``"0,3"``, ``"0-3,7"`` -> a set of ranks."""
    out: set[int] = set()
    for part in value.split(","):
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(f"--ranks-filter {value!r}: {part!r} is not a rank or range; use e.g. 0,3 or 0-3,7")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"--ranks-filter {value!r}: range {part.strip()} is empty; write it low-high")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def parse_args(
    argv: Optional[Sequence[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Union[LaunchConfig, HeadConfig]:
    """Parse ``procgroup run`` arguments: a :class:`LaunchConfig` (this node's agent) or, with
    ``--hostfile``, a :class:`~procgroup.launcher.hosts.HeadConfig`.

    argparse usage errors exit with status 2 (argparse's convention); bad
    values raise :class:`ConfigError` naming the flag, the value and its source.
    """
    env = os.environ if environ is None else environ
    p = build_parser()
    ns = p.parse_args(_bare_local_rank_arg(p, list(sys.argv[1:] if argv is None else argv)))
    return config_from_namespace(ns, env)


def _bare_local_rank_arg(p: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """``args`` with a bare ``--local-rank-arg`` before the program spelled ``--local-rank-arg=dash``.

    Its value is optional, and argparse would otherwise take the program (``--local-rank-arg train.py``)
    for it.  Tokens from the program on are the program's own and are left alone.
    """
    takes_value = {s for a in p._actions if a.nargs != 0 for s in a.option_strings}
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--local-rank-arg":
            if i + 1 < len(args) and args[i + 1] in LOCAL_RANK_ARG_FORMS:
                return args  # the space-separated form: argparse reads it as is
            return [*args[:i], "--local-rank-arg=dash", *args[i + 1 :]]
        if tok == "--" or not tok.startswith("-") or tok == "-":
            return args  # the program: the rest is its own
        i += 2 if tok in takes_value else 1
    return args


def _explicit(ns: argparse.Namespace, environ: Mapping[str, str], dest: str) -> bool:
    return getattr(ns, dest, None) is not None or _pet(dest, environ) is not None


def _output_fields(ns: argparse.Namespace, default_prefix: str, environ: Mapping[str, str]) -> dict:
    """The LaunchConfig fields both modes take from the same flags (output, program, secret), checked."""
    if ns.no_prefix and ns.prefix_format is not None:
        raise ConfigError("--no-prefix and --prefix-format exclude each other; keep one")
    if ns.tee and ns.log_dir is None:
        raise ConfigError(
            "--tee copies the --log-dir files to the console; without --log-dir output already goes there"
        )
    return dict(
        log_dir=os.path.abspath(ns.log_dir) if ns.log_dir is not None else None,
        tee=bool(ns.tee),
        ranks_filter=parse_ranks(ns.ranks_filter) if ns.ranks_filter is not None else None,
        prefix_format="" if ns.no_prefix else (ns.prefix_format if ns.prefix_format is not None else default_prefix),
        module=bool(ns.module),
        no_python=bool(ns.no_python),
        local_rank_arg=ns.local_rank_arg,
        cpu_bind=ns.cpu_bind if ns.cpu_bind is not None else (env_str(ENV.CPU_BIND, environ) or "auto").lower(),
        secret_file=os.path.abspath(ns.secret_file) if ns.secret_file is not None else None,
    )


def config_from_namespace(ns: argparse.Namespace, environ: Mapping[str, str]) -> Union[LaunchConfig, HeadConfig]:
    """The parsed flags (plus ``PET_*`` and srun's variables from ``environ``) as this node's
    :class:`LaunchConfig`, or a :class:`HeadConfig` with ``--hostfile``; raises ConfigError."""
    nproc_v, src = _resolve(ns, "nproc_per_node", environ, "1")
    nproc = parse_nproc(nproc_v, src)
    if not getattr(ns, "oversubscribe", False) and not ns.from_head and ns.hostfile is None:
        _check_this_host(nproc, src)
    nnodes_v, src = _resolve(ns, "nnodes", environ, "1")
    min_nnodes, nnodes = parse_nnodes_range(nnodes_v, src) if ns.hostfile is None else (None, parse_nnodes(nnodes_v))
    if min_nnodes == nnodes:
        min_nnodes = None  # N or N:N: a fixed number of nodes
    node_rank_v, src = _resolve(ns, "node_rank", environ, None)
    node_rank = None if node_rank_v is None else _int("--node-rank", node_rank_v, src)
    if node_rank is None and nnodes == 1:
        node_rank = 0

    if ns.join_timeout is not None:
        join_timeout = float(ns.join_timeout)
    else:
        join_timeout = default_timeout(environ)
    hb = ns.heartbeat_timeout if ns.heartbeat_timeout is not None else env_float(ENV.HEARTBEAT_TIMEOUT, environ)
    ns.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT if hb is None else float(hb)

    if ns.hostfile is not None:
        return _head_config(
            ns, environ, nproc_given=_explicit(ns, environ, "nproc_per_node"), nproc=nproc, join_timeout=join_timeout
        )
    if (
        ns.ssh_options
        or ns.env_names
        or ns.env_prefixes is not None
        or ns.env_all
        or ns.ssh_port is not None
        or ns.ssh_command != "ssh"
    ):
        raise ConfigError(
            "--ssh-command/--ssh-port/--ssh-option/--env/--env-prefix/--env-all configure the head "
            "node: use them with --hostfile"
        )

    slurm_step = None
    notes: tuple[str, ...] = ()
    mpi_agents = None
    if not ns.standalone and not ns.from_head and not any(_explicit(ns, environ, d) for d in ("nnodes", "node_rank")):
        from .mpirun import detect_mpirun_agents  # noqa: PLC0415

        # before srun's: mpirun inside a Slurm job starts its daemons with srun, so the agents also carry the
        # daemon step's SLURM_* variables (see procgroup.identity)
        mpi_agents = detect_mpirun_agents(environ)
        if mpi_agents is not None:
            nnodes, node_rank, notes = mpi_agents.nnodes, mpi_agents.node_rank, mpi_agents.notes
            if not _explicit(ns, environ, "master_addr"):
                ns.master_addr = mpi_agents.master_addr
            if not _explicit(ns, environ, "master_port"):
                ns.master_port = mpi_agents.master_port
    if (
        mpi_agents is None
        and not ns.standalone
        and not ns.from_head
        and not any(_explicit(ns, environ, d) for d in ("nnodes", "node_rank", "master_addr", "master_port"))
    ):
        from .slurm import detect_srun_step  # noqa: PLC0415

        step = detect_srun_step(environ)
        if step is not None:
            if step.nnodes == 1:
                ns.standalone = True  # one node of a step: nothing to agree on
            else:
                nnodes, node_rank, slurm_step, notes = step.nnodes, step.node_rank, step.run_id, step.notes
                ns.master_addr, ns.master_port = step.master_addr, step.master_port
                if ns.run_id is None:
                    ns.run_id = step.run_id

    standalone = bool(ns.standalone)
    if standalone:
        if ns.master_port is not None:
            raise ConfigError(
                f"--standalone picks a free port itself; drop --master-port {ns.master_port} "
                "(or drop --standalone to use that port)"
            )
        if ns.master_addr is not None:
            raise ConfigError(
                f"--standalone listens on {DEFAULT_MASTER_ADDR}; drop --master-addr {ns.master_addr} "
                "(or drop --standalone to use that address)"
            )
        master_addr, master_port = DEFAULT_MASTER_ADDR, 0
    else:
        addr_v, _ = _resolve(ns, "master_addr", environ, DEFAULT_MASTER_ADDR)
        master_addr = str(addr_v).strip()
        if not master_addr:
            raise ConfigError("--master-addr is empty; give node 0's host name or address")
        port_v, src = _resolve(ns, "master_port", environ, DEFAULT_MASTER_PORT)
        master_port = _int("--master-port", port_v, src)
        if master_port < 1 and not (ns.from_head and master_port == 0):  # node 0 of a head-node job: any free port
            raise ConfigError(
                f"--master-port {master_port} (from {src}) must be 1..65535; use --standalone to pick a free port"
            )

    restarts_v, src = _resolve(ns, "max_restarts", environ, 0)
    max_restarts = _int("--max-restarts", restarts_v, src)

    run_id_v, _ = _resolve(ns, "run_id", environ, None)
    # Several nodes must agree on the id without talking: torchrun's "none".
    run_id = str(run_id_v) if run_id_v is not None else (new_run_id() if nnodes == 1 else "none")

    io = _output_fields(ns, SINGLE_NODE_PREFIX if nnodes == 1 else MULTI_NODE_PREFIX, environ)
    return LaunchConfig(
        entrypoint=ns.entrypoint,
        args=tuple(ns.args),
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        standalone=standalone,
        run_id=run_id,
        max_restarts=max_restarts,
        term_timeout=ns.term_timeout,
        heartbeat_timeout=ns.heartbeat_timeout,
        min_nnodes=min_nnodes,
        join_window=ns.join_window,
        **io,
        join_timeout=join_timeout,
        from_head=bool(ns.from_head),
        slurm_step=slurm_step,
        notes=notes,
    )


def _head_config(
    ns: argparse.Namespace, environ: Mapping[str, str], *, nproc_given: bool, nproc: int, join_timeout: float
) -> HeadConfig:
    import shlex  # noqa: PLC0415

    for dest, flag in (("node_rank", "--node-rank"), ("standalone", "--standalone"), ("from_head", "--from-head")):
        if getattr(ns, dest, None):
            raise ConfigError(f"{flag} does not go with --hostfile: the head node numbers the hosts in hostfile order")
    try:
        with open(ns.hostfile, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--hostfile {ns.hostfile!r}: cannot read it ({e.strerror or e})") from e
    hosts = parse_hostfile(text, nproc if nproc_given else 1, source=ns.hostfile)
    nnodes = len(hosts)
    if ns.nnodes is not None and parse_nnodes(ns.nnodes) != nnodes:
        raise ConfigError(f"--nnodes {ns.nnodes} but {ns.hostfile} lists {nnodes} host(s); drop --nnodes")
    port = 0
    if ns.master_port is not None:
        port = _int("--master-port", ns.master_port, "--master-port")
        if not 0 < port < 65536:
            raise ConfigError(f"--master-port {port} must be 1..65535 (omit it: node 0 then picks a free port)")
    io = _output_fields(ns, MULTI_NODE_PREFIX, environ)
    try:
        ssh_command = tuple(shlex.split(ns.ssh_command))
    except ValueError as e:
        raise ConfigError(f"--ssh-command {ns.ssh_command!r}: {e}") from None
    agent = LaunchConfig(
        entrypoint=ns.entrypoint,
        args=tuple(ns.args),
        nproc_per_node=hosts[0].slots,
        nnodes=nnodes,
        node_rank=0,
        master_addr=str(ns.master_addr or hosts[0].name),
        master_port=port,
        run_id=str(ns.run_id) if ns.run_id is not None else new_run_id(),
        max_restarts=_int("--max-restarts", ns.max_restarts if ns.max_restarts is not None else 0, "--max-restarts"),
        term_timeout=ns.term_timeout,
        heartbeat_timeout=ns.heartbeat_timeout,
        **io,
        join_timeout=join_timeout,
        from_head=True,
    )
    env = EnvPolicy(
        names=tuple(ns.env_names),
        prefixes=tuple(ns.env_prefixes) if ns.env_prefixes is not None else DEFAULT_ENV_PREFIXES,
        everything=bool(ns.env_all),
    )
    return HeadConfig(
        agent=agent,
        hostfile=os.path.abspath(ns.hostfile),
        hosts=hosts,
        ssh_command=ssh_command,
        ssh_port=ns.ssh_port,
        ssh_options=tuple(ns.ssh_options),
        env=env,
        master_addr=str(ns.master_addr or hosts[0].name),
        master_port=port,
    )
