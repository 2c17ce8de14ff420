"""The Transport interface: reliable, ordered, tagged messages between ranks.

Every transport (memory, shm, tcp) implements exactly this, and one
conformance suite (``tests/unit/test_transport_conformance.py``) checks it.
Algorithms and the public API are written only against this interface.

Semantics (MPI-like, deliberately small):

* A transport connects one process (``rank``) to every other rank of one
  world of ``world_size`` ranks.  Ranks are *global* ranks; groups map onto
  them above this layer.
* ``isend(dst, tag, data)`` sends the bytes of ``data`` (any C-contiguous
  buffer) to ``dst``.  The caller must not modify ``data`` until the returned
  request completes; completion means the buffer may be reused, not that the
  peer has received it.
* ``irecv(src, tag, out)`` receives the next message from ``src`` (or from any
  rank, ``src=ANY_SOURCE``) carrying ``tag`` into the writable buffer ``out``.
  A message longer than ``out`` is an error (:class:`~procgroup.errors.ProcGroupError`
  naming both sizes); a shorter one fills a prefix and ``Status.nbytes`` says
  how much.
* Non-overtaking: messages from one sender to one receiver with the same tag
  are matched in the order they were sent; receives posted for the same
  (src, tag) are satisfied in the order they were posted.
* Different tags are independent: a message with tag A never blocks a
  receive of tag B.  Tags are integers in ``[0, 2**63)``; the group layer
  encodes (group, sequence number, step) in them (see ``procgroup.group``).
* Zero-length messages are legal.
* ``Request.wait(deadline)`` raises :class:`~procgroup.errors.DistTimeoutError`
  when the deadline passes (the request stays pending and may be waited on
  again), :class:`~procgroup.errors.PeerFailureError` when the peer it depends
  on is known to be dead, :class:`~procgroup.errors.ClosedError` after
  ``close()``.
* Sending to yourself is allowed at this layer (the API layer forbids it in
  ``send``/``recv`` as torch does, but algorithms may use it).
* Blocking waits must not burn a core: spin briefly, then block in the
  kernel (futex, socket, condition variable).

Arenas (optional).  ``arena(key, members)`` may return an :class:`Arena`: a
set of shared slots, one per member, through which the members of a group
exchange small payloads in one step with no tag matching (the shm transport
gives one to groups whose ranks all share a host; the memory transport to
any group).  ``exchange(data, check, deadline)`` publishes this member's
bytes with a ``check`` word, waits until every member has published the same
call (the same count of exchanges and the same ``check``) and returns a view
of every member's bytes, in member order, valid until this member's next
exchange.  Because every exchange waits for every member, a slot is never
rewritten while a peer may still read it (two slots per member alternate).
Members whose ``check`` differs never complete (the group layer's watchdog
names the mismatch); waits honour the deadline, peer death, ``abort`` and
``close`` like requests do.  Callers serialise exchanges of one arena.

Big slots (optional, issue 14 item 1).  An arena may carry a :class:`BigArena`
(``arena.big``, else None): two large buffers per member (``arrays[k][i]``,
writable only by member ``i``) and a counter per member.  A collective above
the arena size announces its check word (``begin(check, deadline)``), then
alternates writing into its own buffer and ``sync(deadline)`` (publish the
counter, wait until every member's is there) with reading the others'
buffers.  A step may be one-way (``sync(deadline, WAIT_NONE)``: publish and
go on; a reduce's non-root), and the member then *settles* it (waits until
every member reached it) before it writes a buffer again.  The rules that make double buffering safe (see
``algorithms.bigarena``): step ``t`` uses buffers ``t & 1`` (``turn`` counts
the steps, across calls), every step syncs at least once after its writes,
and a member reads a step's buffers only before its next step's first sync.
Members whose ``check`` differs never get through a sync together.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from ..deadline import Deadline
from ..errors import DistTimeoutError, PeerFailureError

__all__ = [
    "ANY_SOURCE",
    "ARENA_BYTES",
    "Arena",
    "BigArena",
    "WAIT_ALL",
    "WAIT_NONE",
    "READ_GATHER",
    "READ_BCAST",
    "RR_ALLREDUCE",
    "RR_REDSCAT",
    "Status",
    "Request",
    "Transport",
    "CompletedRequest",
    "address_of",
    "as_bytes_view",
    "as_writable_view",
    "raise_if_stuck",
]

#: Source wildcard for irecv/recv.
ANY_SOURCE = -1

#: Largest tag value + 1.
TAG_LIMIT = 1 << 63

Buffer = Union[bytes, bytearray, memoryview, "object"]


@dataclass(frozen=True)
class Status:
    """What a completed receive got (sends report ``source=dst``, ``nbytes`` sent)."""

    source: int
    nbytes: int


class Request(abc.ABC):
    """A pending send or receive."""

    @abc.abstractmethod
    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        """Block until complete or until ``deadline`` (None: never).  Idempotent once complete."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True when complete (successfully or with an error that ``wait`` will raise)."""


