"""Telemetry: each rank publishes a compact status record to the store at an interval, for ``procgroup top``.

Nothing here runs in a collective's path.  A daemon thread wakes every ``interval`` seconds
(``PROCGROUP_TOP_INTERVAL``, default 1; 0: no thread at all), reads what the rank already keeps -- the
groups' flight records (:meth:`procgroup.process_group.ProcessGroup.status`), the transport's byte counter
(:meth:`procgroup.transport.base.Transport.sent_bytes`), and its own CPU time and RSS from ``/proc``
(:func:`procgroup.procfs.stat`) -- and writes one JSON record with one ``set`` on the watchdog's store
connection.  The viewer is :mod:`procgroup.launcher.top`.

Store key (the job's store, no prefix): ``top/<rank>``, JSON::

    {"v": 1, "rank": 2, "world": 4, "host": "h1", "pid": 4242, "t": wall time of the sample,
     "ival": interval, "state": "op" | "compute" | "failed",
     "op": {"name", "sig", "group", "gid", "seq", "secs", "members"} or null,  # the oldest collective in flight
     "idle": seconds since the last collective ended (null: none yet),
     "last": last completed seq of the default group (-1: none),
     "g": {"<gid>": [last completed seq, seq in flight or null], ...},  # every group this rank is a member of
     "bytes": payload bytes sent so far, "bps": bytes/s over the last interval,
     "rss": resident bytes, "cpu": CPU % over the last interval (null on the first record)}

``members`` is null for a group of every rank, else the group's global ranks, so that the viewer can tell
which ranks a waiting rank waits for.  A rank's records stop when it destroys its process group or dies;
the viewer tells a stale record by its age (``t``) against ``ival``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import procfs
from .errors import ProcGroupError
from .flight import describe_signature
from .watchdog import GroupStatus

__all__ = ["RECORD_VERSION", "TOP_KEY_PREFIX", "top_key", "build_record", "Publisher", "start_publisher"]

logger = logging.getLogger("procgroup")

#: format of the record (the viewer rejects others by name)
RECORD_VERSION = 1
#: every rank's record is ``TOP_KEY_PREFIX + str(rank)`` in the job's store
TOP_KEY_PREFIX = "top/"

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def top_key(rank: int) -> str:
    """The store key of ``rank``'s status record."""
    return f"{TOP_KEY_PREFIX}{rank}"


def _op(g: GroupStatus, world: int, now: float) -> Dict[str, Any]:
    rec = g.inflight
    assert rec is not None
    every = len(g.ranks) == world and list(g.ranks) == list(range(world))
    return {
        "name": rec.op,
        "sig": describe_signature(tuple(rec.signature)),
        "group": g.name,
        "gid": g.gid,
        "seq": rec.seq,
        "secs": round(max(0.0, now - rec.start), 3),
        "members": None if every else list(g.ranks),
    }


def build_record(
    rank: int,
    world: int,
    host: str,
    pid: int,
    groups: Sequence[GroupStatus],
    *,
    now: float,
    wall: float,
    interval: float,
    sent: int,
    bps: Optional[float],
    rss: Optional[int],
    cpu: Optional[float],
) -> Dict[str, Any]:
    """The status record of this rank (a JSON-able dict, see the module docstring); pure.

    ``now`` is ``time.monotonic()`` (the clock of the flight records), ``wall`` the ``time.time()`` stored as
    ``t``.  Groups this rank is not a member of, and closed ones, are left out.
    """
    mine = [g for g in groups if g.member and not g.closed]
    inflight = [(g.inflight.start, i, g) for i, g in enumerate(mine) if g.inflight is not None]
    oldest = min(inflight)[2] if inflight else None
    ended = [g.flight[-1] for g in mine if g.flight and g.flight[-1].end is not None]
    latest = max(ended, key=lambda r: r.end or 0.0) if ended else None
    default = next((g for g in mine if g.gid == 0), None)
    if oldest is not None:
        state = "op"
    elif latest is not None and latest.state == "failed":
        state = "failed"
    else:
        state = "compute"
    return {
        "v": RECORD_VERSION,
        "rank": rank,
        "world": world,
        "host": host,
        "pid": pid,
        "t": round(wall, 3),
        "ival": interval,
        "state": state,
        "op": _op(oldest, world, now) if oldest is not None else None,
        "idle": round(max(0.0, now - latest.end), 3) if latest is not None and latest.end is not None else None,
        "last": default.last_completed if default is not None else -1,
        "g": {str(g.gid): [g.last_completed, g.inflight.seq if g.inflight is not None else None] for g in mine},
        "bytes": sent,
        "bps": None if bps is None else round(bps, 1),
        "rss": rss,
        "cpu": None if cpu is None else round(cpu, 1),
    }


