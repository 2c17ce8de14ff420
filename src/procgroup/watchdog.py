"""Watchdog: mismatch detection and roll call through the store, off the hot path.

The fast path of a collective does no extra work for these checks: its tag
carries a fingerprint of the call (see ``process_group.py``), so ranks that call
different collectives never match each other's messages.  When a collective
has been waiting for ``check_after`` seconds, the watchdog thread of that
process publishes what it is doing and compares with the other members:

* another member at the **same** sequence number with a different call ->
  :class:`~procgroup.errors.CollectiveMismatchError` on every member, showing
  what each side called;
* otherwise it keeps the roll call current, so that a deadline error can say
  which ranks reached the op and the last completed sequence number of each.

Store keys (world store, prefix ``wd/``): ``wd/<gid>/<rank>`` holds JSON
``{"seq": in-flight seq or null, "sig": call or null, "last": last completed
seq, "t": wall time}``.  Each rank rewrites its own key at most once per
``interval``: when it changed, and at least every ``HEARTBEAT`` seconds, so
a reader can tell a rank that waits (fresh ``t``) from one that stopped
updating (stopped by SIGSTOP, or hung holding the GIL: ``t`` older than
``STALE_AFTER``).  The roll call says so, and since when.

``wd/broken/<gid>`` holds the deadline error that broke group ``gid`` on the
first member that raised it; the watchdog of a member still waiting in that
group fails its wait with :class:`~procgroup.errors.GroupBrokenError`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import CollectiveMismatchError, GroupBrokenError, PeerFailureError, ProcGroupError, format_ranks
from .flight import FlightRecord, describe_signature

__all__ = [
    "Watchdog",
    "GroupStatus",
    "roll_call",
    "describe_roll_call",
    "mismatch_message",
    "recorded_abort",
    "abort_key",
    "first_failure",
    "record_broken",
    "recorded_broken",
    "rolled_state",
    "FAILURE_KEY",
    "HEARTBEAT",
    "STALE_AFTER",
]

logger = logging.getLogger("procgroup")

#: store key of the job's first peer failure (JSON {"peer": rank, "text": message}); first writer wins
FAILURE_KEY = "failure"
#: while a call is in flight, a rank republishes its (unchanged) state this often (s)
HEARTBEAT = 1.0
#: a published state older than this (s) is stale: the rank's watchdog is not running
STALE_AFTER = 2.5


@dataclass(frozen=True)
class GroupStatus:
    """What the watchdog and the roll call read of a group: a snapshot, taken by ``ProcessGroup.status()``."""

    gid: int
    name: str
    ranks: Tuple[int, ...]
    member: bool
    closed: bool
    #: the collective in flight (None: none)
    inflight: Optional[FlightRecord]
    last_completed: int
    #: (seq, rolling hash of the fingerprints up to seq), oldest first
    chain: Tuple[Tuple[int, int], ...]
    #: the flight recorder's records, oldest first
    flight: Tuple[FlightRecord, ...]

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)


def first_failure(store: Any, e: PeerFailureError, store_host: Optional[int] = None) -> PeerFailureError:
    """Record this failure if it is the job's first; return an error naming the first failed rank.

    A rank that only lost a *survivor* (which raised and left) then still names the rank that really died.
    When the store itself is unreachable and a rank hosts it (``store_host``), that rank is the one that died.
    """
    mine = json.dumps({"peer": e.peer, "text": str(e)}).encode()
    try:
        first = json.loads(store.compare_set(FAILURE_KEY, b"", mine))
    except Exception as se:  # noqa: BLE001 - the store may be gone with the dead rank
        if store_host is not None and e.peer != store_host:
            return PeerFailureError(
                f"rank {store_host}, which hosts the store, is unreachable ({se}): it most likely failed first "
                f"(here: {e})",
                peer=store_host,
            )
        return e
    if first.get("peer") == e.peer or first.get("text") == str(e):
        return e
    return PeerFailureError(
        f"rank {first.get('peer')} failed first: {first.get('text')} (here: {e})", peer=first.get("peer")
    )


def _key(gid: int, rank: int) -> str:
    return f"wd/{gid}/{rank}"


def abort_key(gid: int) -> str:
    """Store key holding the mismatch a member of group ``gid`` found."""
    return f"wd/abort/{gid}"


def recorded_abort(store: Any, gid: int) -> Optional[str]:
    """The mismatch a member of group ``gid`` recorded before it left, if any."""
    k = abort_key(gid)
    try:
        return store.get(k, timeout=1.0).decode(errors="replace") if store.check([k]) else None
    except ProcGroupError:
        return None


def broken_key(gid: int) -> str:
    """Store key holding the deadline error that broke group ``gid``."""
    return f"wd/broken/{gid}"


def record_broken(store: Any, gid: int, text: str) -> None:
    """Record why group ``gid`` broke (first writer wins); best effort, the store may be gone."""
    try:
        store.compare_set(broken_key(gid), b"", text.encode())
    except Exception as e:  # noqa: BLE001 - the caller's error matters more
        logger.debug("could not record that group %d broke: %s", gid, e)


def recorded_broken(store: Any, gid: int) -> Optional[str]:
    """Why group ``gid`` broke on another member, if one recorded it."""
    k = broken_key(gid)
    try:
        return store.get(k, timeout=1.0).decode(errors="replace") if store.check([k]) else None
    except ProcGroupError:
        return None


def rolled_state(g: GroupStatus) -> Dict[str, Any]:
    """What a rank publishes of group ``g`` for the roll call (without the time)."""
    return _state(g)


def _state(g: GroupStatus) -> Dict[str, Any]:
    rec = g.inflight
    chain = [g.chain[-1][0], g.chain[-1][1]] if g.chain else None
    if rec is not None and g.chain and g.chain[-1][0] == rec.seq and len(g.chain) > 1:
        chain = [g.chain[-2][0], g.chain[-2][1]]  # the hash up to the last call before the one in flight
    return {
        "seq": rec.seq if rec is not None else None,
        "sig": list(rec.signature) if rec is not None else None,
        "last": g.last_completed,
        "chain": chain,
        # the hash including the call in flight: a member further on compares it with its own at that seq (a
        # member stuck in a call that its peers got through without waiting for it, e.g. two broadcast roots)
        "head": [g.chain[-1][0], g.chain[-1][1]] if rec is not None and g.chain else None,
    }


def roll_call(store: Any, g: GroupStatus) -> Dict[int, Dict[str, Any]]:
    """Every member's last published state (global rank -> state); members that never published are absent."""
    keys = [_key(g.gid, r) for r in g.ranks]
    out: Dict[int, Dict[str, Any]] = {}
    for r, k in zip(g.ranks, keys):
        try:
            if store.check([k]):
                out[r] = json.loads(store.get(k, timeout=1.0))
        except (ProcGroupError, ValueError):
            continue
    return out


