"""Rendezvous: every member joins through the store; the call returns only when all have.

Decide-then-execute (after PyTorch elastic): :func:`decide` is a pure
function from what the store shows to the next action, so the rules
(duplicate rank, world-size mismatch, who is missing) have unit tests
without a network; :func:`rendezvous` is the small executor that reads the
store, asks :func:`decide`, and acts.

Store keys (under the caller's prefix)::

    world_size      first member's world size (compare_set; a mismatch is an error)
    rank/<r>        JSON MemberInfo of rank r (compare_set; a second claim is an error)
    error           first fatal error; every waiting member raises it at once
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Sequence
from urllib.parse import parse_qs, urlparse

from . import procfs
from .config import DEFAULT_PROGRESS_INTERVAL, ENV
from .deadline import Deadline
from .errors import ConfigError, RendezvousError, RendezvousTimeoutError, StoreTimeoutError, format_ranks

__all__ = [
    "InitMethod",
    "parse_init_method",
    "MemberInfo",
    "Decision",
    "decide",
    "rendezvous",
    "host_key",
    "member_is_dead",
    "process_start_time",
    "logger",
]

logger = logging.getLogger("procgroup")

_VALID = "env:// (MASTER_ADDR, MASTER_PORT), tcp://HOST:PORT or file:///PATH"


@dataclass(frozen=True)
class InitMethod:
    scheme: str  # env | tcp | file
    host: Optional[str] = None
    port: Optional[int] = None
    path: Optional[str] = None
    rank: Optional[int] = None
    world_size: Optional[int] = None

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        if self.scheme == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return "env://"


def parse_init_method(url: Optional[str]) -> InitMethod:
    """Parse ``env://``, ``tcp://host:port[?rank=&world_size=]``, ``file:///path``."""
    if url is None or url == "":
        url = "env://"
    if not isinstance(url, str):
        raise ConfigError(f"init_method must be a string such as {_VALID}, got {type(url).__name__}")
    u = urlparse(url)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(q) - {"rank", "world_size"}
    if unknown:
        raise ConfigError(
            f"init_method {url!r} has unknown query parameters {sorted(unknown)}; "
            "only rank= and world_size= are accepted"
        )

    def qint(name: str) -> Optional[int]:
        if name not in q:
            return None
        try:
            return int(q[name])
        except ValueError:
            raise ConfigError(f"init_method {url!r}: {name}={q[name]!r} is not an integer") from None

    rank, ws = qint("rank"), qint("world_size")
    if u.scheme == "env":
        return InitMethod("env", rank=rank, world_size=ws)
    if u.scheme == "tcp":
        try:
            port = u.port
        except ValueError:
            port = None
        if not u.hostname or port is None:
            raise ConfigError(
                f"init_method {url!r} needs a host and a port: tcp://HOST:PORT, e.g. tcp://10.0.0.1:29500"
            )
        return InitMethod("tcp", host=u.hostname, port=port, rank=rank, world_size=ws)
    if u.scheme == "file":
        path = u.path or u.netloc
        if not path:
            raise ConfigError(f"init_method {url!r} needs a path: file:///shared/dir/rdzv_file")
        return InitMethod("file", path=path, rank=rank, world_size=ws)
    raise ConfigError(f"init_method {url!r} is not supported; use {_VALID}")


def host_key(hostname: Optional[str] = None) -> str:
    """Equal for processes that can share memory: hostname, boot id and network namespace."""
    hn = hostname or socket.gethostname()
    boot = procfs.boot_id() or "?"
    ino = procfs.namespace_inode("net")
    ns = "?" if ino is None else str(ino)
    return f"{hn}|{boot}|{ns}"


@dataclass(frozen=True)
class MemberInfo:
    rank: int
    world_size: int
    hostname: str
    host_key: str
    addr: str
    pid: int
    nonce: str
    local_rank: int = 0
    node_rank: int = 0
    #: the process's start time (clock ticks after boot; 0: unknown), so a reused pid is not taken for it
    start_time: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "MemberInfo":
        return cls(**json.loads(data))

    def where(self) -> str:
        return f"{self.hostname} pid {self.pid}"


def process_start_time(pid: Optional[int] = None) -> int:
    """Start time of ``pid`` (default: this process) in clock ticks after boot; 0 when unknown."""
    st = procfs.stat(os.getpid() if pid is None else pid)
    return st.starttime if st is not None else 0


def member_is_dead(m: MemberInfo, here: Optional[str] = None) -> bool:
    """True when ``m`` ran on this host (same :func:`host_key`) and its process is gone: the pid is dead, or it
    now belongs to a process started at another time (pid reuse).  False when alive or on another host."""
    if m.host_key != (here or host_key()):
        return False
    if not procfs.pid_alive(m.pid):
        return True
    return bool(m.start_time) and process_start_time(m.pid) not in (0, m.start_time)


@dataclass(frozen=True)
class Decision:
    """What to do next: ``done``, ``wait`` for ``missing``, or ``fail`` with ``error``."""

    action: str
    missing: tuple = ()
    error: str = ""


def decide(world_size: int, joined: Sequence[int], error: Optional[str]) -> Decision:
    if error:
        return Decision("fail", error=error)
    have = set(joined)
    missing = tuple(r for r in range(world_size) if r not in have)
    if missing:
        return Decision("wait", missing=missing)
    return Decision("done")