class CompletedRequest(Request):
    """A request that completed at the moment it was posted."""

    __slots__ = ("_status",)

    def __init__(self, status: Status) -> None:
        self._status = status

    def wait(self, deadline: Optional[Deadline] = None) -> Status:
        return self._status

    def test(self) -> bool:
        return True


class Transport(abc.ABC):
    """Tagged point-to-point messages among the ranks of one world."""

    #: "memory" | "loopback" | "shm" | "tcp" | "router"
    kind: str = "abstract"
    rank: int
    world_size: int
    #: payload bytes this rank has sent to other ranks (messages and arena slots), for `procgroup top`: a plain
    #: increment on the send path, so concurrent sends from two threads may rarely lose one (a statistic, not a total)
    bytes_sent: int = 0

    @abc.abstractmethod
    def isend(self, dst: int, tag: int, data: Buffer) -> Request: ...

    @abc.abstractmethod
    def irecv(self, src: int, tag: int, out: Buffer) -> Request: ...

    def send(self, dst: int, tag: int, data: Buffer, deadline: Optional[Deadline] = None) -> None:
        self.isend(dst, tag, data).wait(deadline)

    def recv(self, src: int, tag: int, out: Buffer, deadline: Optional[Deadline] = None) -> Status:
        return self.irecv(src, tag, out).wait(deadline)

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource (sockets, segments, threads).  Idempotent.

        Pending requests complete with :class:`~procgroup.errors.ClosedError`.
        """

    def sent_bytes(self) -> int:
        """Payload bytes sent to other ranks so far (:attr:`bytes_sent`; a router sums its sub-transports)."""
        return self.bytes_sent

    def mark_peer_failed(self, peer: int, reason: str) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Tell the transport that ``peer`` is dead (learned out of band, e.g. via the store).

        Pending and future requests that depend on ``peer`` fail with
        :class:`~procgroup.errors.PeerFailureError` carrying ``reason``.
        """

    def abort(self, exc: BaseException) -> None:
        """Fail every pending and every later request with ``exc`` (sticky until close).

        Used when the watchdog learns, out of band, that the job cannot go on
        (collective mismatch, a peer reported dead through the store): blocked
        waits return at once with that error instead of at their deadline.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement abort()")

    def unmatched(self, src: int, tag: int, mask: int) -> Optional[Tuple[int, int]]:
        """An arrived message no receive has taken whose tag differs from ``tag`` only in the bits of ``mask``.

        ``src``: its sender (ANY_SOURCE: any).  Returns (its source, its tag), or None (also when this
        transport cannot tell).  Diagnostics for a receive that waits (the p2p dtype check, issue 11
        item 15): never on the fast path, so a scan of the queue is fine.
        """
        return None

    def arena(self, key: int, members: Sequence[int], *, spanning: bool = False) -> Optional["Arena"]:
        """Shared slots for the group ``key`` of global ranks ``members`` (this rank among them), or None.

        Every member gets an arena or every member gets None (the answer depends only on
        values all members share), so algorithms may choose by it.  ``spanning``: ``members`` are one
        host's members of a group that spans hosts, so their waits are mostly for a stage between hosts
        (hundreds of microseconds and more): a transport that spins before it sleeps may sleep sooner.
        """
        return None

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: payload bytes of one arena slot (every transport's): the largest small collective that goes through an arena
ARENA_BYTES = 32 << 10
#: modes of :meth:`Arena.bind_read`: ``recv[j*n:(j+1)*n]`` = member j's ``send`` (all_gather); a non-root's
#: ``send`` = the root's (broadcast)
READ_GATHER, READ_BCAST = 0, 1
#: modes of :meth:`Arena.bind_reduce_read`: ``send`` = the reduction over members, in place (all_reduce); ``recv`` =
#: block ``index`` of the members' ``send`` reduced (reduce_scatter)
RR_ALLREDUCE, RR_REDSCAT = 0, 1


class Arena(abc.ABC):
    """One-step exchange of small payloads among a fixed set of members (see the module docstring)."""

    #: members (global ranks) in member order, and this process's index among them
    members: Sequence[int]
    index: int
    #: the most bytes one member may publish per exchange
    max_bytes: int
    #: the group's big slots (see the module docstring), or None
    big: Optional["BigArena"] = None
    #: the group's one-way queue for small broadcasts and reduces (``transport.shm.queue.ShmQueue``), or None
    queue: Any = None

    @abc.abstractmethod
    def exchange(self, data: Optional[Buffer], check: int, deadline: Optional[Deadline]) -> Sequence[memoryview]:
        """Publish ``data`` (None: no bytes), wait for every member's, return them all (member order).

        ``check`` (a u32) must be equal on every member for the same call.
        """

    def reader(self) -> Optional[Callable[[int, memoryview, int], None]]:
        """``read(i, out, addr)``: copy ``out.nbytes`` bytes at address ``addr`` of member ``i``'s memory into
        ``out`` without member ``i``'s help (one copy: all_to_all's large pieces), where this arena can read every
        other member's memory; None otherwise (the default).  ``i`` must keep those bytes until the read is done.
        Raises PeerFailureError when member ``i`` died."""
        return None

    def writer(self) -> Optional[Callable[[int, memoryview, int], None]]:
        """``write(i, data, addr)``: copy ``data`` to address ``addr`` of member ``i``'s memory without member
        ``i``'s help (a pair's broadcast: the root writes part of the result while the other rank reads the rest),
        where this arena can write every other member's memory; None otherwise (the default).  ``i`` must not use
        those bytes until the write is done.  Raises PeerFailureError when member ``i`` died."""
        return None

    def bind_read(self, mode: int) -> Optional[Callable[..., Optional[bool]]]:
        """The whole one-copy read protocol of ``algorithms.onecopy.read_directly`` in one compiled call, for a
        collective's repeated calls: ``fn(send, recv, check, end, root, deadline)`` -- offer ``send``'s address
        with ``check``, read the pieces of ``mode`` (:data:`READ_GATHER`, :data:`READ_BCAST`)
        out of the other members' buffers, then the closing exchange with ``end``.  It returns True when done,
        False where some member cannot read the others (nothing moved; every member returns False), None where
        the sizes do not fit the mode (nothing published: the caller runs the protocol in Python).  None (the
        default) where the arena has no such call; same slots and check words as the Python protocol, so a member
        on either path takes part in the same call."""
        return None

    def bind_reduce_read(self, mode: int) -> Optional[Callable[..., Optional[bool]]]:
        """The reductions by one-copy reads of ``algorithms.onecopy`` (``allreduce_onecopy``,
        ``reduce_scatter_onecopy``) in one compiled call: ``fn(send, recv, check, op, type, deadline)`` with
        ``mode`` :data:`RR_ALLREDUCE` or :data:`RR_REDSCAT` and the compiled reduction's codes (``op``, ``type``).  It
        returns as :meth:`bind_read`'s (True done, False nobody moved anything as some member cannot read, None
        refused: nothing published).  None (the default) where the arena has no such call."""
        return None

    def fence(self) -> None:
        """A full memory barrier: this member's stores to its slot before its loads of the others' slots (the
        handshake of ``algorithms.onecopy.bcast_pair``).  Arenas that offer a :meth:`writer` implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no fence (it offers no writer)")

    def pid_of(self, i: int) -> int:
        """The process id of member ``i`` where this arena can read or write its memory, else 0."""
        return 0

    def next_slot(self) -> Optional[memoryview]:
        """This member's writable payload bytes (``max_bytes``) of the next :meth:`exchange`, or None where the
        arena has no such view.  What is written there before ``exchange(None, ...)`` is what that exchange
        publishes (all_to_all writes its header and data in place, without a staging copy)."""
        return None


