"""``procgroup run`` command line -> a frozen :class:`LaunchConfig`.

Flags follow torchrun's.  One spelling is shown in ``--help``; torchrun's
underscore spellings (``--nproc_per_node``...) are accepted silently so that
existing command lines keep working.  Precedence: explicit flag > ``PET_*``
environment variable (Kubeflow's torchrun defaults, see
:class:`procgroup.config.KUBEFLOW`) > built-in default.

:func:`worker_env` is the launcher's half of the environment contract
(:class:`procgroup.config.ENV`): the exact variables one worker receives.
It is a pure function so that every rank/node combination is unit-tested
without starting a process.
"""

from __future__ import annotations

import argparse
import os
import re
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..config import ENV, KUBEFLOW, env_str
from ..errors import ConfigError

__all__ = [
    "LaunchConfig",
    "build_parser",
    "parse_args",
    "worker_env",
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TERM_TIMEOUT",
    "PREFIX_FIELDS",
]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TERM_TIMEOUT = 3.0
ROLE_NAME = "default"

#: Fields available to ``--prefix-format``.
PREFIX_FIELDS = ("rank", "local_rank", "node_rank", "host", "world_size")
SINGLE_NODE_PREFIX = "[{rank}] "
MULTI_NODE_PREFIX = "[{host}:{rank}] "

#: Not part of the contract table: OpenMP's and CPython's own variables.
OMP_NUM_THREADS = "OMP_NUM_THREADS"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one node's agent needs; validated on construction.

    ``master_port == 0`` means "pick a free port" (``--standalone``).
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
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

    def __post_init__(self) -> None:
        if not self.entrypoint:
            raise ConfigError("no program to run: give a script (procgroup run train.py) or -m module")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be >= 1")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"use 0..{self.nnodes - 1} (node 0 runs on --master-addr and hosts the store)"
            )
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port (0..65535)")
        if self.master_port == 0 and not self.standalone:
            raise ConfigError("--master-port 0 is only meaningful with --standalone; give a fixed port every node can reach")
        if self.standalone and self.nnodes != 1:
            raise ConfigError(
                f"--standalone runs a single-node job, but --nnodes is {self.nnodes}: drop --standalone and give "
                "--master-addr/--master-port (the address and port of node 0)"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} must be >= 0")
        if self.max_restarts > 0 and self.nnodes > 1:
            raise ConfigError(
                f"--max-restarts {self.max_restarts} with --nnodes {self.nnodes}: restarting the gang across nodes needs "
                "the multi-node agent (not available yet); use --max-restarts 0 or run on one node"
            )
        if not self.term_timeout >= 0:
            raise ConfigError(f"--term-timeout {self.term_timeout} must be >= 0 seconds")
        if self.module and self.no_python:
            raise ConfigError("-m/--module and --no-python exclude each other: -m runs a Python module, --no-python an executable")
        if not self.run_id or any(c in self.run_id for c in "/\0"):
            raise ConfigError(f"--run-id {self.run_id!r} must be non-empty and contain no '/'")
        if self.ranks_filter is not None:
            bad = sorted(r for r in self.ranks_filter if not 0 <= r < self.world_size)
            if bad:
                raise ConfigError(
                    f"--ranks-filter names rank(s) {bad} but the job has ranks 0..{self.world_size - 1} "
                    f"(--nnodes {self.nnodes} x --nproc-per-node {self.nproc_per_node})"
                )
        _check_prefix_format(self.prefix_format)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def hosts_store(self) -> bool:
        """Node 0's agent hosts the store; other nodes' workers dial it."""
        return self.node_rank == 0

    @property
    def store_bind_host(self) -> str:
        """Where node 0 listens: the master address on one node, every interface on several."""
        return self.master_addr if self.nnodes == 1 else "0.0.0.0"

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def local_ranks(self) -> range:
        return range(self.nproc_per_node)

    def format_prefix(self, local_rank: int, host: str) -> str:
        if not self.prefix_format:
            return ""
        return self.prefix_format.format(
            rank=self.global_rank(local_rank), local_rank=local_rank, node_rank=self.node_rank,
            host=host, world_size=self.world_size,
        )

    def shows_rank(self, rank: int) -> bool:
        """Whether ``rank``'s output goes to the console."""
        if self.log_dir is not None and not self.tee:
            return False
        return self.ranks_filter is None or rank in self.ranks_filter


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
) -> dict[str, str]:
    """The complete environment of worker ``local_rank`` (``base`` plus the contract variables)."""
    if not 0 <= local_rank < cfg.nproc_per_node:
        raise ConfigError(f"local rank {local_rank} out of range 0..{cfg.nproc_per_node - 1}")
    env = dict(os.environ if base is None else base)
    rank = cfg.global_rank(local_rank)
    env.update({
        ENV.RANK: str(rank),
        ENV.LOCAL_RANK: str(local_rank),
        ENV.WORLD_SIZE: str(cfg.world_size),
        ENV.LOCAL_WORLD_SIZE: str(cfg.nproc_per_node),
        ENV.GROUP_RANK: str(cfg.node_rank),
        ENV.NODE_RANK: str(cfg.node_rank),
        ENV.GROUP_WORLD_SIZE: str(cfg.nnodes),
        ENV.ROLE_RANK: str(rank),
        ENV.ROLE_WORLD_SIZE: str(cfg.world_size),
        ENV.ROLE_NAME: ROLE_NAME,
        ENV.MASTER_ADDR: cfg.master_addr,
        ENV.MASTER_PORT: str(master_port),
        ENV.TORCHELASTIC_RUN_ID: cfg.run_id,
        ENV.TORCHELASTIC_RESTART_COUNT: str(restart_count),
        ENV.TORCHELASTIC_MAX_RESTARTS: str(cfg.max_restarts),
        ENV.TORCHELASTIC_ERROR_FILE: error_file,
        ENV.SECRET: secret,
        ENV.STORE_HOSTED: "1",
        ENV.ERROR_FILE: error_file,
        ENV.RUN_ID: cfg.run_id,
        ENV.RESTART_COUNT: str(restart_count),
        ENV.HOSTNAME: hostname,
        PYTHONUNBUFFERED: "1",
    })
    if OMP_NUM_THREADS not in env:
        env[OMP_NUM_THREADS] = "1"
    return env