class Publisher:
    """The daemon thread that writes this rank's status record every ``interval`` seconds.

    ``store`` is a store connection of its own or one shared with the watchdog (a thread-safe TCPStore);
    ``groups`` returns the :class:`GroupStatus` snapshots; ``sent_bytes`` the transport's byte counter.
    The thread ends quietly when the store goes away (the job is ending) and logs any other error once.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        host: str,
        groups: Callable[[], List[GroupStatus]],
        sent_bytes: Callable[[], int],
        interval: float,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"Publisher interval must be > 0 seconds, got {interval!r}")
        self.store = store
        self.rank = rank
        self.world = world
        self.host = host
        self.groups = groups
        self.sent_bytes = sent_bytes
        self.interval = float(interval)
        self.pid = os.getpid()
        self._prev: Optional[tuple[float, int, Optional[int]]] = None  # (monotonic, bytes sent, cpu ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="procgroup-telemetry", daemon=True)

    def start(self) -> "Publisher":
        """Start the thread (its first record is written at once); returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (joined for at most 2 s unless called from it); idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except ProcGroupError as e:  # the store is gone: the job is ending
                logger.debug("telemetry stopped: %s", e)
                return
            except Exception as e:  # noqa: BLE001 - a status display must never take a worker down
                logger.warning("procgroup top: rank %d stopped publishing its status: %r", self.rank, e)
                return
            self._stop.wait(self.interval)

    def sample(self) -> Dict[str, Any]:
        """This rank's record now (and remember the counters for the next rates)."""
        now, wall = time.monotonic(), time.time()
        sent = int(self.sent_bytes())
        st = procfs.stat(self.pid)
        ticks = st.utime + st.stime if st is not None else None
        bps = cpu = None
        if self._prev is not None:
            t0, b0, c0 = self._prev
            dt = now - t0
            if dt > 0:
                bps = max(0, sent - b0) / dt
                if ticks is not None and c0 is not None:
                    cpu = 100.0 * (ticks - c0) / _CLK_TCK / dt
        self._prev = (now, sent, ticks)
        return build_record(
            self.rank,
            self.world,
            self.host,
            self.pid,
            self.groups(),
            now=now,
            wall=wall,
            interval=self.interval,
            sent=sent,
            bps=bps,
            rss=st.rss_pages * _PAGE if st is not None else None,
            cpu=cpu,
        )

    def tick(self) -> None:
        """Write one record (one store ``set``)."""
        self.store.set(top_key(self.rank), json.dumps(self.sample(), separators=(",", ":")).encode())


def start_publisher(
    store: Any,
    world: Any,
    groups: Callable[[], List[GroupStatus]],
    interval: float,
) -> Optional[Publisher]:
    """Start publishing ``world``'s rank status to ``store`` every ``interval`` s (0: nothing; returns None).

    ``world`` is the :class:`~procgroup.process_group.World`; its ``on_close`` gets the publisher's stop.
    """
    if not interval > 0:
        return None
    names = getattr(world, "hostnames", None) or []
    host = names[world.rank] if len(names) > world.rank else os.uname().nodename
    pub = Publisher(store, world.rank, world.size, host, groups, world.transport.sent_bytes, interval)
    world.on_close.append(pub.start().stop)
    return pub
