"""All-to-all through shared memory, for groups whose ranks share a host (issue 14 item 1).

Only rank ``r`` knows what it sends (``S[r][j]`` bytes to rank ``j``) and what
it receives; the others learn it from a *header* that travels with the first
round, so the ranks agree on every later step without a round trip of its own:

1. Every rank writes, straight into its next arena slot (``Arena.next_slot``),
   a header -- where each destination's piece ends in its *stream* (the
   pieces for the other ranks, concatenated in rank order: its own piece never
   leaves it) and where each source's piece ends in what it receives -- and,
   when its stream fits behind the header (``cap`` bytes), the stream itself.
   A rank whose stream does not fit writes its first window of it (a slot's
   worth, see ``PIPE_PARTS``) into its big slot instead (step ``turn`` of
   ``comm.arena.big``).  Then one arena exchange (check word: the call's,
   salted with this op's): the payloads of the small case, and the first
   round of the large one, are complete when it returns.
2. Every rank reads every header, so every rank derives the same facts: which
   senders were inline, every stream's length ``n_r`` (the longest: ``M``),
   hence the same number of further rounds (``max ceil(n_r / W_r) - 1``, each one big-slot sync
   with a check word naming the call, the op and that number) -- or, with
   ``M`` above ``select.BIG_LIMIT['all_to_all']`` (or without big slots), the same
   decision to move the non-inline pieces otherwise: each rank reads its pieces
   straight out of their senders' ``sendbuf`` (``Arena.reader``: one
   process_vm_readv each, one copy instead of two), then one arena exchange
   ends the call (an owner keeps its buffer until every reader is done).  The
   header's *offer* (``_OFFER``) says where a sender's ``sendbuf`` lies and
   whether that rank can read every other's memory (every rank writes it,
   inline or not, on either path, where it can read the others; the compiled
   path only for one ``sendbuf``, not the list form); where some header offers
   nothing an arena exchange of the addresses comes first
   (``onecopy.read_directly``); as messages where a rank cannot read.  All
   agree: they read the same headers.  At N=4 on 2 CPUs the reads took a 4 MiB all_to_all
   from 2.5 to 1.5 ms, 2 MiB from 1.4 to 1.0 (N=2: 4 MiB 0.53 to 0.41 ms); the offer in the header then saved
   the exchange of addresses: same-process A/B, 64 KiB-4 MiB pieces, N=2 0.87-0.97x, N=3 0.76-0.96x, N=4
   0.86-1.00x the time with it.  When some
   stream was not inline, every rank also checks every pair (what ``r`` sends
   ``j`` against what ``j`` expects from ``r``), so a count mismatch fails on
   every rank at once instead of leaving the others in a sync; with every
   stream inline, each rank checks what it receives (as the message
   algorithms do) and the others have already finished.
3. Round ``t`` moves window ``t`` of every stream (bytes ``[t W, (t + 1) W)``,
   ``W`` each sender's window, a function of its stream's length that every
   rank reads in the headers): each rank copies that window of its stream
   into its buffer ``t & 1``, syncs, and copies its own piece of every other
   rank's window out of that rank's buffer (the double buffering and the
   check words are those of ``algorithms.bigarena``).

A rank's own piece is copied locally.  The result is the bytes the message
algorithms deliver, bit for bit.  The arena exchange and the syncs keep
their guarantees: deadlines, peer-death and abort checks, futex back-off,
and calls that disagree (another op, another dtype: the check word) never
complete together, so no data is ever mixed.

Compiled path (``ShmArena.exchange_a2a``, where the arena runs ``_native``): steps 1-3 for the common case in
one C call -- header and stream written (the stream into the arena slot, or into the big buffer when it fits
one window), the exchange, then this rank's own piece and every piece for it copied out of the slots or big
buffers, large copies with the GIL released; and the offered reads of streams beyond the limit, with the
exchange that ends them (pass 22: N=4, 2 MiB a rank, 1.05-1.09 ms in Python against 0.42-0.67).  It takes a
call only where its stream fits one of those places (else nothing is published and the Python steps run), and
copies nothing where any stream needs further rounds or messages, an offer is missing or the counts disagree:
:func:`native_done` then runs step 2 and 3 in Python on the completed exchange.  Same slots, same header,
same check words: ranks on either path meet.  The inline and the one-window big-slot case cost the same there
(one exchange each; no step at the arena's size).  Plans bind
the layout once (``Prep.spec``; ``Prep.list_spec`` for the list form, whose inputs and outputs it reads and
writes in place).

Safety of writing step ``turn``'s big buffer before the exchange: its last
readers (step ``turn - 2``) finished before they published step
``turn - 1``'s sync (a big-slot sync, or an all-to-all's arena exchange),
which this rank saw complete.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError, ProcGroupError
from ..transport.base import address_of
from ._util import P_ALLTOALL, step, u8
from .onecopy import END_SALT, read_directly

__all__ = ["alltoall_shm", "shm_applies", "Prep", "prepare", "A2A_LIMIT_DEFAULT", "SALT", "native_done"]

#: streams longer than this go as messages (the single-copy path) instead of through the big slots; the
#: selection table's BIG_LIMIT['all_to_all'] (select.py) passes its value in
A2A_LIMIT_DEFAULT = 1 << 62

_QQ = struct.Struct("<QQ")
_Q = struct.Struct("<Q")
_CHECK = struct.Struct("<IIqqq")
_OP_ALLTOALL = 7  # beside algorithms.bigarena's op codes (1-6)
#: folded into the arena exchange's check word: another collective whose call fingerprint collides with this
#: one's (16 bits) still never completes an exchange with it
SALT = 0xA2A0_0000
#: a stream through the big slots goes in windows of 1/PIPE_PARTS of it, at least PIPE_MIN bytes, at most a slot
#: and at most STEP_MAX.
#: 1: no pipelining within a slot's worth.  benchmarks/ab_alltoall.py (shm/p1, shm/p2, shm/p4; 2-CPU host at
#: load 7-10): 2 parts took 1.04x-1.13x one part's time at N=2 from 256 KiB to 1 MiB per rank, and 4 parts
#: 1.1x-2x (an extra sync costs a wake-up when a member is descheduled; the overlap it buys needs both
#: members running).  Rerun on a quiet host before raising it.
PIPE_PARTS = 1
PIPE_MIN = 64 << 10
#: the largest window: 3/4 of a default big slot.  It was broadcast's and all_gather's 512 KiB
#: (``algorithms.bigarena.STEP_MAX``), which cut a 768 KiB stream (N=4, 1 MiB a rank) into two windows, the second
#: one a big-slot sync in Python; one window is one compiled call.  Not a whole 1 MiB: windows of exactly 1 MiB
#: have bigarena's slow mode (N=2, 4 MiB a rank, jobs of 400 calls, slowest rank per call, median: 375-390 us in
#: 1 MiB windows, 178-182 in 1 MiB - 4 KiB ones, 174-183 in 512 KiB ones).  Jobs alternating (pass 19, workers
#: bound), 512 / 768 KiB windows: N=4 1 MiB a rank 216-219 against **144-152** us (3 of 3); N=2 4 MiB (4 windows
#: against 3) 178-183 against 172-193.
STEP_MAX = 768 << 10
#: (sender, where its piece for this rank starts and ends in its stream, its stream's length)
Piece = Tuple[int, int, int, int]
#: prepared layouts kept per (counts, item size, group size, rank); past that the cache starts over
_PREP_LIMIT = 64


#: after the header's two runs: where this rank's ``sendbuf`` lies (0: not offered), the bytes of its own piece,
#: and whether it can read every other member's memory (``Arena.reader``), for the one-copy reads of a stream beyond
#: the limit; ``Prep.header`` carries zeros (nothing offered) and each call writes its offer (the compiled path
#: too, where it has every member's pid and one ``sendbuf``: ``_native_a2a.c``)
_OFFER = struct.Struct("<QQQ")


def _header_bytes(p: int) -> int:
    """Bytes of the header (two runs of p + 1 u64 words, then the offer), rounded up to 64 for the payload's
    alignment."""
    return (16 * (p + 1) + _OFFER.size + 63) & ~63


def shm_applies(comm: Any) -> bool:
    """True when ``comm`` has an arena whose slot holds the header with room to spare (every member agrees)."""
    a = comm.arena
    return a is not None and comm.size > 1 and _header_bytes(comm.size) * 2 <= a.max_bytes


class Prep:
    """What one rank derives from its counts once: byte offsets, its stream's layout and its header."""

    __slots__ = (
        "so", "ro", "rcount", "stream", "segs", "header", "hb", "send_total", "recv_total", "others", "own", "me",
        "spec",
    )  # fmt: skip

    def __init__(self, p: int, me: int, send_counts: Sequence[int], recv_counts: Sequence[int], isz: int) -> None:
        so = [0] * (p + 1)
        ro = [0] * (p + 1)
        for j in range(p):
            so[j + 1] = so[j] + int(send_counts[j]) * isz
            ro[j + 1] = ro[j] + int(recv_counts[j]) * isz
        self.me = me
        self.so, self.ro = so, ro
        self.send_total, self.recv_total = so[p] // isz if isz else 0, ro[p] // isz if isz else 0
        self.rcount = [ro[j + 1] - ro[j] for j in range(p)]
        own_s = so[me + 1] - so[me]
        own_r = ro[me + 1] - ro[me]
        #: this rank's own piece: (first byte in recvbuf, end, first byte in sendbuf), or None when empty
        self.own = (ro[me], ro[me + 1], so[me]) if own_r else None
        self.stream = so[p] - own_s
        #: (stream position, first byte in sendbuf, end byte in sendbuf) of the stream's (at most two) runs
        self.segs = [x for x in ((0, 0, so[me]), (so[me], so[me + 1], so[p])) if x[2] > x[1]]
        #: every other rank: (rank, where its piece for us starts in recvbuf, bytes expected)
        self.others = [(r, ro[r], ro[r + 1] - ro[r]) for r in range(p) if r != me]
        # header: [0, E_0 .. E_{p-1}, 0, F_0 .. F_{p-1}]: E_j where piece j ends in the stream (j = me: empty),
        # F_i where the piece from i ends in what this rank receives from the others
        e = [0] + [so[j + 1] - (own_s if j >= me else 0) for j in range(p)]
        f = [0] + [ro[i + 1] - (own_r if i >= me else 0) for i in range(p)]
        self.header = struct.pack(f"<{2 * p + 2}Q", *e, *f) + bytes(_OFFER.size)  # no offer (see _OFFER)
        self.hb = _header_bytes(p)
        #: the same layout for the compiled path (``ShmArena.exchange_a2a``: see _native_a2a.c), int64 words; one send
        #: and one recv buffer (index 0)
        own = (0, self.own[2], 0, self.own[0], self.own[1]) if self.own is not None else (-1, 0, 0, 0, 0)
        words = [p, me, self.hb, self.stream, len(self.segs), len(self.others), *own, own_s]
        for pos, a, b in self.segs:
            words += (pos, 0, a, b)
        for r, dst, want in self.others:
            words += (r, 0, dst, want)
        self.spec = struct.pack(f"<{len(words)}q", *words)

    def list_spec(self) -> bytes:
        """The compiled path's layout for the list form: send buffer j is the whole piece for rank j, recv buffer
        i the whole piece from rank i (``ShmArena.exchange_a2a`` with tuples of buffers); same header."""
        p, me = len(self.so) - 1, self.me
        e = struct.unpack_from(f"<{p + 1}Q", self.header)  # [0, E_0 .. E_{p-1}]: where each piece starts, ends
        own = (me, 0, me, 0, self.own[1] - self.own[0]) if self.own is not None else (-1, 0, 0, 0, 0)
        segs = [(j, e[j], e[j + 1] - e[j]) for j in range(p) if j != me and e[j + 1] > e[j]]
        words = [p, me, self.hb, self.stream, len(segs), len(self.others), *own, self.so[me + 1] - self.so[me]]
        for j, pos, n in segs:
            words += (pos, j, 0, n)
        for r, _dst, want in self.others:
            words += (r, r, 0, want)
        return struct.pack(f"<{len(words)}q", *words)


