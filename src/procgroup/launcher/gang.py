"""The agents of a multi-node job, talking through the store node 0's agent hosts.

Every agent (node 0's included) opens two connections to the store at
``--master-addr:--master-port``: one for the main thread, one for a
:class:`~.liveness.Watcher` thread that parks a ``wait`` on the generation's
abort key (in slices of at most 0.5 s) and beats a heartbeat between slices
(node 0's also notices an agent's connection closing: :mod:`.liveness`).
Keys, all under ``launch/`` (the workers' keys are under ``pg/``; elastic
rounds add theirs, :mod:`.elastic`)::

    launch/g{G}/joined           counter: join order of generation G
    launch/g{G}/agent/{slot}     AgentInfo (JSON) of the agent that joined in that slot
    launch/g{G}/pids/{node}      [[rank, local_rank, pid], ...] once its workers are started
    launch/g{G}/abort            the first failure record / stop reason (compare_set: first writer wins)
    launch/g{G}/fail/{node}      that node's failure record (host, rank, pid, status, traceback tail, time)
    launch/g{G}/result/{node}    that node's RunResult (JSON) after its teardown
    launch/g{G}/bye/{node}       read everything; node 0 closes the store when all said bye
    launch/g{G}/lost/{node}      why that node was declared lost (collect() stops waiting for it)
    launch/hb/{node}             heartbeat counter (+1 per slice)
    launch/usr1                  SIGUSR1s the agents received (each passes the others' on to its workers)

Rendezvous is decide-then-execute: :func:`assign` is a pure function of the
joined agents' :class:`AgentInfo` records that returns the
:class:`Assignment` (node ranks, rank offsets, the workers' master port) or
raises :class:`RendezvousError`; every agent computes it from the same
records, so every agent reaches the same answer without another round.

Node ranks: explicit ``--node-rank`` values are used as given; an agent
without one gets the lowest free rank -- 0 if it hosts the store (its host
is the master address), then the others by host name.  That is
deterministic for distinct hosts; two rankless agents on one host cannot be
ordered deterministically and are an error that says to pass --node-rank.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..deadline import Deadline
from ..errors import (
    AuthenticationError,
    ConnectError,
    ProcGroupError,
    RendezvousError,
    StoreTimeoutError,
)
from ..netutil import format_hostport
from ..protocol.control import decode_pids, decode_record, encode_pids, encode_record
from .config import Placement
from .liveness import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    LOST_ERRORS,
    USR1_KEY,
    UsrOneRelay,
    Watcher,
    beat_interval,
    hb_key,
    key,
    local_address,
)
from .report import RunResult, result_from_json, result_to_json, worker_from_dict

if TYPE_CHECKING:  # imported lazily at run time: a one-node launch never loads the store
    from ..store import StoreServer, TCPStore

__all__ = [
    "AgentInfo",
    "NodeSlot",
    "Assignment",
    "assign",
    "Gang",
    "GangAborted",
    "WATCH_SLICE",
    "LOST_AFTER",
]

#: at most this many seconds per parked wait of the watcher (and between heartbeats)
WATCH_SLICE = 0.5
#: a node whose heartbeat has not moved for this long is declared lost (the default of --heartbeat-timeout)
LOST_AFTER = DEFAULT_HEARTBEAT_TIMEOUT
#: seconds per parked wait of the main thread (between checks for signals and aborts)
MAIN_SLICE = 0.5
#: how long node 0 keeps the store up for the others to read the results
BYE_TIMEOUT = 10.0
#: seconds between "waiting for nodes" progress lines
PROGRESS_EVERY = 10.0

_LOST_ERRORS = LOST_ERRORS


class GangAborted(ProcGroupError):
    """Another agent gave up on this generation (or the store went away) while we waited."""


@dataclass(frozen=True)
class AgentInfo:
    """What one agent tells the others when it joins a generation."""

    host: str
    pid: int
    nproc: int
    nnodes: int
    run_id: str
    max_restarts: int
    node_rank: Optional[int]  # requested; None = assign one
    hosts_store: bool
    worker_port: Optional[int] = None  # node 0: the workers' MASTER_PORT for this generation
    conn: Optional[str] = None  # host:port of this agent's watch connection, as the store server sees it
    min_nodes: Optional[int] = None  # elastic (--nnodes MIN:MAX): MIN; nnodes is MAX

    def to_json(self) -> bytes:
        """This agent's join info as a store value (:func:`~procgroup.protocol.control.encode_record`)."""
        return encode_record(asdict(self))

    @classmethod
    def from_json(cls, data: "bytes | str") -> "AgentInfo":
        """The join info in a store value; raises ControlMessageError (a ValueError) for a malformed one."""
        d = decode_record(data)
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]  # JSON values

    def who(self) -> str:
        return f"{self.host} (agent pid {self.pid})"


