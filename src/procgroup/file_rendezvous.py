"""Open a ``file://`` rendezvous store, detecting one left behind by a killed job (issue 11, item 10).

A job that ends normally deletes its file; one killed with SIGKILL leaves it, with its members' claims
(``pg/<restart>/rank/<r>``: host, pid and process start time).  A new job on the same path used to read
those claims as a *duplicate rank*.  :func:`open_file_store` looks at the recorded members first, under the
file's exclusive lock:

* every recorded member ran on this host and is dead (its pid is gone, or now belongs to a process started
  at another time): the file is stale.  It is renamed aside (``<path>.stale-<time>``, atomically, and only
  if the path still names the file that was inspected, so two new members cannot both take it over) and a
  fresh file is started; a WARNING names the file, the dead pids and where the old one went.
* some recorded members on this host are dead and others alive (or on other hosts): the file may be in use
  by a job that lost members; :class:`StaleStoreError` names the dead pids, the file's age, and says to
  delete the file (or use a fresh path).
* no dead member: returned as is (a live process holding the same rank is still a duplicate rank,
  reported by the rendezvous).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, List, Optional

from .errors import StaleStoreError
from .rendezvous import MemberInfo, host_key, member_is_dead
from .store import FileStore

__all__ = ["open_file_store"]

logger = logging.getLogger("procgroup")


def _recorded(get: Callable[[str], Optional[bytes]], prefix: str) -> List[MemberInfo]:
    """The members claimed under ``prefix`` (the rendezvous' keys), read with ``get`` (no blocking)."""
    raw = get(f"{prefix}/world_size")
    try:
        ws = int(raw) if raw is not None else 0
    except ValueError:
        return []
    out = []
    for r in range(min(ws, 1 << 16)):
        v = get(f"{prefix}/rank/{r}")
        if v is not None:
            try:
                out.append(MemberInfo.decode(v))
            except Exception:  # noqa: BLE001 - a garbled claim says nothing about liveness
                continue
    return out


def _age(path: str) -> str:
    try:
        return f"{time.time() - os.stat(path).st_mtime:.0f}s"
    except OSError:
        return "?"


def open_file_store(path: str, timeout: float, prefix: str) -> FileStore:
    """A FileStore on ``path``; a stale one from a killed job is moved aside first (see the module docstring).

    ``prefix``: the namespace the rendezvous uses (``pg/<restart>``).  Raises StaleStoreError when the file
    holds dead and live members, ConfigError when it cannot be opened.
    """
    here = host_key()
    for _ in range(5):  # another new member may take the stale file over under us: then reopen the path
        store = FileStore(path, timeout=timeout)
        try:
            taken = store.under_lock(functools.partial(_decide, store, prefix=prefix, here=here))
        except BaseException:
            store.close()
            raise
        if not taken:
            return store
        store.close()  # moved aside (by us or by another new member): open the path again
    return FileStore(path, timeout=timeout)


def _decide(store: FileStore, get: Callable[[str], Optional[bytes]], prefix: str, here: str) -> bool:
    """Under the file's lock: False to use ``store`` as is; True when the path must be reopened (this call
    moved the stale file aside, or another member already had).  StaleStoreError for a partly dead job."""
    if not store.names_path():
        return True
    members = _recorded(get, prefix)
    dead = [m for m in members if member_is_dead(m, here)]
    if not dead:
        return False
    pids = ", ".join(f"rank {m.rank} pid {m.pid} on {m.hostname}" for m in dead)
    if len(dead) < len(members):
        raise StaleStoreError(
            f"file:// store {store.path} is from a killed job: its member(s) {pids} are dead (last written "
            f"{_age(store.path)} ago) while others it records may still be running. Delete the file "
            f"(rm {store.path}) once that job is gone, or use a fresh path per job"
        )
    aside = f"{store.path}.stale-{int(time.time())}-{os.getpid()}"
    age = _age(store.path)
    os.rename(store.path, aside)
    logger.warning(
        "file:// store %s was left by a killed job (every member it records is dead: %s; last written %s ago): "
        "moved it to %s and starting afresh",
        store.path,
        pids,
        age,
        aside,
    )
    return True