_PREPS: Dict[Tuple[Any, ...], Prep] = {}


def prepare(p: int, me: int, send_counts: Sequence[int], recv_counts: Sequence[int], isz: int) -> Prep:
    """The :class:`Prep` of these counts (cached)."""
    key = (p, me, isz, tuple(send_counts), tuple(recv_counts))
    try:
        got = _PREPS.get(key)
    except TypeError:  # unhashable counts: not cached
        return Prep(p, me, send_counts, recv_counts, isz)
    if got is None:
        if len(_PREPS) >= _PREP_LIMIT:
            _PREPS.clear()
        got = _PREPS[key] = Prep(p, me, send_counts, recv_counts, isz)
    return got


def _validate(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, sc: Sequence[int], rc: Sequence[int]) -> None:
    """The message algorithms' argument checks (``alltoall.check_alltoall``)."""
    from .alltoall import check_alltoall

    check_alltoall(comm, sendbuf, sc, recvbuf, rc)


def _bytes(a: np.ndarray) -> memoryview:
    """A byte memoryview of a C-contiguous array (a cast where the buffer's format allows one: 5x cheaper)."""
    try:
        return memoryview(a).cast("B")  # type: ignore[arg-type]  # numpy's stubs do not declare the buffer protocol
    except (TypeError, ValueError):  # complex formats, or not C-contiguous (u8 then says so)
        return memoryview(u8(a))  # type: ignore[arg-type]


