"""Every exception procgroup raises, in one place.

The vocabulary (after trio and PyTorch elastic):

* :class:`ProcGroupError` -- base of everything; a ``RuntimeError`` so code
  written for torch.distributed (which raises ``RuntimeError``/``DistError``)
  keeps catching it.
* :class:`ConfigError` -- the user's input or environment is wrong; the
  message names the bad value and the setting that fixes it.
* :class:`ProtocolError` -- bytes from the *remote* side broke the protocol.
* :class:`AuthenticationError` -- the peer did not prove the job secret.
* :class:`ClosedError` -- *you* closed the object and then used it.
* :class:`BrokenError` / :class:`PeerFailureError` -- the *peer* or network
  went away.
* :class:`DistTimeoutError` -- a deadline passed; the message says what was
  being waited for, for how long, and which setting extends it.
* :class:`RendezvousError` -- group formation failed (missing, duplicate,
  inconsistent members).
* :class:`CollectiveMismatchError` -- ranks called different collectives.

Every message should answer three questions: what was happening, who is at
fault (rank / peer / host:port), and what to do about it.  Use
:func:`describe` to build the "what was happening" part consistently.
"""

from __future__ import annotations

import pickle
from typing import Any, Iterable, Optional

__all__ = [
    "ProcGroupError",
    "ConfigError",
    "NotInitializedError",
    "ProtocolError",
    "FrameTooLargeError",
    "AuthenticationError",
    "ClosedError",
    "BrokenError",
    "PeerFailureError",
    "ConnectError",
    "PortInUseError",
    "StoreError",
    "DistTimeoutError",
    "StoreTimeoutError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "CollectiveMismatchError",
    "GroupBrokenError",
    "ForkedProcessError",
    "ConcurrentUseError",
    "describe",
    "format_ranks",
    "ObjectPicklingError",
    "UnsafeObjectError",
    "DeviceTensorError",
]


class ProcGroupError(RuntimeError):
    """Base class of every procgroup error."""


class ConfigError(ProcGroupError, ValueError):
    """Invalid argument, environment variable or configuration.

    The message names the offending value and how to fix it.
    """


