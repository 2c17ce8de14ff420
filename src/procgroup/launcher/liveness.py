"""Liveness of a multi-node job's agents: the watcher thread, heartbeats, lost connections, SIGUSR1 relay.

Every agent runs one :class:`Watcher` per generation on a store connection of its own.  Each slice
(``beat_interval(heartbeat_timeout)`` seconds, at most 0.5 s) it

1. parks a ``wait`` on the generation's abort key -- the first failure record or stop reason wakes
   every agent within a store round trip;
2. beats its heartbeat counter and reads the others' -- a node whose counter has not moved for
   ``heartbeat_timeout`` seconds is declared lost (a silent link: power loss, a cable, a partition);
3. on node 0, whose agent hosts the store in-process: looks up every other agent's watch connection
   among the server's open connections -- a closed connection (a SIGKILLed agent, a crashed host
   whose kernel still answered) declares that node lost at once, long before its heartbeat limit;
4. reads the job's SIGUSR1 counter -- a SIGUSR1 to any agent is counted there, and every other agent
   passes it on to its own workers (:meth:`UsrOneRelay.remote`).

A lost node is published as the generation's abort record (with ``lost_node``), so every agent stops.
The keys are under ``launch/`` (see :mod:`.gang`): ``launch/hb/{node}`` and ``launch/usr1``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from ..errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    ConnectError,
    ProtocolError,
    StoreTimeoutError,
)
from ..protocol.control import decode_record
from .config import DEFAULT_HEARTBEAT_TIMEOUT

__all__ = [
    "PREFIX",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "LOST_ERRORS",
    "USR1_KEY",
    "beat_interval",
    "key",
    "hb_key",
    "local_address",
    "UsrOneRelay",
    "Watcher",
]

PREFIX = "launch"
#: the job's SIGUSR1 counter (+1 per SIGUSR1 an agent received from outside)
USR1_KEY = f"{PREFIX}/usr1"
#: errors of a store connection that is gone for good
LOST_ERRORS = (BrokenError, ConnectError, ClosedError, ProtocolError, AuthenticationError)


def beat_interval(heartbeat_timeout: float, slice_max: float = 0.5) -> float:
    """Seconds between heartbeats (and per parked wait of the watcher): six beats per timeout, at most
    ``slice_max``, at least 20 ms."""
    return max(0.02, min(slice_max, heartbeat_timeout / 6.0))


def key(gen: int, *parts: object) -> str:
    """The store key ``launch/g{gen}/part/...`` of generation ``gen``."""
    return "/".join([PREFIX, f"g{gen}", *(str(p) for p in parts)])


def hb_key(node: int) -> str:
    """The heartbeat counter of node ``node``."""
    return f"{PREFIX}/hb/{node}"


def local_address(store: Any) -> Optional[str]:
    """``host:port`` of this end of a TCPStore's connection, as the server names the peer; None if unknown."""
    addr = getattr(store, "local_address", None)
    return str(addr) if addr else None


class _GangLike(Protocol):
    """What a :class:`Watcher` uses of its :class:`~procgroup.launcher.gang.Gang`."""

    watch_store: Any
    server: Any
    usr1: "UsrOneRelay"
    conns_at_join: set[int]

    @property
    def where(self) -> str: ...

    def wakeup(self) -> None: ...

    def abort(self, gen: int, record: dict, *, store: Any = None) -> None: ...