# --------------------------------------------------------------------------- argparse


def _pet(dest: str, environ: Mapping[str, str]) -> Optional[str]:
    """The Kubeflow ``PET_*`` default for a flag, when :class:`KUBEFLOW` lists one."""
    name = getattr(KUBEFLOW, dest.upper(), None)
    return env_str(name, environ) if isinstance(name, str) else None


def build_parser(prog: str = "procgroup run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description=(
            "Start NPROC copies of a Python program on this node as one process group "
            f"(the torchrun equivalent). Each worker gets {ENV.RANK}, {ENV.WORLD_SIZE}, {ENV.LOCAL_RANK}, "
            f"{ENV.MASTER_ADDR}, {ENV.MASTER_PORT}, {ENV.SECRET} ... (see `procgroup env`). If any worker fails, the others are "
            "stopped and the first failure is reported with its traceback."
        ),
        epilog="Example: procgroup run --nproc-per-node 4 train.py --epochs 3",
    )

    def alias(*names: str, dest: str, **kw: object) -> None:
        # torchrun's underscore spellings: accepted, not advertised.
        p.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)  # type: ignore[arg-type]

    g = p.add_argument_group("job shape")
    g.add_argument("--nproc-per-node", dest="nproc_per_node", metavar="N|auto", default=None,
                   help=f"workers on this node; 'auto' = number of CPUs (default 1, or ${KUBEFLOW.NPROC_PER_NODE})")
    alias("--nproc_per_node", dest="nproc_per_node")
    g.add_argument("--nnodes", dest="nnodes", metavar="M", default=None,
                   help=f"number of nodes, each running one `procgroup run` (default 1, or ${KUBEFLOW.NNODES})")
    g.add_argument("--node-rank", dest="node_rank", metavar="K", default=None,
                   help=f"rank of this node, 0..M-1; node 0 hosts the store (default 0, or ${KUBEFLOW.NODE_RANK})")
    alias("--node_rank", dest="node_rank")

    g = p.add_argument_group("rendezvous")
    g.add_argument("--standalone", action="store_true",
                   help="single-node job: host the store on a free port of 127.0.0.1")
    g.add_argument("--master-addr", dest="master_addr", metavar="ADDR", default=None,
                   help=f"address of node 0 (default {DEFAULT_MASTER_ADDR}, or ${KUBEFLOW.MASTER_ADDR})")
    alias("--master_addr", dest="master_addr")
    g.add_argument("--master-port", dest="master_port", metavar="PORT", default=None,
                   help=f"port of the store on node 0 (default {DEFAULT_MASTER_PORT}, or ${KUBEFLOW.MASTER_PORT})")
    alias("--master_port", dest="master_port")
    g.add_argument("--run-id", dest="run_id", metavar="ID", default=None,
                   help="job id, the same on every node (default: random on one node, 'none' on several)")
    alias("--run_id", dest="run_id")

    g = p.add_argument_group("failures")
    g.add_argument("--max-restarts", dest="max_restarts", metavar="R", default=None,
                   help="restart the whole gang up to R times after a failure (default 0)")
    alias("--max_restarts", dest="max_restarts")
    g.add_argument("--term-timeout", dest="term_timeout", metavar="SECONDS", type=float,
                   default=DEFAULT_TERM_TIMEOUT,
                   help=f"grace period between SIGTERM and SIGKILL when stopping workers (default {DEFAULT_TERM_TIMEOUT:g})")

    g = p.add_argument_group("output")
    g.add_argument("--log-dir", dest="log_dir", metavar="DIR", default=None,
                   help="write each rank's output to DIR/rank<N>.log (and keep error files there); "
                        "the console then shows only the report unless --tee")
    alias("--log_dir", dest="log_dir")
    g.add_argument("--tee", action="store_true", help="with --log-dir: also show worker output on the console")
    g.add_argument("--ranks-filter", dest="ranks_filter", metavar="R,R,...", default=None,
                   help="show only these global ranks' output on the console, e.g. 0,3 or 0-3 (log files get all)")
    g.add_argument("--no-prefix", dest="no_prefix", action="store_true", help="do not prefix worker lines")
    g.add_argument("--prefix-format", dest="prefix_format", metavar="FMT", default=None,
                   help="line prefix, with fields {rank} {local_rank} {node_rank} {host} {world_size} "
                        f"(default {SINGLE_NODE_PREFIX!r}, {MULTI_NODE_PREFIX!r} with --nnodes > 1)")

    g = p.add_argument_group("program")
    g.add_argument("-m", "--module", dest="module", action="store_true",
                   help="run the program as a module (python -m), not a script")
    g.add_argument("--no-python", dest="no_python", action="store_true",
                   help="run the program as an executable, without the Python interpreter")
    alias("--no_python", dest="no_python", action="store_true")
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
    s = str(value).strip().lower()
    if s in ("auto", "cpu"):
        return os.cpu_count() or 1
    if s == "gpu":
        raise ConfigError(f"{source}: 'gpu' is not supported (procgroup has no GPU detection); give a number or 'auto'")
    n = _int("--nproc-per-node", value, source)
    if n < 1:
        raise ConfigError(f"--nproc-per-node {n} (from {source}) must be >= 1, or 'auto' for one per CPU")
    return n


