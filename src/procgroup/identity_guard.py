"""Refuse a bad identity at once, and tell the other members (issue 11, items 5, 8 and 9).

:func:`resolve_identity` merges the explicit ``rank=``/``world_size=`` (arguments or the init URL's query)
with what the launcher's environment says (:func:`~procgroup.identity.detect_identity`) and checks the
result *before* anything is opened: an out-of-range rank, a world size below 1, a rank without a world
size, a bad ``RANK``/``WORLD_SIZE``/``MASTER_PORT``... each raise :class:`ConfigError` headed by the bad
argument or variable and its value (``rank=2 is out of range ...``, ``MASTER_PORT=99999 is not a valid TCP
port (1-65535)``), followed by what to do.

:func:`publish_identity_failure` is the best-effort, bounded (a few seconds at most) second half: the
rank that refuses to start records why in the store's rendezvous ``error`` key, which every waiting member
reads within one poll and raises at once, naming this process's bad variable and value.  When nobody
hosts the store yet -- the bad process may be the one meant to be rank 0 -- and the bad value came from
the environment, it hosts the store itself for a moment to deliver the record.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace
from typing import Any, Optional

from .config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    ENV,
    Identity,
    RuntimeConfig,
    job_secret,
    launcher_run_id,
    master_env,
)
from .deadline import Deadline
from .errors import ConfigError, NoIdentityError, ProcGroupError
from .identity import detect_identity, resolve_master
from .netutil import is_literal_loopback, resolve
from .rendezvous import InitMethod

__all__ = ["resolve_identity", "publish_identity_failure", "PUBLISH_CONNECT_S", "PUBLISH_LINGER_S", "PUBLISH_QUICK_S"]

logger = logging.getLogger("procgroup")

#: how long a refusing rank tries to reach the store before it hosts one itself (environment errors only)
PUBLISH_CONNECT_S = 1.0
#: at most how long it keeps such a store up for the other members to read its record
PUBLISH_LINGER_S = 2.0
#: ... and its one quick try when the error came from an argument (usually made on every rank): the connect and
#: the store's handshake.  It was 1 ms, which a loaded 2-CPU VM misses (the handshake alone took longer: a CI run
#: failed test_refusal_is_recorded_in_a_live_store, and it then failed 5 of 5 runs here); a refused connection
#: still returns at once.
PUBLISH_QUICK_S = 0.05


def _given(v: Any) -> bool:
    return v is not None and v != -1


def _check_int_arg(name: str, v: Any) -> None:
    """``rank``/``world_size`` must be whole numbers (-1 or None: not given, read the environment)."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return
    raise ConfigError(
        f"{name}={v!r} is not an integer ({type(v).__name__}); pass {name}=<int>, or leave it out (-1) to read "
        f"{ENV.RANK if name == 'rank' else ENV.WORLD_SIZE} from the environment"
    )


def _check_explicit(rank: Any, world_size: Any) -> None:
    """The arguments alone: types, ``world_size >= 1``, ``rank >= 0`` (both: -1/None means "not given")."""
    _check_int_arg("rank", rank)
    _check_int_arg("world_size", world_size)
    if world_size is not None and world_size != -1 and world_size < 1:
        raise ConfigError(
            f"world_size={world_size} is not a valid world size (it must be >= 1: the number of processes in the "
            f"job); pass the job's process count, or world_size=-1 to read {ENV.WORLD_SIZE}"
        )
    if rank is not None and rank != -1 and rank < 0:
        bound = f"[0, {world_size})" if _given(world_size) else "[0, world_size)"
        raise ConfigError(
            f"rank={rank} is not a valid rank (it must be in {bound}); pass this process's rank, distinct on every "
            f"process, or rank=-1 to read {ENV.RANK}"
        )


def _explicit_identity(rank: int, world_size: int, env_error: Optional[ConfigError]) -> Identity:
    """Identity from the arguments alone (the launcher variables are absent or were overridden): MASTER_ADDR
    and MASTER_PORT still come from the environment (validated), as torch reads them."""
    if env_error is not None and not isinstance(env_error, NoIdentityError):
        logger.warning(
            "rank=%d, world_size=%d were passed: ignoring the launcher's variables (%s)", rank, world_size, env_error
        )
    addr, port = master_env()
    return Identity(
        rank=int(rank),
        world_size=int(world_size),
        master_addr=addr,
        master_port=port,
        source="explicit",
        job_id=launcher_run_id(),
    )


