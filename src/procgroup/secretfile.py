"""The per-user secret file, Erlang-cookie style, and where each process's job secret came from.

With no ``PROCGROUP_SECRET`` and no secret file named by ``--secret-file`` / ``PROCGROUP_SECRET_FILE``,
every procgroup process of a user authenticates with ``$XDG_CONFIG_HOME/procgroup/secret`` (by
default ``~/.config/procgroup/secret``): 32 random bytes in hex, mode 0600, created by the first
process that needs it.  Nodes that share a home directory then agree with no flags.

Creation is atomic: the secret is written and fsynced under a temporary name opened with
``O_EXCL``, then hard-linked into place (``link`` fails if the file appeared meanwhile), so two
processes racing to create it agree on one value and no reader ever sees half a secret.  A file
readable or writable by group or others is refused (like ssh's private keys), naming ``chmod 600``.

:func:`note_secret_source` / :func:`secret_source` remember, per secret, a phrase saying where it
came from ("the per-user secret file /home/u/.config/procgroup/secret"), so an authentication
error can name the file on this side.  No environment is read here (see :mod:`procgroup.config`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
from typing import Optional

from .errors import ConfigError

__all__ = [
    "USER_SECRET_RELPATH",
    "read_named_secret",
    "read_user_secret",
    "load_or_create_user_secret",
    "note_secret_source",
    "secret_source",
]

#: the per-user secret file, relative to the user's configuration directory ($XDG_CONFIG_HOME or ~/.config)
USER_SECRET_RELPATH = os.path.join("procgroup", "secret")
#: how long a reader waits for a racing creator's content where hard links are unavailable
_EMPTY_WAIT_S = 2.0

_SOURCES: dict[bytes, str] = {}


def _key(secret: bytes) -> bytes:
    return hashlib.sha256(b"procgroup-secret-source:" + secret).digest()


def note_secret_source(secret: bytes, source: str) -> None:
    """Remember that ``secret`` came from ``source`` (a phrase such as ``PROCGROUP_SECRET``), for error messages."""
    _SOURCES[_key(secret)] = source


def secret_source(secret: bytes) -> Optional[str]:
    """The phrase :func:`note_secret_source` recorded for ``secret`` in this process, or None."""
    return _SOURCES.get(_key(secret))


def read_named_secret(path: str, what: str, *, label: Optional[str] = None) -> Optional[str]:
    """The secret in a file the user named (``what``: the flag or variable); None when it does not exist.

    ``label`` heads the error messages (default ``what=path``).  Raises :class:`ConfigError` when the file
    cannot be read or is empty.  Its permissions are the user's business (a file shared on a cluster
    filesystem may be group-readable on purpose).
    """
    head = label if label is not None else f"{what}={path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"{head}: cannot read it ({e.strerror or e})") from e
    value = data.strip()
    if not value:
        raise ConfigError(
            f"{head} is empty; put the job secret in it, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > FILE"
        )
    return value


def read_user_secret(path: str) -> Optional[str]:
    """The secret in the per-user file ``path``; None when it does not exist.

    Raises :class:`ConfigError` when the file is not a regular file owned by this user, has any
    group or other permission bits (the fix: ``chmod 600 PATH``), or stays empty; :class:`OSError`
    when it cannot be read.
    """
    end = time.monotonic() + _EMPTY_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"the per-user secret file {path} is a symbolic link; make it a regular file") from e
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"the per-user secret file {path} is not a regular file; remove it")
            if st.st_uid != os.geteuid():
                raise ConfigError(
                    f"the per-user secret file {path} belongs to uid {st.st_uid}, not to this user "
                    f"(uid {os.geteuid()}); remove it, or set PROCGROUP_SECRET"
                )
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"the per-user secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others could read "
                    f"the job secret; run `chmod 600 {path}` (or remove it to get a new one)"
                )
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        value = data.decode("ascii", "replace").strip()
        if value:
            return value
        if time.monotonic() >= end:  # only a creator without hard links leaves it empty, and only for a moment
            raise ConfigError(f"the per-user secret file {path} is empty; remove it to get a new one")
        time.sleep(0.02)


def load_or_create_user_secret(path: str) -> tuple[str, bool]:
    """(the secret in ``path``, whether this call created the file).

    Creates the directory (mode 0700) and the file (mode 0600, fsynced, atomically, see the module
    docstring) when missing.  Raises :class:`ConfigError` for a file that is refused (see
    :func:`read_user_secret`), :class:`OSError` when it can be neither read nor created (e.g. a
    read-only home directory).
    """
    value = read_user_secret(path)
    if value is not None:
        return value, False
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    new = secrets.token_hex(32)
    tmp = os.path.join(d, f".secret.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.write(fd, (new + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails with EEXIST if a racer won: then both use the racer's secret
            created = True
        except FileExistsError:
            created = False
        except OSError:  # no hard links here (some FUSE/SMB mounts): create the file itself with O_EXCL
            created = _create_in_place(path, new)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    if created:
        _fsync_dir(d)
    value = read_user_secret(path)
    if value is None:
        raise ConfigError(f"the per-user secret file {path} vanished while it was being created; run again")
    return value, created


def _create_in_place(path: str, value: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