def parse_nnodes(value: object, source: str = "--nnodes") -> int:
    s = str(value).strip()
    if ":" in s:
        lo, _, hi = s.partition(":")
        if lo.strip() == hi.strip():
            s = lo
        else:
            raise ConfigError(
                f"--nnodes {s} (from {source}): elastic node ranges MIN:MAX are not supported; give a fixed number of nodes"
            )
    return _int("--nnodes", s, source)


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


def parse_args(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> LaunchConfig:
    """Parse ``procgroup run`` arguments.

    argparse usage errors exit with status 2 (argparse's convention); bad
    values raise :class:`ConfigError` naming the flag, the value and its source.
    """
    env = os.environ if environ is None else environ
    ns = build_parser().parse_args(argv)
    return config_from_namespace(ns, env)


def config_from_namespace(ns: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    nproc_v, src = _resolve(ns, "nproc_per_node", environ, "1")
    nproc = parse_nproc(nproc_v, src)
    nnodes_v, src = _resolve(ns, "nnodes", environ, "1")
    nnodes = parse_nnodes(nnodes_v, src)
    node_rank_v, src = _resolve(ns, "node_rank", environ, 0)
    node_rank = _int("--node-rank", node_rank_v, src)

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
        if master_port < 1:
            raise ConfigError(f"--master-port {master_port} (from {src}) must be 1..65535; use --standalone to pick a free port")

    restarts_v, src = _resolve(ns, "max_restarts", environ, 0)
    max_restarts = _int("--max-restarts", restarts_v, src)

    run_id_v, _ = _resolve(ns, "run_id", environ, None)
    # Several nodes must agree on the id without talking: torchrun's "none".
    run_id = str(run_id_v) if run_id_v is not None else (uuid.uuid4().hex[:12] if nnodes == 1 else "none")

    if ns.no_prefix and ns.prefix_format is not None:
        raise ConfigError("--no-prefix and --prefix-format exclude each other; keep one")
    if ns.no_prefix:
        prefix = ""
    elif ns.prefix_format is not None:
        prefix = ns.prefix_format
    else:
        prefix = SINGLE_NODE_PREFIX if nnodes == 1 else MULTI_NODE_PREFIX

    if ns.tee and ns.log_dir is None:
        raise ConfigError("--tee copies the --log-dir files to the console; without --log-dir output already goes there")

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
        log_dir=os.path.abspath(ns.log_dir) if ns.log_dir is not None else None,
        tee=bool(ns.tee),
        ranks_filter=parse_ranks(ns.ranks_filter) if ns.ranks_filter is not None else None,
        prefix_format=prefix,
        module=bool(ns.module),
        no_python=bool(ns.no_python),
    )