@dataclass(frozen=True)
class NodeSlot:
    node_rank: int
    slot: int  # join slot of its agent
    host: str
    pid: int
    nproc: int
    rank_offset: int
    conn: Optional[str] = None  # the agent's watch connection (see AgentInfo.conn)


@dataclass(frozen=True)
class Assignment:
    """The outcome of one generation's rendezvous: the same on every node."""

    nodes: tuple[NodeSlot, ...]  # by node rank
    worker_port: int

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def hosts(self) -> list[str]:
        return [n.host for n in self.nodes]

    def node_of_slot(self, slot: int) -> NodeSlot:
        return next(n for n in self.nodes if n.slot == slot)

    def placement(self, node_rank: int, master_addr: str) -> Placement:
        n = self.nodes[node_rank]
        return Placement(
            node_rank=node_rank,
            nnodes=len(self.nodes),
            rank_offset=n.rank_offset,
            world_size=self.world_size,
            local_world_size=n.nproc,
            master_addr=master_addr,
            master_port=self.worker_port,
        )


def assign(infos: Sequence[AgentInfo], nnodes: int) -> Assignment:
    """Decide node ranks and rank offsets from the joined agents (pure; same input -> same answer everywhere)."""
    if len(infos) != nnodes:
        raise RendezvousError(f"{len(infos)} agents joined but --nnodes is {nnodes}")
    ref = infos[0]
    for field_, flag in (("nnodes", "--nnodes"), ("run_id", "--run-id"), ("max_restarts", "--max-restarts")):
        vals = {getattr(i, field_) for i in infos}
        if len(vals) > 1:
            desc = ", ".join(f"{i.host}: {getattr(i, field_)}" for i in infos)
            raise RendezvousError(f"the nodes disagree on {flag} ({desc}); start every node with the same {flag}")
    del ref
    stores = [s for s, i in enumerate(infos) if i.hosts_store]
    if len(stores) != 1:
        raise RendezvousError(f"{len(stores)} agents claim to host the store; exactly one (node 0) must")
    explicit: dict[int, int] = {}
    for s, i in enumerate(infos):
        if i.node_rank is None:
            continue
        if not 0 <= i.node_rank < nnodes:
            raise RendezvousError(f"{i.who()} asked for --node-rank {i.node_rank}, out of range 0..{nnodes - 1}")
        if i.node_rank in explicit:
            other = infos[explicit[i.node_rank]]
            raise RendezvousError(
                f"--node-rank {i.node_rank} was given to two nodes: {other.who()} and {i.who()}; "
                f"give each node a different --node-rank 0..{nnodes - 1}"
            )
        explicit[i.node_rank] = s
    if 0 in explicit and explicit[0] != stores[0]:
        raise RendezvousError(
            f"{infos[explicit[0]].who()} has --node-rank 0 but {infos[stores[0]].who()} hosts the "
            "store; node 0 is the one that hosts it"
        )
    ranks = dict((s, r) for r, s in explicit.items())
    free = [r for r in range(nnodes) if r not in explicit]
    auto = [s for s, i in enumerate(infos) if i.node_rank is None]
    if stores[0] in auto:
        if 0 not in free:  # cannot happen: 0 is explicit only for the store host
            raise RendezvousError("node rank 0 is taken by an agent that does not host the store")
        ranks[stores[0]] = 0
        free.remove(0)
        auto.remove(stores[0])
    by_host: dict[str, list[int]] = {}
    for s in auto:
        by_host.setdefault(infos[s].host, []).append(s)
    dup = {h: ss for h, ss in by_host.items() if len(ss) > 1}
    if dup:
        h, ss = next(iter(dup.items()))
        raise RendezvousError(
            f"{len(ss)} agents on host {h} have no --node-rank, and agents on one host cannot be ordered "
            "deterministically; pass --node-rank to each of them"
        )
    for s, r in zip(sorted(auto, key=lambda s: infos[s].host), free):
        ranks[s] = r
    port = infos[stores[0]].worker_port
    if not port:
        raise RendezvousError(f"node 0 ({infos[stores[0]].who()}) did not publish the workers' port")
    nodes = []
    offset = 0
    for r in range(nnodes):
        s = next(s for s, rr in ranks.items() if rr == r)
        i = infos[s]
        nodes.append(
            NodeSlot(node_rank=r, slot=s, host=i.host, pid=i.pid, nproc=i.nproc, rank_offset=offset, conn=i.conn)
        )
        offset += i.nproc
    return Assignment(nodes=tuple(nodes), worker_port=int(port))