class UsrOneRelay:
    """Counts SIGUSR1s through the store so that one sent to any agent reaches every node's workers.

    :meth:`publish` (an agent got SIGUSR1 from outside) adds one to ``launch/usr1`` and remembers the
    value as its own; :meth:`remote` (the watcher, each slice) returns how many *other* agents' SIGUSR1s
    arrived since the last call.  Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: Optional[int] = None
        self._own: set[int] = set()

    def publish(self, store: Any) -> None:
        """Count one SIGUSR1 of this agent in the store (errors of a lost store are ignored)."""
        try:
            v = int(store.add(USR1_KEY, 1))
        except LOST_ERRORS:
            return
        with self._lock:
            self._own.add(v)

    def baseline(self, value: int) -> None:
        """Start counting from ``value`` (the counter at the rendezvous), unless already counting."""
        with self._lock:
            if self._seen is None:
                self._seen = value

    def remote(self, value: int) -> int:
        """How many SIGUSR1s of other agents the counter's new ``value`` holds beyond the last one seen
        (0 on the first call: history before this agent watched is not replayed)."""
        with self._lock:
            if self._seen is None:
                self._seen = value
                return 0
            n = sum(1 for v in range(self._seen + 1, value + 1) if v not in self._own)
            self._own = {v for v in self._own if v > value}
            self._seen = max(self._seen, value)
            return n


@dataclass
class Watcher:
    """Background thread of one agent for one generation (see the module docstring).

    ``abort_record``: the record that stopped the generation; ``lost``: the store connection is gone;
    ``lost_nodes``: node rank -> why it was declared lost; ``usr1``: SIGUSR1s of other agents to pass on.
    """

    gang: _GangLike
    gen: int
    node_rank: int
    assignment: Any  # gang.Assignment (nodes: NodeSlot with node_rank, host, pid, conn)
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    slice_s: float = 0.5
    abort_record: Optional[dict] = None
    lost: Optional[str] = None
    lost_nodes: dict[int, str] = field(default_factory=dict)
    usr1: int = 0
    _conn_seen: set[int] = field(default_factory=set)  # nodes whose watch connection was seen open
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start the daemon thread."""
        self._thread = threading.Thread(target=self._run, name=f"procgroup-gang-watch-g{self.gen}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (joined for at most two slices and a second)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.slice_s * 2 + 1.0)

    @property
    def triggered(self) -> bool:
        """Whether the generation must stop: an abort record was written, or the store is lost."""
        return self.abort_record is not None or self.lost is not None

    def _declare_lost(self, st: Any, n: Any, why: str) -> None:
        self.lost_nodes[n.node_rank] = why
        st.set(key(self.gen, "lost", n.node_rank), why.encode())  # read by every agent's collect()
        self.gang.abort(
            self.gen,
            {"reason": why, "host": n.host, "lost_node": n.node_rank, "timestamp": time.time()},
            store=st,
        )

    def _check_connections(self, st: Any, others: list) -> None:
        """Node 0: an agent whose watch connection is no longer open on the server is lost, now."""
        server = self.gang.server
        peers: Optional[Callable[[], set[str]]] = getattr(server, "peers", None)
        if peers is None:
            return
        live = peers()
        for n in others:
            conn = getattr(n, "conn", None)
            if not conn or n.node_rank in self.lost_nodes:
                continue
            if conn in live:
                self._conn_seen.add(n.node_rank)
                continue
            if n.node_rank not in self._conn_seen:
                continue  # never seen under that name (a NAT between us?): the heartbeat decides
            if st.check([key(self.gen, "result", n.node_rank)]):
                continue  # it finished and reported: a closed connection is fine
            self._declare_lost(
                st,
                n,
                f"node {n.node_rank} ({n.host}, agent pid {n.pid}) is lost: its connection to the agents' store "
                "closed, and no heartbeat can come after that (its agent was killed or exited, or its host went down)",
            )

    def _check_heartbeats(self, st: Any, others: list, seen: dict[int, tuple[int, float]]) -> None:
        now = time.monotonic()
        try:
            values = st.multi_get([hb_key(n.node_rank) for n in others], timeout=self.slice_s)
        except StoreTimeoutError:
            return  # a node that just joined has not created its key yet
        for n, raw in zip(others, values):
            v = int(raw or b"0")
            if n.node_rank not in seen or seen[n.node_rank][0] != v:
                seen[n.node_rank] = (v, now)
            elif now - seen[n.node_rank][1] > self.heartbeat_timeout and n.node_rank not in self.lost_nodes:
                if st.check([key(self.gen, "result", n.node_rank)]):
                    continue  # it finished and reported: silence is fine
                self._declare_lost(
                    st,
                    n,
                    f"node {n.node_rank} ({n.host}, agent pid {n.pid}) stopped answering: no heartbeat for "
                    f"{self.heartbeat_timeout:g}s (its agent was killed, or the network to it failed; "
                    "--heartbeat-timeout sets the limit)",
                )

    def _run(self) -> None:
        self._conn_seen.update(self.gang.conns_at_join)
        st = self.gang.watch_store
        assert st is not None, "the watcher starts after the gang connected its watch store"
        abort = key(self.gen, "abort")
        others = [n for n in self.assignment.nodes if n.node_rank != self.node_rank]
        seen: dict[int, tuple[int, float]] = {}
        try:
            st.add(hb_key(self.node_rank), 1)
            while not self._stop.is_set():
                if self.abort_record is not None:  # stopping: keep beating and watching until the results are in
                    if self._stop.wait(self.slice_s):
                        break
                else:
                    try:
                        st.wait([abort], timeout=self.slice_s)
                    except StoreTimeoutError:
                        pass
                    else:
                        try:
                            rec = decode_record(st.get(abort))
                        except ValueError:
                            rec = {"reason": "another agent stopped the job"}
                        if isinstance(rec.get("lost_node"), int):  # another agent found a node lost: so here
                            self.lost_nodes.setdefault(rec["lost_node"], str(rec.get("reason")))
                        self.abort_record = rec
                        self.gang.wakeup()
                        continue
                st.add(hb_key(self.node_rank), 1)
                n_usr1 = self.gang.usr1.remote(int(st.add(USR1_KEY, 0)))
                if n_usr1:
                    self.usr1 += n_usr1
                    self.gang.wakeup()
                if not others:
                    continue
                if self.gang.server is not None:
                    self._check_connections(st, others)
                self._check_heartbeats(st, others, seen)
        except StoreTimeoutError:
            self.lost = f"the agents' store at {self.gang.where} stopped answering"
            self.gang.wakeup()
        except LOST_ERRORS as e:
            if not self._stop.is_set():
                self.lost = f"lost the connection to the agents' store at {self.gang.where} ({e})"
                self.gang.wakeup()