#: what every mismatch message ends with
_SAME_CALLS = (
    "Every member of a group must call the same collectives in the same order, with the same dtype, element count, "
    "root and reduce op"
)


def mismatch_message(g: GroupStatus, seq: int, calls: Dict[int, tuple]) -> str:
    """The error text of a mismatch at ``seq``: which ranks called what."""
    by_call: Dict[tuple, List[int]] = {}
    for r, sig in sorted(calls.items()):
        by_call.setdefault(tuple(sig), []).append(r)
    sides = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} called {describe_signature(sig)}"
        for sig, rs in by_call.items()
    )
    return f"collective mismatch in group {g.name} at seq {seq}: {sides}. {_SAME_CALLS}"


def _stale(r: int, st: Dict[str, Any], age: float, seq: int, done: int) -> str:
    """A rank whose watchdog stopped publishing: what it last said, and where it must be now."""
    last = (
        f"seq {st['seq']} {describe_signature(tuple(st.get('sig') or ()))} in flight"
        if st.get("seq") is not None
        else f"last completed seq {st.get('last')}"
    )
    where = (
        f"the other members completed seq {done} and wait in seq {seq}, so it is stuck in seq {seq} (or just before it)"
        if done >= seq - 1
        else f"it is stuck at or before seq {seq}"
    )
    return (
        f"rank {r} stopped updating its status {age:.1f}s ago (stopped, e.g. by SIGSTOP, or hung holding the "
        f"GIL): {where}; its stale status said {last}"
    )


