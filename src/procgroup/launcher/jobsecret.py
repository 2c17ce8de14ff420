"""Which job secret one node's agent uses, and the srun mode's shared secret file.

Precedence: the head node's (on stdin, --from-head) > ``PROCGROUP_SECRET`` > ``--secret-file`` >
``PROCGROUP_SECRET_FILE`` > the file node 0 writes in an srun step > for several nodes, the per-user
secret file (``$XDG_CONFIG_HOME/procgroup/secret``, created on first use: nodes sharing a home
directory agree with no flags) > for one node, a fresh random secret per job (nobody else needs it,
so the per-user file is not used: a worker's secret is then worth nothing after its job).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ..config import ENV, env_str, user_secret_path
from ..errors import ConfigError
from ..secretfile import load_or_create_user_secret, note_secret_source
from .config import LaunchConfig

__all__ = ["resolve_secret", "remove_secret_file"]


def resolve_secret(
    cfg: LaunchConfig, environ: Mapping[str, str], *, head_secret: Optional[str] = None, node0: bool = True
) -> tuple[Optional[str], Optional[str]]:
    """(secret, file this call wrote).

    The secret is None for an srun node other than 0, which reads node 0's file while connecting;
    the file is set only on srun's node 0, which must remove it once every agent joined
    (:func:`remove_secret_file`).  Raises :class:`ConfigError` for a missing ``--secret-file`` or
    ``PROCGROUP_SECRET_FILE``, for a per-user secret file with group/other permissions, and for
    several nodes with no way to share a secret (no home directory: naming ``PROCGROUP_SECRET`` and
    ``--secret-file``).  Where the secret came from is noted for authentication errors.
    """
    if head_secret is not None:  # whatever a host's own environment says, the job's is the head's
        return _noted(head_secret, "the head node's job secret"), None
    s = env_str(ENV.SECRET, environ)
    if s is not None:
        return _noted(s, ENV.SECRET), None
    named = (
        ("--secret-file", cfg.secret_file)
        if cfg.secret_file is not None
        else (ENV.SECRET_FILE, env_str(ENV.SECRET_FILE, environ))
    )
    if named[1] is not None:
        from .slurm import read_secret_file  # noqa: PLC0415

        v = read_secret_file(named[1], named[0])
        if v is None:
            raise ConfigError(f"{named[0]} {named[1]!r}: no such file")
        return _noted(v, f"{named[0]} {named[1]}"), None
    if cfg.slurm_step is not None and cfg.nnodes > 1:
        from .slurm import secret_path, write_secret_file  # noqa: PLC0415

        if node0:
            path = secret_path(cfg.slurm_step)
            return _noted(write_secret_file(path), f"the srun step's secret file {path}"), path
        return None, None
    if cfg.nnodes > 1:
        return _user_secret(cfg, environ), None
    # What protocol.auth.new_secret() returns (secrets.token_hex(32)), without importing hmac and
    # OpenSSL's hashlib into the launcher before it spawns the workers (~5-15 ms).
    return os.urandom(32).hex(), None


def _noted(secret: str, source: str) -> str:
    note_secret_source(secret.encode(), source)
    return secret


def _user_secret(cfg: LaunchConfig, environ: Mapping[str, str]) -> str:
    """Several nodes and no secret given: the per-user secret file, created on first use."""
    path = user_secret_path(environ)
    why = "no home directory is known"
    if path is not None:
        try:
            value, _ = load_or_create_user_secret(path)
            return _noted(value, f"the per-user secret file {path}")
        except OSError as e:
            why = f"the per-user secret file {path} can be neither read nor created ({e.strerror or e})"
    raise ConfigError(
        f"--nnodes {cfg.nnodes}: every node must use the same job secret, and {why}; export the same "
        f"{ENV.SECRET} on every node, e.g. {ENV.SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))'), "
        "or pass --secret-file FILE (on a shared filesystem, or copied to every node). The head-node mode "
        "(--hostfile) and srun share a secret themselves"
    )


def remove_secret_file(path: Optional[str]) -> None:
    """Remove the srun secret file ``path`` (None: nothing to do); a file already gone is fine."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
