"""Which job secret one node's agent uses, and the srun mode's shared secret file.

Precedence: the head node's (on stdin, --from-head) > ``PROCGROUP_SECRET`` > ``--secret-file`` >
the file node 0 writes in an srun step > a fresh random one (one node only).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from ..config import ENV, env_str
from ..errors import ConfigError
from .config import LaunchConfig

__all__ = ["resolve_secret", "remove_secret_file"]


def resolve_secret(
    cfg: LaunchConfig, environ: Mapping[str, str], *, head_secret: Optional[str] = None, node0: bool = True
) -> tuple[Optional[str], Optional[str]]:
    """(secret, file this call wrote).

    The secret is None for an srun node other than 0, which reads node 0's file while connecting;
    the file is set only on srun's node 0, which must remove it once every agent joined
    (:func:`remove_secret_file`).  Raises :class:`ConfigError` for a missing ``--secret-file``, and
    for several nodes with no way to share a secret (naming ``PROCGROUP_SECRET`` and ``--secret-file``).
    """
    if head_secret is not None:  # whatever a host's own environment says, the job's is the head's
        return head_secret, None
    s = env_str(ENV.SECRET, environ)
    if s is not None:
        return s, None
    if cfg.secret_file is not None:
        from .slurm import read_secret_file  # noqa: PLC0415

        v = read_secret_file(cfg.secret_file)
        if v is None:
            raise ConfigError(f"--secret-file {cfg.secret_file!r}: no such file")
        return v, None
    if cfg.slurm_step is not None and cfg.nnodes > 1:
        from .slurm import secret_path, write_secret_file  # noqa: PLC0415

        if node0:
            path = secret_path(cfg.slurm_step)
            return write_secret_file(path), path
        return None, None
    if cfg.nnodes > 1:
        raise ConfigError(
            f"--nnodes {cfg.nnodes}: every node must use the same job secret, and separate "
            f"`procgroup run` invocations cannot agree on a random one; export the same {ENV.SECRET} on every "
            f"node, e.g. {ENV.SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))'), or pass "
            "--secret-file FILE (on a shared filesystem, or copied to every node). The head-node mode "
            "(--hostfile) and srun share a secret themselves"
        )
    # What protocol.auth.new_secret() returns (secrets.token_hex(32)), without importing hmac and
    # OpenSSL's hashlib into the launcher before it spawns the workers (~5-15 ms).
    return os.urandom(32).hex(), None


def remove_secret_file(path: Optional[str]) -> None:
    """Remove the srun secret file ``path`` (None: nothing to do); a file already gone is fine."""
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