class NotInitializedError(ProcGroupError):
    """A call that needs a process group was made before init_process_group()."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"{what} needs the default process group, but it has not been initialized: "
            "call procgroup.init_process_group() first (or run under `procgroup run`)."
        )


class ProtocolError(ProcGroupError):
    """The remote side sent bytes that violate the wire protocol."""


class FrameTooLargeError(ProtocolError):
    """A length header exceeded the configured maximum."""


class AuthenticationError(ProcGroupError):
    """The peer failed (or we failed) the HMAC challenge with the job secret."""


class ClosedError(ProcGroupError):
    """The object was closed by this process and then used."""


class BrokenError(ProcGroupError):
    """The peer or the network went away (connection reset, EOF, dead process)."""


class PeerFailureError(BrokenError):
    """A specific rank died or disconnected while others depended on it."""

    def __init__(self, message: str, *, peer: Optional[int] = None) -> None:
        super().__init__(message)
        self.peer = peer


class ConnectError(BrokenError):
    """Could not reach a server (store or peer) before the deadline."""


class PortInUseError(ConfigError):
    """The requested listening address is already taken."""


class StoreError(ProcGroupError):
    """The key-value store reported an error."""


class DistTimeoutError(ProcGroupError, TimeoutError):
    """A deadline passed while waiting."""


class StoreTimeoutError(DistTimeoutError, StoreError):
    """A store wait/get passed its deadline."""


class RendezvousError(ProcGroupError):
    """Forming the group failed: duplicate rank, world-size mismatch, bad rank..."""


class RendezvousTimeoutError(RendezvousError, DistTimeoutError):
    """Not every member joined before the deadline; lists the missing ranks."""

    def __init__(self, message: str, *, missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(missing)


class CollectiveMismatchError(ProcGroupError):
    """Ranks of one group called different collectives at the same sequence number."""


def format_ranks(ranks: Iterable[int], limit: int = 16) -> str:
    """Compact, readable rank list: ``[0-3, 5, 7]``; long lists are elided."""
    rs = sorted(set(int(r) for r in ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else (f"{rs[i]}, {rs[j]}" if j == i + 1 else f"{rs[i]}-{rs[j]}"))
        i = j + 1
    if len(parts) > limit:
        parts = parts[:limit] + [f"... ({len(rs)} ranks)"]
    return "[" + ", ".join(parts) + "]"


def describe(
    op: str,
    *,
    seq: Optional[int] = None,
    rank: Optional[int] = None,
    peer: Any = None,
    group: Optional[str] = None,
    elapsed: Optional[float] = None,
) -> str:
    """The standard "what was happening" prefix of an error message.

    >>> describe("all_reduce", seq=7, rank=1, peer=0, elapsed=2.5)
    'all_reduce (seq 7) on rank 1 waiting for rank 0 after 2.50s'
    """
    s = op
    if seq is not None:
        s += f" (seq {seq})"
    if group:
        s += f" in group {group}"
    if rank is not None:
        s += f" on rank {rank}"
    if peer is not None:
        if isinstance(peer, (list, tuple, set, frozenset)):
            s += f" waiting for ranks {format_ranks(peer)}"
        else:
            s += f" waiting for {'rank ' + str(peer) if isinstance(peer, int) else peer}"
    if elapsed is not None:
        s += f" after {elapsed:.2f}s"
    return s


#: torch.distributed's names for the errors a backend raises
DistBackendError = ProcGroupError
DistError = ProcGroupError


# -- issue 11 items 7, 15, 17: object collectives and point-to-point hardening
class ObjectPicklingError(ProcGroupError, TypeError, pickle.PicklingError):
    """An object collective could not pickle a member's object; every member of the call raises it.

    The failing member still takes part in the call (it sends a marker instead of its object), so the
    group stays in step.  ``ranks``: the global ranks whose object could not be pickled.  Also a
    ``TypeError`` and a ``pickle.PicklingError``, as plain pickling would raise.
    """

    def __init__(self, message: str, *, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)


class UnsafeObjectError(ProcGroupError, pickle.UnpicklingError):
    """Safe mode refused to unpickle a peer's object: it names a class outside the allow-list.

    ``name``: the refused global as ``"module.Qualname"``; the message says how to allow it.
    """

    def __init__(self, message: str, *, name: str = "") -> None:
        super().__init__(message)
        self.name = name


# -- issue 11 items 2, 3, 11 (threads, fork, a broken group) --------------------------------------------------
class GroupBrokenError(BrokenError):
    """A group is unusable since an earlier call failed (deadline, dead peer, mismatch): its members are out of
    step.  The message names the original error (op, seq, when); destroy_process_group and re-init, or restart."""


class ForkedProcessError(ProcGroupError):
    """A process group was used in a child forked after init_process_group (the parent's group is not its own)."""


class ConcurrentUseError(ProcGroupError):
    """Two threads called blocking operations on one process group at the same time; the message names both."""


# --- issue 11 items 5, 8, 9, 10, 16.3: bad identity input, stale file store -----------------------------------
class NoIdentityError(ConfigError):
    """No launcher's variables are set at all (nothing says this process's rank); a *bad* value is ConfigError."""


class StaleStoreError(RendezvousError):
    """A ``file://`` store left by a job whose processes are dead (killed): delete the file, or use a fresh path."""


# --- issue 10 item 3: procgroup's own API carries CUDA tensors (backend="nccl") --------------------------------
class DeviceTensorError(ConfigError):
    """A torch tensor on a device (not the CPU) reached a collective or point-to-point op.

    :func:`procgroup.data.as_flat` raises it; the collectives catch it to hand the call to the world's engine
    when that engine carries the tensor's device (``backend="nccl"``).  Where none does (the cpu backend) it
    reaches the caller as the ConfigError it is, naming the fix.  ``device``: the tensor's ``torch.device``.
    """

    def __init__(self, message: str, *, device: object = None) -> None:
        super().__init__(message)
        self.device = device