def resolve_identity(im: InitMethod, rank: Any = -1, world_size: Any = -1) -> Identity:
    """This process's identity: the launcher's variables, overridden by explicit rank=/world_size= (arguments,
    else the init URL's ``?rank=&world_size=``).  Checked here, before any store is opened.

    Raises ConfigError (NoIdentityError when nothing at all says who this process is) whose first words are the
    bad argument or variable and its value.
    """
    _check_explicit(rank, world_size)
    rank = im.rank if not _given(rank) and im.rank is not None else rank
    world_size = im.world_size if not _given(world_size) and im.world_size is not None else world_size
    _check_explicit(rank, world_size)
    explicit = _given(rank) and _given(world_size)
    try:
        ident = detect_identity()
        if im.scheme == "env":
            ident = resolve_master(ident)  # collective under MPI without MASTER_ADDR (uses mpi4py if present)
    except NoIdentityError as e:
        if explicit:
            ident = _explicit_identity(rank, world_size, e)
        elif _given(rank) or _given(world_size):
            have, lack, var = (
                ("rank", "world_size", ENV.WORLD_SIZE) if _given(rank) else ("world_size", "rank", ENV.RANK)
            )
            raise ConfigError(
                f"{have}={rank if have == 'rank' else world_size} was passed without {lack}=: "
                f"init_process_group({str(im)!r}) needs both; pass {lack}= too, or set {var} "
                "(or start the program with `procgroup run`, srun or mpirun)"
            ) from None
        else:
            raise NoIdentityError(
                f"init_process_group({str(im)!r}) does not know this process's rank and world size: pass rank= "
                "and world_size=, or set RANK and WORLD_SIZE, or start the program with `procgroup run`, srun or "
                f"mpirun. ({e})"
            ) from None
    except ConfigError as e:
        if not explicit:
            raise  # its message leads with the bad variable and its value
        ident = _explicit_identity(rank, world_size, e)
    if explicit and (ident.rank != rank or ident.world_size != world_size):
        ident = replace(ident, rank=int(rank), world_size=int(world_size), source="explicit")
    elif _given(rank) and ident.rank != rank:
        ident = replace(ident, rank=int(rank), source="explicit")
    elif _given(world_size) and ident.world_size != world_size:
        ident = replace(ident, world_size=int(world_size), source="explicit")
    if not 0 <= ident.rank < ident.world_size:  # an argument met the environment's other half
        r = f"rank={ident.rank}" if _given(rank) else f"{ENV.RANK}={ident.rank}"
        w = f"world_size={ident.world_size}" if _given(world_size) else f"{ENV.WORLD_SIZE}={ident.world_size}"
        raise ConfigError(
            f"{r} is out of range: with {w} the ranks are 0..{ident.world_size - 1}; give every process a "
            f"distinct rank in [0, {ident.world_size}), or fix the world size"
        )
    return ident


# --------------------------------------------------------------------------- telling the others


def _job_id(cfg: RuntimeConfig, where: str) -> str:
    """The job id init would use (``_open_store``) without a valid identity: the run ids, else the address."""
    return cfg.run_id or launcher_run_id() or where


def _master(im: InitMethod) -> Optional[tuple[str, int]]:
    """The store's address init would have used, or None (unknown, or MASTER_PORT itself is bad)."""
    if im.scheme == "tcp":
        return (str(im.host), int(im.port or 0)) if im.host and im.port else None
    if im.scheme != "env":
        return None
    try:
        addr, port = master_env()
    except ConfigError:
        return None
    return addr or DEFAULT_MASTER_ADDR, port or DEFAULT_MASTER_PORT


def _record(err: ConfigError) -> bytes:
    who = f"{socket.gethostname()} pid {os.getpid()}"
    return f"a member ({who}) refused to start: {err}".encode()


def publish_identity_failure(
    im: InitMethod, store: Any, cfg: RuntimeConfig, err: ConfigError, *, from_env: bool
) -> Optional[str]:
    """Best effort, bounded: record ``err`` as the rendezvous error of the store the members meet at, so
    they fail at once naming it.  Returns how it was delivered ("store", "hosted") or None; never raises.

    ``store``: the user's store, as a procgroup Store (written directly).  tcp:// and env://: connect for up to
    :data:`PUBLISH_CONNECT_S` (one quick try when ``from_env`` is False: a wrong argument is then usually
    made on every rank); when nobody answers and the error came from the environment, host the store at that
    address for at most :data:`PUBLISH_LINGER_S` while the others read the record.  file://: nothing (a
    record left in the file would fail the next job on that path).
    """
    key = f"pg/{cfg.restart_count}/error"
    try:
        if store is not None:
            store.compare_set(key, b"", _record(err))
            return "store"
        master = _master(im)
        if master is None:
            return None
        return _publish_tcp(master, cfg, key, _record(err), from_env)
    except Exception as e:  # noqa: BLE001 - best effort: the local ConfigError is what matters
        logger.info("could not tell the other members why this process refused to start: %s", e)
        return None


def _is_local(host: str, port: int) -> bool:
    """True when ``host`` names an address of this machine (a socket can bind it)."""
    try:
        addrs = resolve(host, port)
    except ConfigError:
        return False
    for addr in addrs:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, 0))
                return True
            except OSError:
                continue
    return False


def _publish_tcp(master: tuple[str, int], cfg: RuntimeConfig, key: str, rec: bytes, from_env: bool) -> Optional[str]:
    from . import store as store_mod  # noqa: PLC0415

    host, port = master
    where = f"{host}:{port}"
    loopback = is_literal_loopback(host)
    secret = job_secret(cfg, _job_id(cfg, where), loopback=loopback)
    try:
        client = store_mod.TCPStore(
            host, port, secret=secret, timeout=2.0, connect_timeout=PUBLISH_CONNECT_S if from_env else PUBLISH_QUICK_S
        )
    except ProcGroupError:
        client = None
    if client is not None:
        try:
            client.compare_set(key, b"", rec)
        finally:
            client.close()
        return "store"
    if not from_env or cfg.store_hosted or not _is_local(host, port):
        return None
    server = store_mod.StoreServer("127.0.0.1" if loopback else "0.0.0.0", port, secret=secret)
    try:
        server.start()
    except (OSError, ProcGroupError):
        return None  # not this host's address, or someone bound it meanwhile
    try:
        own = store_mod.TCPStore(host, port, secret=secret, timeout=2.0, connect_timeout=1.0)
        own.compare_set(key, b"", rec)
        own.close()
        dl, seen = Deadline.after(PUBLISH_LINGER_S), False
        while not dl.expired():
            n = server.num_connections
            seen = seen or n > 0
            if seen and n == 0 and dl.elapsed() > 1.0:
                break
            time.sleep(0.02)
    finally:
        server.close()
    return "hosted"