#: ``wait`` of :meth:`BigArena.sync`: every member (a full synchronisation), or none (a one-way step)
WAIT_ALL = -1
WAIT_NONE = -2


class BigArena(abc.ABC):
    """Two big buffers per member plus a published counter (see the module docstring)."""

    #: members (global ranks) in member order, and this process's index among them
    members: Sequence[int]
    index: int
    #: bytes of one buffer
    slot_bytes: int
    #: ``arrays[k][i]``: buffer ``k`` (0, 1) of member ``i``, a uint8 numpy array of ``slot_bytes``
    arrays: Sequence[Sequence[Any]]
    #: steps taken so far by the algorithms (step t uses buffers ``t & 1``); the same on every member
    turn: int = 0

    @abc.abstractmethod
    def begin(self, check: int, deadline: Optional[Deadline] = None) -> None:
        """Start a call whose syncs carry ``check`` (u32, equal on every member); settles a one-way step of this
        member first (:meth:`settle`), so the call may write its buffers."""

    @abc.abstractmethod
    def sync(self, deadline: Optional[Deadline], wait: int = WAIT_ALL) -> None:
        """Publish this member's next count and wait until every member has reached it (for this call).

        ``wait`` WAIT_NONE makes the step one-way (a reduce's non-root: publish and go on); a transport may treat
        every step as WAIT_ALL.  A member whose last step was one-way waits before it writes its buffers again or
        publishes (:meth:`settle`; :meth:`begin` and :meth:`sync` do it).

        Raises like :meth:`Arena.exchange` waits do: ClosedError, the abort error, PeerFailureError,
        DistTimeoutError past ``deadline``.
        """

    def settle(self, deadline: Optional[Deadline]) -> None:
        """Wait until every member has reached this member's last one-way step; nothing to do after a full sync
        (the default: a transport that takes no one-way steps)."""
        return None

    def put(self, k: int, off: int, data: Any, pieces: bool) -> None:
        """``data`` (a C-contiguous numpy array) into this member's buffer ``k`` at byte ``off``; ``pieces``: each
        reader takes its own part of it, not the whole (a transport may store the two kinds differently: the shm
        one streams the copy past the caches, see ``ShmBigArena.put``).  The default: a plain copy."""
        self.arrays[k][self.index][off : off + data.nbytes] = data.reshape(-1).view("u1")