def _window(n: int, slot: int) -> int:
    """Bytes per round of a stream of ``n`` bytes: 1/PIPE_PARTS of it (so that a sender's copy in of the next
    window overlaps the receivers' copy out of this one), at least PIPE_MIN, at most a slot and STEP_MAX (1 for
    n = 0)."""
    return max(1, min(slot, STEP_MAX, max(PIPE_MIN, ((n + PIPE_PARTS - 1) // PIPE_PARTS + 4095) & ~4095)))


def one_window(limit: int) -> int:
    """The ``lim`` of the compiled exchange (``exchange_a2a`` and a plan's bound call) for streams' limit ``limit``:
    it moves a stream through the big slots only in one window, so only up to STEP_MAX, where :func:`_window`
    cuts longer streams (every rank must cut alike: a stream that one rank writes in one window and another reads
    in two is wrong data)."""
    return min(limit, STEP_MAX)


def _copy_stream(
    dst: memoryview, dst_at: int, src: memoryview, segs: List[Tuple[int, int, int]], lo: int, hi: int
) -> None:
    """``dst[dst_at:]`` = bytes ``[lo, hi)`` of the stream made of ``segs`` of ``src``."""
    for pos, a, b in segs:
        x, y = max(lo, pos), min(hi, pos + b - a)
        if x < y:
            dst[dst_at + x - lo : dst_at + y - lo] = src[a + x - pos : a + y - pos]


def _check_word(comm: Any, rounds: int, dt: np.dtype) -> int:
    return zlib.crc32(_CHECK.pack(comm.check_word(), _OP_ALLTOALL, rounds, -1, dt.num))


def _mismatch(comm: Any, heads: List[Any], p: int) -> Optional[str]:
    """A description of the first (sender, receiver) pair whose counts disagree, from every rank's header."""
    for r in range(p):
        for j in range(p):
            if r == j:
                continue
            sent = heads[r][j + 1] - heads[r][j]
            want = heads[j][p + 2 + r] - heads[j][p + 1 + r]
            if sent != want:
                return f"rank {r} sends rank {j} {sent} bytes but rank {j} expects {want}"
    return None


def alltoall_shm(
    comm: Any,
    sendbuf: np.ndarray,
    send_counts: Sequence[int],
    recvbuf: np.ndarray,
    recv_counts: Sequence[int],
    prep: Optional[Prep] = None,
    limit: int = A2A_LIMIT_DEFAULT,
) -> None:
    """``send_counts[j]`` elements to rank j, ``recv_counts[i]`` from rank i, through the arena and big slots.

    ``prep``: the layout of these counts when the caller (a plan) keeps it; ``limit``: the longest stream
    (bytes a rank sends to the others) that goes through the big slots, longer ones going as messages.
    """
    a = comm.arena
    if prep is None:
        if a is None or not shm_applies(comm):
            raise ConfigError(
                "the shared-memory all_to_all needs a group whose ranks share a host (an arena holding "
                f"{_header_bytes(comm.size) * 2} bytes)"
            )
        isz = sendbuf.dtype.itemsize
        try:
            prep = _PREPS.get((comm.size, comm.rank, isz, tuple(send_counts), tuple(recv_counts)))
        except TypeError:  # unhashable counts
            prep = None
        if prep is None:  # counts not seen yet: the full checks, once
            _validate(comm, sendbuf, recvbuf, send_counts, recv_counts)
            prep = prepare(comm.size, comm.rank, send_counts, recv_counts, isz)
    if (
        prep.send_total > sendbuf.shape[0]
        or prep.recv_total > recvbuf.shape[0]
        or sendbuf.dtype.itemsize != recvbuf.dtype.itemsize
    ):
        _validate(comm, sendbuf, recvbuf, send_counts, recv_counts)  # raises the message algorithms' error
    big = a.big
    if big is not None:
        big.settle(comm.deadline)  # a one-way step of ours (a reduce) is past before a big buffer is written
    xa = getattr(a, "exchange_a2a", None)
    if xa is not None:  # compiled: write, exchange and copy out in one call, where it takes this layout
        f = xa(
            prep.spec,
            prep.header,
            sendbuf,
            recvbuf,
            comm.check_word() ^ SALT,
            comm.deadline,
            big,
            one_window(limit),
            limit,
        )
        if f >= 0:  # else nothing was published: the Python path below
            if f:
                native_done(comm, f, sendbuf, recvbuf, prep, limit)
            return
    sb, rb = _bytes(sendbuf), _bytes(recvbuf)
    hb = prep.hb
    cap = a.max_bytes - hb
    mine = prep.stream
    slot = a.next_slot()
    staged = slot is None
    if staged:  # an arena without in-place slots: stage the payload in scratch (one more copy)
        slot = memoryview(comm.scratch(a.max_bytes, slot=_SLOT_STAGE_A2A))
    head = prep.header
    slot[: len(head)] = head
    inline = mine <= cap
    if a.reader() is not None:  # our stream may be read straight out of sendbuf (inline: we can read the others')
        so = prep.so
        _OFFER.pack_into(slot, 16 * (comm.size + 1), address_of(sb), so[prep.me + 1] - so[prep.me], 1)
    if inline:
        for pos, x, y in prep.segs:
            slot[hb + pos : hb + pos + y - x] = sb[x:y]
    elif big is not None and mine <= limit:  # round 0 of the big slots, complete when the exchange is
        _copy_stream(memoryview(big.arrays[big.turn & 1][prep.me]), 0, sb, prep.segs, 0, _window(mine, big.slot_bytes))
    views = a.exchange(
        slot[: hb + (mine if inline else 0)] if staged else None, comm.check_word() ^ SALT, comm.deadline
    )
    _finish(comm, views, big, sb, rb, prep, limit, sendbuf.dtype)


def native_done(comm: Any, f: int, sendbuf: np.ndarray, recvbuf: np.ndarray, prep: Prep, limit: int) -> None:
    """After ``ShmArena.exchange_a2a`` returned the flags ``f`` (> 0): advance the big slots' turn, or finish in
    Python what the compiled call left (several big-slot rounds, messages, a count mismatch: its flag 4)."""
    a = comm.arena
    big = a.big
    if f & 2:  # the big buffers of this turn were used: every rank saw the same headers and agrees
        big.turn += 1
    if f & 4:  # the exchange completed, nothing was copied
        _finish(comm, a.last_slots(), big, _bytes(sendbuf), _bytes(recvbuf), prep, limit, sendbuf.dtype)


def _finish(
    comm: Any, views: Sequence[Any], big: Any, sb: memoryview, rb: memoryview, prep: Prep, limit: int, dt: np.dtype
) -> None:
    """After the exchange: this rank's own piece, the inline pieces, then (``_beyond``) the rest."""
    cap = comm.arena.max_bytes - prep.hb
    hb = prep.hb
    inline = prep.stream <= cap
    own = prep.own
    if own is not None:
        rb[own[0] : own[1]] = sb[own[2] : own[2] + own[1] - own[0]]
    # every sender's piece for us (position in its stream) and stream length; inline pieces copied now
    pieces: List[Piece] = []  # (sender, start, end, stream length) of the senders whose stream was not inline
    longest = 0
    bad = ""
    qq = _QQ.unpack_from
    q = _Q.unpack_from
    at = 8 * prep.me
    end = 8 * comm.size
    for r, dst, want in prep.others:
        v = views[r]
        lo, hi = qq(v, at)
        if q(v, end)[0] <= cap:
            if hi - lo != want:
                bad = bad or (
                    f"all_to_all on rank {prep.me}: rank {r} sent {hi - lo} bytes but recv_counts says {want}: "
                    "the ranks' send/receive counts disagree"
                )
            elif want:
                rb[dst : dst + want] = v[hb + lo : hb + hi]
        else:
            n = q(v, end)[0]
            pieces.append((r, lo, hi, n))
            longest = max(longest, n)
    if not inline:
        longest = max(longest, prep.stream)
    if not longest:  # every stream was inline: done (each rank checked what it receives)
        if bad:
            raise ProcGroupError(bad)
        return
    _beyond(comm, views, big, sb, rb, prep, pieces, inline, longest, limit, dt)


def _beyond(
    comm: Any,
    views: Sequence[Any],
    big: Any,
    sb: memoryview,
    rb: memoryview,
    prep: Prep,
    pieces: List[Piece],
    inline: bool,
    longest: int,
    limit: int,
    dt: np.dtype,
) -> None:
    """The streams that were not inline: check every pair's counts, then the big-slot rounds or messages."""
    p, me = comm.size, comm.rank
    heads = [struct.unpack_from(f"<{2 * p + 2}Q", views[r]) for r in range(p)]
    why = _mismatch(comm, heads, p)
    if why is not None:  # every rank reads the same headers: every rank raises this, none waits in a sync
        raise ProcGroupError(
            f"all_to_all on rank {me}: {why}: the ranks' send/receive counts disagree (nothing was received "
            "from the ranks whose data goes beyond the shared slot)"
        )
    if big is None or longest > limit:
        if not _offered_reads(comm, views, rb, prep, pieces) and not _direct_reads(comm, sb, rb, prep, pieces):
            _messages(comm, sb, rb, prep, pieces, inline)
    else:
        _rounds(comm, big, sb, rb, prep, pieces, inline, longest, dt)


#: scratch slot of the staged arena payload (arenas without ``next_slot``); beside ``_util``'s slots
_SLOT_STAGE_A2A = 25


def _rounds(
    comm: Any,
    big: Any,
    sb: memoryview,
    rb: memoryview,
    prep: Prep,
    pieces: List[Piece],
    inline: bool,
    longest: int,
    dt: np.dtype,
) -> None:
    """Round 0 (written before the exchange) out, then the further rounds of the big slots.

    Each sender cuts its stream into windows of its own (:func:`_window` of its stream's length, which every
    rank reads in the headers); round ``t`` carries window ``t`` of every stream that has one."""
    me, dl = comm.rank, comm.deadline
    L = big.slot_bytes
    ro = prep.ro
    mine = 0 if inline else prep.stream
    wme = _window(mine, L)
    wins = [(r, lo, hi, _window(n, L)) for r, lo, hi, n in pieces]
    rounds = max([-(-n // _window(n, L)) for _, _, _, n in pieces] + [-(-mine // wme)])
    if rounds > 1:
        big.begin(_check_word(comm, rounds, dt), dl)
    for t in range(rounds):
        bufs = big.arrays[big.turn & 1]
        big.turn += 1
        if t:
            if t * wme < mine:
                _copy_stream(memoryview(bufs[me]), 0, sb, prep.segs, t * wme, min((t + 1) * wme, mine))
            big.sync(dl)
        for r, lo, hi, w in wins:
            w0 = t * w
            x, y = max(lo, w0), min(hi, w0 + w)
            if x < y:
                rb[ro[r] + x - lo : ro[r] + y - lo] = memoryview(bufs[r])[x - w0 : y - w0]


def _offered_reads(comm: Any, views: Sequence[Any], rb: memoryview, prep: Prep, pieces: List[Piece]) -> bool:
    """:func:`_direct_reads` without its first exchange, where the headers already offer every stream that was not
    inline (``_OFFER``: every rank can read every other, every such sender published its ``sendbuf``): the pieces
    read straight out of the senders' memory, then the exchange that ends the call; False (nothing moved, every rank
    alike: they read the same headers) otherwise."""
    p, me = comm.size, comm.rank
    at = 16 * (p + 1)
    offers = [_OFFER.unpack_from(views[r], at) for r in range(p)]
    if not all(o[2] for o in offers) or not all(offers[r][0] for r, _lo, _hi, _n in pieces):
        return False
    read = comm.arena.reader()
    if read is None:  # cannot happen: we offered (a reader then existed); keep every rank on the same path
        raise ProcGroupError(f"all_to_all on rank {me}: this rank offered one-copy reads but cannot read any more")
    ro = prep.ro
    for r, lo, _hi, _n in pieces:  # the counts of every pair were checked (_mismatch); the stream skips r's own
        addr, own_r, _ = offers[r]
        read(r, rb[ro[r] : ro[r + 1]], addr + lo + (own_r if me > r else 0))
    comm.arena.exchange(None, comm.check_word() ^ SALT ^ 1 ^ END_SALT, comm.deadline)  # read_directly's closing one
    return True


def _direct_reads(comm: Any, sb: memoryview, rb: memoryview, prep: Prep, pieces: List[Piece]) -> bool:
    """The pieces of the streams that were not inline, each read straight out of its sender's ``sendbuf`` (one
    copy, :func:`.onecopy.read_directly`: every rank offers where each of its pieces lies), where every rank can
    read every other's memory; False (nothing moved) otherwise."""
    me = comm.rank
    base = address_of(sb)
    ro = prep.ro

    def reads(read: Any, offers: List[Tuple[int, ...]]) -> None:
        for r, _lo, _hi, _n in pieces:  # the counts of every pair were checked (_mismatch)
            read(r, rb[ro[r] : ro[r + 1]], offers[r][me])

    return read_directly(comm, comm.check_word() ^ SALT ^ 1, [base + x for x in prep.so[: comm.size]], reads)


def _messages(comm: Any, sb: memoryview, rb: memoryview, prep: Prep, pieces: List[Piece], inline: bool) -> None:
    """The pieces of the streams that were not inline, as messages (pairwise order: bounded data in flight)."""
    p, me = comm.size, comm.rank
    so, ro = prep.so, prep.ro
    stp = step(P_ALLTOALL)
    senders = {x[0] for x in pieces}
    for s in range(1, p):
        dst, src = (me + s) % p, (me - s) % p
        req = None
        if src in senders and ro[src + 1] > ro[src]:
            req = comm.irecv(src, rb[ro[src] : ro[src + 1]], stp)
        sreq = comm.isend(dst, sb[so[dst] : so[dst + 1]], stp) if not inline and so[dst + 1] > so[dst] else None
        if req is not None:
            st = req.wait(comm.deadline)
            if st.nbytes != ro[src + 1] - ro[src]:
                raise ProcGroupError(
                    f"all_to_all on rank {me}: rank {src} sent {st.nbytes} bytes but recv_counts says "
                    f"{ro[src + 1] - ro[src]}: the ranks' send/receive counts disagree"
                )
        if sreq is not None:
            sreq.wait(comm.deadline)