def describe_roll_call(g: GroupStatus, states: Dict[int, Dict[str, Any]], seq: int, now: Optional[float] = None) -> str:
    """'ranks [0, 2] reached seq 5; rank 1 last completed seq 4, not in a collective; rank 3 never reported'.

    A state whose time ``t`` is more than ``STALE_AFTER`` s before ``now`` (wall clock) is reported as stale,
    with the seq that rank must be in, judged from what the fresh members completed."""
    now = time.time() if now is None else now
    fresh = {r: st for r, st in states.items() if now - float(st.get("t", now)) <= STALE_AFTER}
    done = max([int(st.get("last", -1)) for st in fresh.values()] or [-1])
    reached, parts = [], []
    for r in g.ranks:
        st = states.get(r)
        if st is None:
            parts.append(f"rank {r} has not reported (dead, or not yet in any collective)")
        elif r not in fresh and st.get("seq") != seq:
            parts.append(_stale(r, st, now - float(st["t"]), seq, done))
        elif st.get("seq") == seq:
            reached.append(r)
        elif st.get("seq") is not None:
            parts.append(f"rank {r} is in seq {st['seq']} {describe_signature(tuple(st['sig'] or ()))}")
        else:
            parts.append(
                f"rank {r} last completed seq {st.get('last')} and is not in a collective (busy in its own code?)"
            )
    head = f"ranks {format_ranks(reached)} reached seq {seq}" if reached else f"no rank reported reaching seq {seq}"
    return "; ".join([head] + parts)


