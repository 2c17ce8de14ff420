"""Head-node mode: ``procgroup run --hostfile FILE ...`` starts one agent per host over ssh.

Pure parts (unit-tested without a network): :func:`parse_hostfile`,
:class:`EnvPolicy` (which variables travel to the hosts), :func:`agent_argv`
and :func:`remote_command` (what runs there), :func:`ssh_argv`.  The I/O
shell is :class:`HeadNode` in :mod:`procgroup.launcher.head`.

What the remote side gets:

* the command ``cd CWD && exec env K=V ... PYTHON -m procgroup run --from-head
  --nnodes M --node-rank K --master-addr A --master-port P --run-id ID ...
  PROGRAM ARGS`` -- the head's working directory and interpreter (a cluster
  shares its filesystem), and the forwarded variables (printed once by the
  head; never the secret);
* on the ssh session's stdin, one JSON line with the job secret and a nonce
  that marks the agent's control lines on its stdout (so nothing secret is
  visible in ``ps`` on any host).  The agent then keeps reading stdin: EOF
  -- the head exited or closed the session -- stops the agent's workers, and
  the agent also dies with its sshd session (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..config import ENV
from ..errors import ConfigError
from .config import LaunchConfig

__all__ = [
    "HostSlot",
    "HeadConfig",
    "EnvPolicy",
    "parse_hostfile",
    "agent_argv",
    "remote_command",
    "ssh_argv",
    "DEFAULT_ENV_PREFIXES",
]

#: Variables forwarded to every host unless --env-prefix is given.
DEFAULT_ENV_PREFIXES = ("PROCGROUP_", "PYTHON", "OMP_", "MKL_", "OPENBLAS_", "NCCL_", "GLOO_", "TORCH_")
#: Per-host or per-session variables that --env-all still does not forward.
_HOST_LOCAL = frozenset(
    {
        "HOSTNAME",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "TERM",
        "DISPLAY",
        "XAUTHORITY",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOWID",
        "SSH_AUTH_SOCK",
        "SSH_AGENT_PID",
        "SSH_CLIENT",
        "SSH_CONNECTION",
        "SSH_TTY",
        "MAIL",
        "LS_COLORS",
        "PS1",
        "PROMPT_COMMAND",
        "COLUMNS",
        "LINES",
        "INVOCATION_ID",
        "JOURNAL_STREAM",
        "NOTIFY_SOCKET",
    }
)
#: The contract variables procgroup run writes for each worker / agent: the hosts get their own.
_LAUNCHER_WRITTEN = frozenset(v.name for v in ENV.table() if v.written_by == "launcher") | {
    ENV.SECRET,
    "LOCAL_RANK",
    "RANK",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOSTNAME = re.compile(r"^([A-Za-z0-9_.-]+@)?[A-Za-z0-9_.:\[\]-]+$")


@dataclass(frozen=True)
class HostSlot:
    """One hostfile line: a host (as ssh reaches it, ``[user@]host``) and how many workers run there."""

    host: str
    slots: int
    line: int = 0

    @property
    def name(self) -> str:
        """The host without ``user@``: how the other hosts reach it."""
        return self.host.rsplit("@", 1)[-1]


def parse_hostfile(text: str, default_slots: int, source: str = "hostfile") -> tuple[HostSlot, ...]:
    """``host [slots=N]`` per line; ``#`` starts a comment; blank lines are skipped.

    ``default_slots`` is used for lines without ``slots=`` (--nproc-per-node,
    else 1).  A host listed twice, a bad count or an unknown field is an error
    naming the line.
    """
    out: list[HostSlot] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        host = fields[0]
        if "=" in host or not _HOSTNAME.match(host):
            raise ConfigError(f"{source} line {n}: {host!r} is not a host name; a line is 'HOST [slots=N]'")
        slots = default_slots
        for f in fields[1:]:
            key, eq, val = f.partition("=")
            if key in ("slots", "max_slots", "max-slots") and eq:
                try:
                    v = int(val)
                except ValueError:
                    raise ConfigError(f"{source} line {n}: {f!r}: slots must be a whole number") from None
                if v < 1:
                    raise ConfigError(f"{source} line {n}: {f!r}: slots must be >= 1")
                if key == "slots":
                    slots = v
            else:
                raise ConfigError(f"{source} line {n}: unknown field {f!r}; a line is 'HOST [slots=N]'")
        if host in seen:
            raise ConfigError(
                f"{source} line {n}: host {host!r} is already listed on line {seen[host]}; "
                "give each host one line with slots=N"
            )
        seen[host] = n
        out.append(HostSlot(host, slots, n))
    if not out:
        raise ConfigError(f"{source} lists no hosts; write one 'HOST [slots=N]' per line")
    return tuple(out)


@dataclass(frozen=True)
class EnvPolicy:
    """Which of the head's environment variables the agents (and so the workers) get."""

    names: tuple[str, ...] = ()  # --env KEY or KEY=VALUE
    prefixes: tuple[str, ...] = DEFAULT_ENV_PREFIXES  # --env-prefix (replaces the default list)
    everything: bool = False  # --env-all

    def __post_init__(self) -> None:
        for item in self.names:
            key = item.partition("=")[0]
            if not _NAME.match(key):
                raise ConfigError(f"--env {item!r}: {key!r} is not a variable name; use --env KEY or --env KEY=VALUE")
            if key in _LAUNCHER_WRITTEN:
                raise ConfigError(
                    f"--env {key}: procgroup run writes {key} on every host itself "
                    + (
                        "(the secret travels on the ssh session's stdin)"
                        if key == ENV.SECRET
                        else "for each worker; it cannot be forwarded"
                    )
                )

    def select(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables to set on every host, in a stable order."""
        out: dict[str, str] = {}
        for k in sorted(environ):
            if k in _LAUNCHER_WRITTEN or not _NAME.match(k):
                continue
            if self.everything:
                if k not in _HOST_LOCAL and not k.startswith("SSH_"):
                    out[k] = environ[k]
            elif any(k.startswith(p) for p in self.prefixes):
                out[k] = environ[k]
        for item in self.names:
            key, eq, val = item.partition("=")
            if eq:
                out[key] = val
            elif key in environ:
                out[key] = environ[key]
        return out

    def describe(self, selected: Mapping[str, str], environ: Mapping[str, str]) -> str:
        """The line the head prints once: the rule and the names (never the values)."""
        if self.everything:
            rule = "--env-all (all but host-local ones such as HOSTNAME, PWD, SSH_*)"
        else:
            rule = "names starting with " + (", ".join(self.prefixes) if self.prefixes else "(none)")
        if self.names:
            rule += "; --env " + ", ".join(n.partition("=")[0] for n in self.names)
        missing = [n for n in self.names if "=" not in n and n not in environ]
        names = ", ".join(selected) if selected else "none"
        s = f"procgroup run: forwarding to every host ({rule}): {names}"
        if missing:
            s += f"; not set here, so not forwarded: {', '.join(missing)}"
        return s + f"; {ENV.SECRET} goes over each ssh session's stdin"


@dataclass(frozen=True)
class HeadConfig:
    """``procgroup run --hostfile``: the hosts, how to reach them, and the agents' template."""

    agent: LaunchConfig  # nnodes = number of hosts; node_rank/master are set per host
    hostfile: str
    hosts: tuple[HostSlot, ...]
    ssh_command: tuple[str, ...] = ("ssh",)
    ssh_port: Optional[int] = None
    ssh_options: tuple[str, ...] = ()
    env: EnvPolicy = field(default_factory=EnvPolicy)
    master_addr: str = ""  # default: the first host, as named in the hostfile
    master_port: int = 0  # 0: node 0's agent picks a free port and tells the head

    def __post_init__(self) -> None:
        if not self.ssh_command:
            raise ConfigError("--ssh-command is empty; give the ssh client to use, e.g. --ssh-command ssh")
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise ConfigError(f"--ssh-port {self.ssh_port} is not a TCP port (1..65535)")
        if self.agent.nnodes != len(self.hosts):
            raise ConfigError(
                f"--nnodes {self.agent.nnodes} but {self.hostfile} lists {len(self.hosts)} host(s); "
                "drop --nnodes (the hostfile decides)"
            )
        if self.agent.ranks_filter is not None:
            bad = sorted(r for r in self.agent.ranks_filter if not 0 <= r < self.world_size)
            if bad:
                raise ConfigError(
                    f"--ranks-filter names rank(s) {bad} but the hostfile's slots give ranks 0..{self.world_size - 1}"
                )

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def master(self) -> str:
        return self.master_addr or self.hosts[0].name


def agent_argv(
    cfg: LaunchConfig, *, node_rank: int, nnodes: int, nproc: int, master_addr: str, master_port: int, run_id: str
) -> list[str]:
    """``procgroup run`` arguments for one host's agent (after ``python -m procgroup run``)."""
    a = [
        "--from-head",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--run-id",
        run_id,
        "--max-restarts",
        str(cfg.max_restarts),
        "--term-timeout",
        repr(cfg.term_timeout),
        "--join-timeout",
        repr(cfg.join_timeout),
        "--heartbeat-timeout",
        repr(cfg.heartbeat_timeout),
    ]
    if cfg.log_dir is not None:
        a += ["--log-dir", cfg.log_dir]
    if cfg.tee:
        a += ["--tee"]
    if cfg.ranks_filter is not None:
        a += ["--ranks-filter", ",".join(str(r) for r in sorted(cfg.ranks_filter))]
    if not cfg.prefix_format:
        a += ["--no-prefix"]
    else:
        a += ["--prefix-format", cfg.prefix_format]
    if cfg.module:
        a += ["-m"]
    if cfg.no_python:
        a += ["--no-python"]
    if cfg.local_rank_arg is not None:
        a += [f"--local-rank-arg={cfg.local_rank_arg}"]
    a += ["--cpu-bind", cfg.cpu_bind]
    a += [cfg.entrypoint, *cfg.args]
    return a


def remote_command(*, cwd: str, env: Mapping[str, str], python: str, argv: Sequence[str]) -> str:
    """The shell command line ssh runs on a host (every piece quoted)."""
    q = shlex.quote
    parts = [f"cd {q(cwd)}", "&&", "exec", "env"]
    parts += [q(f"{k}={v}") for k, v in env.items()]
    parts += [q(python), "-m", "procgroup", "run"]
    parts += [q(x) for x in argv]
    return " ".join(parts)


def ssh_argv(
    ssh_command: Sequence[str], host: str, remote: str, *, port: Optional[int] = None, options: Sequence[str] = ()
) -> list[str]:
    """``ssh -T -o BatchMode=yes [-p PORT] [-o OPT]... HOST REMOTE``."""
    a = [*ssh_command, "-T", "-o", "BatchMode=yes"]
    if port is not None:
        a += ["-p", str(port)]
    for o in options:
        a += ["-o", o]
    a += [host, remote]
    return a


def default_python() -> str:
    import sys

    return sys.executable or "python3"


def head_cwd() -> str:
    return os.getcwd()