def _post_error(store: Any, msg: str) -> None:
    try:
        store.compare_set("error", b"", msg.encode())
    except Exception:  # noqa: BLE001 - we are already failing; the local raise carries the message
        pass


def rendezvous(
    store: Any,
    me: MemberInfo,
    deadline: Deadline,
    *,
    where: str,
    progress_interval: Optional[float] = None,
) -> List[MemberInfo]:
    """Join; return every member's info (index = rank) once all ``world_size`` have joined.

    ``progress_interval``: seconds between "waiting for ranks" log lines (init passes the parsed
    PROCGROUP_PROGRESS_INTERVAL; default :data:`~procgroup.config.DEFAULT_PROGRESS_INTERVAL`).
    Raises RendezvousError (bad rank, duplicate rank, world-size mismatch, an error posted by a member)
    and RendezvousTimeoutError naming the missing ranks.
    """
    ws = me.world_size
    if ws < 1:
        raise ConfigError(f"world_size={ws} must be >= 1 (set WORLD_SIZE or world_size=)")
    if not 0 <= me.rank < ws:
        msg = (
            f"rank {me.rank} ({me.where()}) is outside [0, {ws}): every rank must be in 0..WORLD_SIZE-1; "
            f"check RANK/rank= and WORLD_SIZE/world_size="
        )
        _post_error(store, msg)
        raise RendezvousError(msg)
    if progress_interval is None:
        progress_interval = DEFAULT_PROGRESS_INTERVAL  # init passes PROCGROUP_PROGRESS_INTERVAL, parsed once

    cur = store.compare_set("world_size", b"", str(ws).encode())
    if cur != str(ws).encode():
        msg = (
            f"world-size mismatch at {where}: rank {me.rank} ({me.where()}) has world_size={ws}, "
            f"but the group was formed with world_size={cur.decode(errors='replace')} by an earlier member; "
            f"set the same WORLD_SIZE on every rank"
        )
        _post_error(store, msg)
        raise RendezvousError(msg)
    mine = me.encode()
    cur = store.compare_set(f"rank/{me.rank}", b"", mine)
    if cur != mine:
        try:
            claim = MemberInfo.decode(cur)
            other = claim.where()
            if member_is_dead(claim):  # a store left by a killed job (file://: see procgroup.file_rendezvous)
                other += " (a process that is dead: the store is stale, from a killed job; use a fresh one)"
        except Exception:  # noqa: BLE001 - garbage in the store: still report the duplicate
            other = "another process"
        msg = (
            f"duplicate rank {me.rank} at {where}: claimed by {other} and by {me.where()}; "
            f"every process needs a distinct RANK in 0..{ws - 1}"
        )
        _post_error(store, msg)
        raise RendezvousError(msg)

    keys = [f"rank/{r}" for r in range(ws)]
    joined: List[int] = [me.rank]
    last_progress = deadline.elapsed()
    while True:
        err = store.get("error").decode(errors="replace") if store.check(["error"]) else None
        d = decide(ws, joined, err)
        if d.action == "fail":
            raise RendezvousError(f"rank {me.rank}: rendezvous at {where} failed: {d.error}")
        if d.action == "done":
            break
        if deadline.expired():
            raise RendezvousTimeoutError(
                f"init_process_group on rank {me.rank}: {ws - len(d.missing)}/{ws} ranks joined the rendezvous at "
                f"{where} within {deadline.elapsed():.1f}s; missing: rank{'s' if len(d.missing) > 1 else ''} "
                f"{format_ranks(d.missing)}. Start the missing rank(s) with the same rendezvous address and "
                f"WORLD_SIZE={ws}, or raise the deadline with timeout= / {ENV.TIMEOUT}",
                missing=d.missing,
            )
        slice_s = min(1.0, max(0.05, deadline.remaining()))
        try:
            store.wait(keys, timeout=slice_s)
            joined = list(range(ws))
        except StoreTimeoutError as e:
            miss = set(getattr(e, "missing", None) or keys)
            joined = [r for r, k in enumerate(keys) if k not in miss]
        if deadline.elapsed() - last_progress >= progress_interval:
            last_progress = deadline.elapsed()
            d = decide(ws, joined, None)
            if d.missing:
                logger.warning(
                    "rank %d: %d/%d joined at %s; waiting for rank%s %s (%.0fs elapsed, deadline %.0fs)",
                    me.rank,
                    ws - len(d.missing),
                    ws,
                    where,
                    "s" if len(d.missing) > 1 else "",
                    format_ranks(d.missing),
                    deadline.elapsed(),
                    deadline.timeout or float("inf"),
                )
    return [MemberInfo.decode(v) for v in store.multi_get(keys)]


def new_nonce() -> str:
    """128 random bits as 32 hex digits (``os.urandom``: ``uuid`` would add its import to every worker's start-up)."""
    return os.urandom(16).hex()


def setup_logging(level: Optional[int] = None) -> None:
    """A stderr handler for procgroup's own messages unless the application configured logging.

    ``level``: the parsed PROCGROUP_LOG_LEVEL (None: unset; then WARNING when this adds the handler).
    Records still propagate, so an application's (or pytest's) root handlers see them too; our handler is
    only added when the root logger has none, so nothing is printed twice.
    """
    if level is not None:
        logger.setLevel(level)
    if logger.handlers or logging.getLogger().handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("procgroup %(levelname)s: %(message)s"))
    logger.addHandler(h)
    if level is None:
        logger.setLevel(logging.WARNING)