def format_mapping(assignment: Assignment, pids: dict[int, list[list[int]]], *, run_id: str, restart: int) -> str:
    """The rank -> host, local rank, pid table node 0 prints once per generation."""
    hw = max(4, max(len(n.host) for n in assignment.nodes))
    head = (
        f"procgroup run: {assignment.world_size} workers on {len(assignment.nodes)} nodes "
        f"(run id {run_id}, restart {restart}):"
    )
    lines = [head, f"  {'rank':>4}  {'node':>4}  {'host':<{hw}}  {'local':>5}  {'pid':>7}"]
    for n in assignment.nodes:
        for rank, local, pid in sorted(pids.get(n.node_rank, [])):
            lines.append(f"  {rank:>4}  {n.node_rank:>4}  {n.host:<{hw}}  {local:>5}  {pid:>7}")
    return "\n".join(lines)


_k = key
_hb = hb_key


class Gang:
    """One agent's side of the multi-node protocol (the I/O shell around :func:`assign`)."""

    def __init__(
        self,
        *,
        host: str,
        master_addr: str,
        port: int,
        nnodes: int,
        node0: bool,
        join_timeout: float,
        interrupted: Callable[[], bool],
        wakeup: Callable[[], None],
        progress: Callable[[str], None],
        heartbeat_timeout: Optional[float] = None,
    ) -> None:
        self.host = host
        self.heartbeat_timeout = heartbeat_timeout  # None: LOST_AFTER
        self.usr1 = UsrOneRelay()
        self.conns_at_join: set[int] = set()  # node 0: nodes whose watch connection was open at the rendezvous
        self.master_addr = master_addr
        self.port = port
        self.nnodes = nnodes
        self.node0 = node0
        self.join_timeout = join_timeout
        self.interrupted = interrupted
        self.wakeup = wakeup
        self.progress = progress
        self.server: Optional[StoreServer] = None
        self.store: Optional[TCPStore] = None  # main thread's connection
        self.watch_store: Optional[TCPStore] = None  # the watcher's
        self.watcher: Optional[Watcher] = None

    @property
    def where(self) -> str:
        return format_hostport(self.master_addr, self.port)

    # ------------------------------------------------------------------ connections

    def serve(self, secret: str, bind_host: str = "0.0.0.0") -> int:
        """Node 0: start the store (PortInUseError naming the holder before anything else happens)."""
        from ..store import StoreServer  # noqa: PLC0415

        self.server = StoreServer(bind_host, self.port, secret=secret.encode())
        self.port = int(self.server.start())
        return self.port

    def connect(self, secret_for_try: Callable[[], str], retry_auth: bool = False) -> None:
        """Open both connections, retrying until node 0's store answers (or the join deadline passes).

        With ``retry_auth``, ``secret_for_try()`` is asked again after an
        authentication failure (srun mode: the secret file may have been
        stale); otherwise a rejected secret is an error at once.
        """
        from ..protocol.auth import describe_secret  # noqa: PLC0415
        from ..store import TCPStore  # noqa: PLC0415

        addr = "127.0.0.1" if self.server is not None else self.master_addr
        deadline = Deadline.after(self.join_timeout)
        last: Optional[BaseException] = None
        next_note = time.monotonic() + PROGRESS_EVERY
        while True:
            if self.interrupted():
                raise GangAborted("interrupted while connecting to node 0's agent")
            try:
                secret = secret_for_try()
                self.store = TCPStore(
                    addr,
                    self.port,
                    secret=secret,
                    timeout=60.0,
                    connect_timeout=min(1.0, max(0.05, deadline.remaining())),
                )
                self.watch_store = TCPStore(addr, self.port, secret=secret, timeout=60.0, connect_timeout=5.0)
                return
            except AuthenticationError as e:
                last = e
                if not retry_auth:
                    deadline = Deadline.after(0)
            except ConnectError as e:
                last = e
            if deadline.expired():
                if isinstance(last, AuthenticationError):
                    raise RendezvousError(
                        f"node 0's agent at {self.where} rejected this node's job secret (this node uses "
                        f"{describe_secret(secret.encode())}): every node must use the "
                        "same PROCGROUP_SECRET (or --secret-file, or a shared ~/.config/procgroup/secret)"
                    ) from None
                why = str(last)
                if "last error: " in why:  # the store's message talks to workers (MASTER_ADDR...): keep the cause
                    why = why.split("last error: ", 1)[1].split(". Is rank 0", 1)[0]
                raise RendezvousError(
                    f"could not reach node 0's agent at {self.where} within {self.join_timeout:.0f}s ({why}); is "
                    "`procgroup run --node-rank 0` running there, and is --master-addr reachable from "
                    f"{self.host}? Raise --join-timeout to wait longer"
                ) from None
            if time.monotonic() >= next_note:
                self.progress(
                    f"still waiting for node 0's agent at {self.where} "
                    f"({deadline.elapsed():.0f}s of {self.join_timeout:.0f}s)"
                )
                next_note = time.monotonic() + PROGRESS_EVERY
            time.sleep(0.2)

    def close(self, node_rank: Optional[int], last_gen: Optional[int], expect: Sequence[int] = ()) -> None:
        """Say bye; node 0 waits (a bounded time) for the byes of the nodes in ``expect`` (those that
        reported the last generation) before closing the store, so they can read everything."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        st = self.store
        if st is not None and node_rank is not None and last_gen is not None:
            try:
                st.set(_k(last_gen, "bye", node_rank), b"1")
                if self.server is not None:
                    keys = [_k(last_gen, "bye", n) for n in expect]
                    if keys:
                        st.wait(keys, timeout=BYE_TIMEOUT)
            except (StoreTimeoutError, *_LOST_ERRORS):
                pass
        for s in (self.store, self.watch_store):
            if s is not None:
                try:
                    s.close()
                except ProcGroupError:
                    pass
        self.store = self.watch_store = None
        if self.server is not None:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------------ rendezvous

    def _aborted(self, gen: int) -> Optional[dict]:
        assert self.store is not None
        key = _k(gen, "abort")
        if self.store.check([key]):
            try:
                return decode_record(self.store.get(key))
            except ValueError:
                return {"reason": "another agent stopped the job"}
        return None

    def join(self, gen: int, me: AgentInfo) -> tuple[Assignment, int]:
        """Join generation ``gen``; returns the assignment and this agent's node rank."""
        st = self.store
        assert st is not None
        try:
            slot = st.add(_k(gen, "joined"), 1) - 1
            if slot >= self.nnodes:
                raise RendezvousError(
                    f"{me.who()} is agent number {slot + 1} to join, but --nnodes is {self.nnodes}: too many "
                    "`procgroup run` were started for this job (or a node joined twice)"
                )
            st.set(_k(gen, "agent", slot), me.to_json())
            keys = [_k(gen, "agent", s) for s in range(self.nnodes)]
            deadline = Deadline.after(self.join_timeout)
            next_note = time.monotonic() + PROGRESS_EVERY
            while True:
                try:
                    st.wait(keys, timeout=min(MAIN_SLICE, max(0.01, deadline.remaining())))
                    break
                except StoreTimeoutError:
                    pass
                rec = self._aborted(gen)
                if rec is not None:
                    raise GangAborted(f"another agent stopped the job during the rendezvous: {rec.get('reason')}")
                if self.interrupted():
                    raise GangAborted("interrupted during the rendezvous")
                if deadline.expired() or time.monotonic() >= next_note:
                    n = st.add(_k(gen, "joined"), 0)
                    joined = [
                        AgentInfo.from_json(v).host
                        for v in (st.get(k) for k in keys[: min(n, self.nnodes)] if st.check([k]))
                    ]
                    msg = (
                        f"{len(joined)} of {self.nnodes} agents joined"
                        + (f" ({', '.join(joined)})" if joined else "")
                        + f" after {deadline.elapsed():.0f}s"
                    )
                    if deadline.expired():
                        raise RendezvousError(
                            f"rendezvous of the nodes' agents timed out: {msg}; start `procgroup run` on every node "
                            f"(--nnodes {self.nnodes}) or raise --join-timeout"
                        )
                    self.progress(f"waiting for the other nodes: {msg}")
                    next_note = time.monotonic() + PROGRESS_EVERY
            infos = [AgentInfo.from_json(v) for v in st.multi_get(keys)]
        except _LOST_ERRORS as e:
            raise GangAborted(
                f"lost the connection to the agents' store at {self.where} during the rendezvous ({e})"
            ) from None
        a = assign(infos, self.nnodes)
        return a, self.after_join(a, slot)

    def after_join(self, a: Assignment, slot: int) -> int:
        """The rendezvous gave ``a``: this agent's node rank (it joined in ``slot``); creates its heartbeat key,
        notes which agents' connections are open (node 0) and starts counting SIGUSR1s.  Raises GangAborted."""
        st = self.store
        assert st is not None
        node = a.node_of_slot(slot).node_rank
        if self.server is not None:  # node 0: whose watch connection is open now (the watcher checks them later)
            live = self.server.peers()
            self.conns_at_join = {n.node_rank for n in a.nodes if n.conn and n.conn in live}
        try:
            st.add(_hb(node), 0)
            self.usr1.baseline(int(st.add(USR1_KEY, 0)))  # SIGUSR1s from now on reach this node's workers
        except _LOST_ERRORS as e:
            raise GangAborted(f"lost the connection to the agents' store at {self.where} ({e})") from None
        return node

    # ------------------------------------------------------------------ during a generation

    def watch(self, gen: int, node_rank: int, assignment: Assignment) -> Watcher:
        """Start generation ``gen``'s :class:`~.liveness.Watcher` (stopping the previous one)."""
        if self.watcher is not None:
            self.watcher.stop()
        timeout = self.heartbeat_timeout if self.heartbeat_timeout is not None else LOST_AFTER
        self.watcher = Watcher(
            self, gen, node_rank, assignment, heartbeat_timeout=timeout, slice_s=beat_interval(timeout, WATCH_SLICE)
        )
        self.watcher.start()
        return self.watcher

    def publish_usr1(self) -> None:
        """This agent got a SIGUSR1 from outside: count it in the store, so every other agent passes it on."""
        if self.store is not None:
            self.usr1.publish(self.store)

    @property
    def conn_address(self) -> Optional[str]:
        """``host:port`` of the watch connection (published in :class:`AgentInfo`, checked by node 0)."""
        return local_address(self.watch_store)

    def publish_pids(self, gen: int, node_rank: int, rows: list[list[int]]) -> None:
        assert self.store is not None
        try:
            self.store.set(_k(gen, "pids", node_rank), encode_pids(rows))
        except _LOST_ERRORS:
            pass  # the watcher reports the lost store

    def pids_if_ready(self, gen: int, nnodes: Optional[int] = None) -> Optional[dict[int, list[list[int]]]]:
        """Every node's [[rank, local rank, pid], ...] of generation ``gen`` once all ``nnodes`` published them."""
        assert self.store is not None
        keys = [_k(gen, "pids", n) for n in range(self.nnodes if nnodes is None else nnodes)]
        try:
            if not self.store.check(keys):
                return None
            return {n: decode_pids(v) for n, v in enumerate(self.store.multi_get(keys))}
        except _LOST_ERRORS:
            return None

    def abort(self, gen: int, record: dict, *, store: Optional[TCPStore] = None) -> None:
        """Tell every agent to stop this generation (the first record wins)."""
        st = store or self.store
        assert st is not None, "abort() needs a connected gang or an explicit store"
        try:
            st.compare_set(_k(gen, "abort"), b"", encode_record(record))
        except _LOST_ERRORS:
            pass

    def report_failure(self, gen: int, node_rank: int, record: dict) -> None:
        """A worker of this node failed: record it, then stop everyone."""
        assert self.store is not None
        try:
            self.store.set(_k(gen, "fail", node_rank), encode_record(record))
        except _LOST_ERRORS:
            pass
        self.abort(gen, record)

    # ------------------------------------------------------------------ after a generation

    def post_result(self, gen: int, node_rank: int, result: RunResult) -> None:
        assert self.store is not None
        try:
            self.store.set(_k(gen, "result", node_rank), result_to_json(result))
        except _LOST_ERRORS:
            pass

    def collect(self, gen: int, assignment: Assignment, settle: float) -> tuple[dict[int, RunResult], list[str]]:
        """Every node's result for ``gen``: waits while the other nodes are alive (heartbeats) and, once the
        generation is aborted, at most ``settle`` seconds more.  Returns (results, errors about missing nodes)."""
        st = self.store
        w = self.watcher
        assert st is not None
        keys = {n.node_rank: _k(gen, "result", n.node_rank) for n in assignment.nodes}
        got: dict[int, RunResult] = {}
        errors: list[str] = []
        settle_dl: Optional[Deadline] = None
        try:
            while True:
                missing = [n for n in keys if n not in got and (w is None or n not in w.lost_nodes)]
                for n in list(missing):
                    if w is not None and st.check([_k(gen, "lost", n)]):  # another agent declared it lost
                        w.lost_nodes.setdefault(n, st.get(_k(gen, "lost", n)).decode(errors="replace"))
                        missing.remove(n)
                    elif st.check([keys[n]]):
                        try:
                            got[n] = result_from_json(st.get(keys[n]))
                        except ValueError:
                            errors.append(f"node {n} sent an unreadable result")
                        missing.remove(n)
                if not missing:
                    break
                aborted = w is not None and w.triggered or self._aborted(gen) is not None or self.interrupted()
                if aborted and settle_dl is None:
                    settle_dl = Deadline.after(settle)
                if settle_dl is not None and settle_dl.expired():
                    for n in missing:
                        errors.append(
                            f"node {n} ({assignment.nodes[n].host}) did not report its workers' results "
                            f"within {settle:.0f}s of the stop"
                        )
                    break
                if w is not None and w.lost is not None:
                    break
                try:
                    st.wait([keys[missing[0]]], timeout=MAIN_SLICE)
                except StoreTimeoutError:
                    pass
        except (*_LOST_ERRORS, StoreTimeoutError) as e:
            errors.append(f"lost the connection to the agents' store at {self.where} while collecting results ({e})")
        if w is not None:
            for n, why in w.lost_nodes.items():
                if n not in got:
                    errors.append(why)
            if w.lost is not None:
                errors.append(w.lost)
        # a node that could not report: use its failure record, if it wrote one
        for n in keys:
            if n in got:
                continue
            try:
                if st.check([_k(gen, "fail", n)]):
                    rec = decode_record(st.get(_k(gen, "fail", n)))
                    if isinstance(rec.get("worker"), dict):
                        wr = worker_from_dict(rec["worker"])
                        got[n] = RunResult(
                            workers=(wr,),
                            host=assignment.nodes[n].host,
                            restart_count=gen,
                            start_time=wr.start_time,
                            end_time=wr.end_time or wr.start_time,
                        )
            except (*_LOST_ERRORS, StoreTimeoutError, ValueError, TypeError):
                pass
        return got, errors