def raise_if_stuck(
    rank: int,
    what: str,
    missing: List[int],
    failed: Mapping[int, str],
    deadline: Optional[Deadline],
    *,
    members: Optional[Sequence[int]] = None,
    where: str = "",
) -> None:
    """The verdict of a shared-slot wait on the members ``missing``: raise if one of them is dead or time is up.

    PeerFailureError for the first missing member in ``failed`` (rank -> reason), else DistTimeoutError once
    ``deadline`` has passed, else nothing (keep waiting).  ``what`` names the wait ("shared-slot exchange",
    "big-slot collective").  With ``members`` (the shm arenas, whose reasons name the rank) the messages name
    the group and ``where`` (which call or sync); without (the memory transport) they name the dead rank.
    """
    dead = [m for m in missing if m in failed]
    if dead:
        d = dead[0]
        if members is None:
            msg = f"rank {rank}: {what} cannot complete: rank {d} failed ({failed[d]})"
        else:
            msg = f"rank {rank}: {what} with ranks {members} cannot complete: {failed[d]}"
        raise PeerFailureError(msg, peer=d)
    if deadline is not None and deadline.expired():
        if members is None:
            msg = f"rank {rank}: {what}: ranks {missing} did not arrive after {deadline.elapsed():.2f}s"
        else:
            msg = (
                f"rank {rank}: {what} ({where}): ranks {missing} of {members} did not arrive "
                f"within {deadline.elapsed():.2f}s"
            )
        raise DistTimeoutError(msg)


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat, read-only-or-writable byte view of a C-contiguous buffer (no copy)."""
    # Buffer admits any buffer-protocol object (numpy, torch), which typing can name only from Python 3.12 on
    mv = data if isinstance(data, memoryview) else memoryview(data)  # type: ignore[arg-type]  # any buffer
    if not mv.c_contiguous:
        from ..errors import ConfigError

        raise ConfigError("transport buffers must be C-contiguous; pass np.ascontiguousarray(x) or x.contiguous()")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def address_of(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer, read-only ones too (0 when empty): what an
    :meth:`Arena.reader` of another member reads at, and what the shm transport's rendezvous offers."""
    import numpy as np  # the transports' other users of numpy import it lazily too

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def as_writable_view(out: Buffer) -> memoryview:
    mv = as_bytes_view(out)
    if mv.readonly:
        from ..errors import ConfigError

        raise ConfigError("receive buffer is read-only; pass a writable array (np.array(x, copy=True) or a bytearray)")
    return mv
