"""Shared plumbing of the collective algorithms: steps, scratch slots, blocks, sub-groups.

Steps
    Every message of one collective call carries the call's tag plus a
    ``step``.  Each *phase* of an algorithm owns ``ROUNDS`` consecutive steps
    (``step(phase, round)``); log-round algorithms use one step per round,
    ring algorithms one step per phase (messages between one pair of ranks
    with one tag are matched in order, so the rounds of a ring cannot cross).
    One algorithm level uses the steps ``[0, SPAN)``; :class:`SubComm` shifts a
    nested level (the stages of the hierarchical all_reduce) by multiples of
    ``SPAN`` so that stages never share a step.

Scratch slots
    ``comm.scratch(nbytes, slot)`` buffers are reused across calls; two
    buffers that are alive at the same time must use different slots.  The
    primitive algorithms use ``SLOT_TMP`` / ``SLOT_TMP2`` (receive temporaries,
    partial sums) and ``SLOT_STAGE`` (gather/scatter staging); compositions
    hold their own buffers in ``SLOT_WORK`` while calling primitives.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..transport.base import Request
from .comm import Messaging, cached_phases

__all__ = [
    "SLOT_TMP",
    "SLOT_TMP2",
    "SLOT_STAGE",
    "SLOT_WORK",
    "ROUNDS",
    "SPAN",
    "step",
    "SubComm",
    "u8",
    "flat",
    "scratch_as",
    "reduce_chain",
    "partition",
    "prefix",
    "exchange",
    "lowbit",
    "EMPTY",
]

SLOT_TMP = 0
SLOT_TMP2 = 1
SLOT_STAGE = 2
SLOT_WORK = 3

#: steps per phase (log-round algorithms need at most 64 rounds)
ROUNDS = 64
#: steps used by one algorithm level
SPAN = 1024

# phases (each owns ROUNDS steps; PHASE * ROUNDS + round < SPAN)
P_BARRIER = 0
P_BCAST = 1
P_BCAST_SCATTER = 2
P_BCAST_RING = 3
P_FOLD_IN = 4
P_RD = 5
P_FOLD_OUT = 6
P_RS = 7
P_AG = 8
P_REDUCE = 9
P_GATHER = 10
P_SCATTER = 11
P_BRUCK = 12
P_ALLTOALL = 13

EMPTY = np.empty(0, dtype=np.uint8)


def step(phase: int, rnd: int = 0) -> int:
    if not 0 <= rnd < ROUNDS:
        raise ValueError(f"round {rnd} outside [0, {ROUNDS})")
    s = phase * ROUNDS + rnd
    assert s < SPAN
    return s


def lowbit(x: int) -> int:
    return x & -x


def u8(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array (a view, never a copy: received data must land in ``a``)."""
    if not a.flags.c_contiguous:
        raise ConfigError(
            f"collective buffers must be C-contiguous (got shape {a.shape}, strides {a.strides}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    return a.reshape(-1).view(np.uint8)


def flat(a: Optional[np.ndarray], what: str = "buffer") -> Any:
    """``a`` as a 1-D C-contiguous view (None stays None); ConfigError for other layouts."""
    if a is None:
        return None
    if not isinstance(a, np.ndarray):
        raise ConfigError(f"{what} must be a numpy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ConfigError(
            f"{what} must be C-contiguous (got shape {a.shape}, strides {a.strides}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    return a if a.ndim == 1 else a.reshape(-1)


def scratch_as(comm: Any, n: int, dtype: np.dtype, slot: int) -> np.ndarray:
    """``n`` elements of ``dtype`` of scratch (reused across calls)."""
    dt = np.dtype(dtype)
    return comm.scratch(n * dt.itemsize, slot).view(dt)


def reduce_chain(out: np.ndarray, parts: List[np.ndarray], reduce: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """``out = parts[0] op parts[1] op ...``, left to right (member order); ``reduce(x, y)`` is ``x op= y``, and
    ``reduce.ufunc`` (where set) the ufunc of ``op``.  ``out`` may be ``parts[0]``, or ``parts[1]`` where
    ``reduce`` has a ufunc, but no later part (it is written before they are read)."""
    uf = getattr(reduce, "ufunc", None)
    if uf is not None and len(parts) > 1:
        uf(parts[0], parts[1], out=out)
        rest = parts[2:]
    else:
        out[...] = parts[0]
        rest = parts[1:]
    for v in rest:
        reduce(out, v)


def partition(n: int, p: int) -> List[int]:
    """Offsets ``o[0..p]`` of ``n`` items split into ``p`` blocks whose sizes differ by at most 1."""
    base, extra = divmod(n, p)
    offs = [0] * (p + 1)
    acc = 0
    for i in range(p):
        offs[i] = acc
        acc += base + (1 if i < extra else 0)
    offs[p] = acc
    return offs


def prefix(counts: Sequence[int]) -> List[int]:
    """Offsets ``o[0..len]``: prefix sums of ``counts``."""
    offs = [0] * (len(counts) + 1)
    acc = 0
    for i, c in enumerate(counts):
        offs[i] = acc
        acc += int(c)
    offs[len(counts)] = acc
    return offs


def exchange(comm: Any, dst: int, sendbuf: np.ndarray, src: int, recvbuf: np.ndarray, stp: int) -> None:
    """sendrecv that skips empty halves (both ends compute the same sizes, so they agree)."""
    r: Optional[Request] = comm.irecv(src, u8(recvbuf), stp) if recvbuf.size else None
    s: Optional[Request] = comm.isend(dst, u8(sendbuf), stp) if sendbuf.size else None
    if r is not None:
        r.wait(comm.deadline)
    if s is not None:
        s.wait(comm.deadline)


class SubComm(Messaging):
    """A sub-group of a Comm (by parent group ranks) with its own range of steps.

    Presents the part of the Comm interface the algorithms use, so any
    algorithm runs on it unchanged.  Scratch is the parent's.
    """

    __slots__ = ("parent", "members", "rank", "size", "hosts", "deadline", "step_base", "_phases")
    arena = None  # a sub-group has no shared slots of its own: its algorithms use messages

    def __init__(self, parent: Any, members: Sequence[int], step_base: int) -> None:
        self.parent = parent
        self.members = list(members)
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.hosts = [parent.hosts[m] for m in self.members]
        self.deadline = parent.deadline
        self.step_base = step_base
        self._phases: Dict[Any, Any] = {}

    @property
    def ranks(self) -> List[int]:
        return [self.parent.ranks[m] for m in self.members] if hasattr(self.parent, "ranks") else list(self.members)

    def isend(self, peer: int, buf: Any, step: int = 0) -> Request:
        return self.parent.isend(self.members[peer], buf, self.step_base + step)

    def irecv(self, peer: int, out: Any, step: int = 0) -> Request:
        return self.parent.irecv(self.members[peer], out, self.step_base + step)

    def scratch(self, nbytes: int, slot: int = 0) -> np.ndarray:
        return self.parent.scratch(nbytes, slot)

    def _wait_many(self) -> Any:
        f = getattr(self.parent, "_wait_many", None)
        return f() if f is not None else None

    def phases(self, send_to: Sequence[int], recv_from: Sequence[int]) -> Any:
        """The parent's ``phases`` with this sub-group's ranks, at its steps (bound once per sub-group)."""

        def bind() -> Any:
            f, m = getattr(self.parent, "phases", None), self.members
            ph = f([m[p] for p in send_to], [m[p] for p in recv_from]) if f is not None else None
            return ph.at(self.step_base) if ph is not None else None

        return cached_phases(self._phases, send_to, recv_from, bind)


class HostComm(SubComm):
    """The members of a Comm on one host, with their shared slots (the parent's ``host_arena``).

    The arena and big-slot algorithms run on it as on a one-host group: ``arena`` is the host's slots (members in
    this sub-group's order) and ``check_word()`` the parent call's, so the members of a host check that they run
    the same call.
    """

    __slots__ = ("arena",)

    def __init__(self, parent: Any, members: Sequence[int], step_base: int, arena: Any) -> None:
        super().__init__(parent, members, step_base)
        self.arena = arena

    def check_word(self) -> int:
        """The parent call's check word (sequence number and fingerprint)."""
        return int(self.parent.check_word())