class Watchdog:
    """One daemon thread per process; started by init_process_group, stopped by destroy.

    ``groups`` returns a :class:`GroupStatus` snapshot of every group to watch; ``abort`` fails the
    transport's waits with the given error.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        groups: Callable[[], List[GroupStatus]],
        abort: Callable[[BaseException], None],
        interval: float = 0.5,
        check_after: float = 1.0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.groups = groups
        self.abort = abort
        self.interval = interval
        self.check_after = check_after
        self._published: Dict[int, Dict[str, Any]] = {}
        self._beat: Dict[int, float] = {}  # gid -> when this rank last published it (monotonic)
        self._broke: set = set()  # gids whose recorded break this rank has acted on
        self._hist: Dict[int, int] = {}  # gid -> the in-flight seq at which this rank last published its history
        self._failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="procgroup-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (joined for at most 2 s unless called from it)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except ProcGroupError as e:  # store gone (job ending): stop quietly
                logger.debug("watchdog stopped: %s", e)
                return

    def tick(self) -> None:
        """One round: fail on a recorded peer failure or mismatch, publish this rank's state, compare."""
        now = time.monotonic()
        if not self._failed and self.store.check([FAILURE_KEY]):
            # some rank saw a peer die: fail this rank's waits now, naming it, instead of at the deadline
            self._failed = True
            first = json.loads(self.store.get(FAILURE_KEY, timeout=1.0))
            self.abort(
                PeerFailureError(f"rank {first.get('peer')} failed: {first.get('text')}", peer=first.get("peer"))
            )
            return
        for g in list(self.groups()):
            if not g.member or g.closed or g.size() == 1:
                continue
            rec = g.inflight
            waiting = rec is not None and now - rec.start >= self.check_after
            st = _state(g)
            changed = st != self._published.get(g.gid)
            beat = now - self._beat.get(g.gid, 0.0) >= HEARTBEAT
            if changed or beat:  # so a rank stopped inside a call is reported in it, and a stale state shows
                self.store.set(_key(g.gid, self.rank), json.dumps(dict(st, t=time.time())).encode())
                self._published[g.gid] = st
                self._beat[g.gid] = now
            if rec is not None and now - rec.start >= self.interval:
                why = recorded_abort(self.store, g.gid)
                if why is not None:  # a member already found a mismatch in this group: fail now, same words
                    self.abort(CollectiveMismatchError(why))
                    return
            if waiting and g.gid not in self._broke:
                broke = recorded_broken(self.store, g.gid)
                if broke is not None:  # a member gave up on this group: this wait can never complete
                    self._broke.add(g.gid)
                    self.abort(GroupBrokenError(f"another member of group {g.name} gave up on it: {broke}"))
                    return
            if waiting and rec is not None and self._hist.get(g.gid) != rec.seq:
                # once per stuck call: this rank's history, for a peer whose divergence search needs it (a peer
                # ahead or behind: one-way broadcasts and reduces let members be at different calls while stuck)
                self._hist[g.gid] = rec.seq
                self._publish_history(g)
            if waiting or changed:
                self._check(g, rec)

    def _check(self, g: GroupStatus, rec: Any) -> None:
        """Same seq in flight with a different call, or a different call history: a mismatch."""
        states = roll_call(self.store, g)
        if rec is not None:
            calls = {r: tuple(st["sig"]) for r, st in states.items() if st.get("seq") == rec.seq and st.get("sig")}
            calls[self.rank] = tuple(rec.signature)
            if len(set(calls.values())) > 1:
                return self._fail(g, rec.seq, mismatch_message(g, rec.seq, calls))
        mine = dict(g.chain)
        for r, st in states.items():
            if r == self.rank:
                continue
            for ch in (st.get("chain"), st.get("head")):
                if not ch or int(ch[0]) not in mine:
                    continue
                q, h = int(ch[0]), int(ch[1])
                if mine[q] != h:
                    return self._fail(g, q, self._divergence(g, r, q, st))
        return None

    def _divergence(self, g: GroupStatus, peer: int, upto: int, st: Dict[str, Any]) -> str:
        """Find the first differing call with ``peer`` from both flight recorders (exchanged through the store);
        ``st``: the peer's published state (its call in flight, if any)."""
        mine = self._publish_history(g)
        theirs: Dict[int, tuple] = {}
        try:
            raw = self.store.get(f"wd/hist/{g.gid}/{peer}", timeout=3.0)
            theirs = {int(q): tuple(sig) for q, sig in json.loads(raw)}
        except (ProcGroupError, ValueError):
            pass
        stuck = tuple(st["sig"]) if st.get("seq") == upto and st.get("sig") else None  # the peer's call in flight
        if stuck is not None:
            theirs.setdefault(upto, stuck)
        for q in sorted(set(mine) & set(theirs)):
            if q <= upto and mine[q] != theirs[q]:
                return mismatch_message(g, q, {self.rank: mine[q], peer: theirs[q]})
        before = dict(g.chain).get(upto - 1)  # this rank's hash up to the call before, if still in its window
        agreed = st.get("chain") == [upto - 1, before]  # the peer's published hash up to that call: the same
        if stuck is not None and before is not None and agreed:
            return (  # the peer waits in the first call that differs, which this rank ran too long ago to name
                f"collective mismatch in group {g.name} at seq {upto}: rank {peer} called "
                f"{describe_signature(stuck)} and waits in it; rank {self.rank} called another collective there, "
                f"{g.chain[-1][0] - upto} calls ago (beyond the last {len(mine)} calls it remembers). {_SAME_CALLS}"
            )
        return (
            f"collective mismatch in group {g.name}: the calls of ranks {self.rank} and {peer} diverged at or "
            f"before seq {upto} (beyond the last {len(mine)} calls each rank remembers). {_SAME_CALLS}"
        )

    def _publish_history(self, g: GroupStatus) -> Dict[int, tuple]:
        """Write this rank's remembered calls of ``g`` (seq -> signature) to the store, for a peer's divergence
        search; returns them."""
        mine = {r.seq: tuple(r.signature) for r in list(g.flight)}
        hk = f"wd/hist/{g.gid}/{self.rank}"
        self.store.set(hk, json.dumps([[q, list(sig)] for q, sig in mine.items()]).encode())
        return mine

    def _fail(self, g: GroupStatus, seq: int, msg: str) -> None:
        # recorded first, so a member that sees this rank leave reports the mismatch, not a dead peer
        # every member reports the same finding
        first = self.store.compare_set(abort_key(g.gid), b"", msg.encode())
        self.abort(CollectiveMismatchError(first.decode(errors="replace") or msg))
