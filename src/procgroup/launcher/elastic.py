"""Elastic membership (``--nnodes MIN:MAX``): torchrun's semantics on the agents' store.

Each generation G of the job has a round of membership on the store node 0's agent hosts (its agent is
the *coordinator*; it must stay up, as torchrun's c10d store host must)::

    launch/g{G}/joined        counter: join order of the round (a slot per agent)
    launch/g{G}/agent/{slot}  AgentInfo of the agent in that slot
    launch/g{G}/closed        the coordinator's decision: {"slots": [...]} or {"error": "..."}
    launch/round              the last generation whose round was closed

The coordinator closes a round once MIN agents joined and either MAX joined or ``--join-window``
seconds passed since MIN was reached (:func:`admit` picks the slots, :func:`assign_elastic` the node
ranks: the coordinator is node 0, the others by host name then agent pid -- deterministic for a given
membership).  An agent that finds the round of the running generation already closed is an *arrival*:
it stops that generation (an abort record with ``"membership": "join"``) and joins the next one, so
every agent stops its workers and re-forms the job with it.  A lost node (:mod:`.liveness`) stops the
generation the same way; the survivors join the next round, and when fewer than MIN do, the round
fails with an error that names the lost nodes.  Every new generation counts against ``--max-restarts``.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from ..deadline import Deadline
from ..errors import RendezvousError, StoreTimeoutError
from .liveness import LOST_ERRORS, PREFIX, key

if TYPE_CHECKING:  # pragma: no cover - gang imports this module lazily
    from .gang import AgentInfo, Assignment, Gang

__all__ = ["ROUND_KEY", "admit", "assign_elastic", "join_elastic", "parse_closed"]

#: the last generation whose membership round was closed (an arrival joins the next one)
ROUND_KEY = f"{PREFIX}/round"
_POLL = 0.1
#: how long the coordinator waits for the info of a slot that was counted but not yet written
_INFO_WAIT = 5.0


def admit(joined: int, coordinator_slot: int, max_nodes: int) -> list[int]:
    """The slots admitted to a round in which ``joined`` agents took slots 0..joined-1 (pure): the
    coordinator's, then the earliest others, at most ``max_nodes`` in all; sorted."""
    others = [s for s in range(joined) if s != coordinator_slot]
    return sorted([coordinator_slot, *others[: max(0, max_nodes - 1)]])


def parse_closed(raw: bytes) -> dict:
    """The coordinator's decision for a round: ``{"slots": [...]}`` or ``{"error": "..."}``; a malformed
    value raises ValueError."""
    d = json.loads(raw)
    if not isinstance(d, dict) or not (isinstance(d.get("slots"), list) or isinstance(d.get("error"), str)):
        raise ValueError(f"not a membership decision: {raw[:80]!r}")
    return d


def assign_elastic(infos: Sequence["AgentInfo"], slots: Sequence[int]) -> "Assignment":
    """Node ranks and rank offsets of an elastic generation (pure; the same on every agent).

    ``infos[i]`` joined in slot ``slots[i]``.  The agent hosting the store is node 0; the others follow
    by (host name, agent pid).  Raises RendezvousError when the agents disagree on --nnodes, --run-id or
    --max-restarts, or when node 0 did not publish the workers' port."""
    from .gang import Assignment, NodeSlot  # noqa: PLC0415 - gang imports this module lazily

    for field_, flag in (
        ("nnodes", "--nnodes"),
        ("min_nodes", "--nnodes"),
        ("run_id", "--run-id"),
        ("max_restarts", "--max-restarts"),
    ):
        vals = {getattr(i, field_) for i in infos}
        if len(vals) > 1:
            desc = ", ".join(f"{i.host}: {getattr(i, field_)}" for i in infos)
            raise RendezvousError(f"the nodes disagree on {flag} ({desc}); start every node with the same {flag}")
    order = sorted(range(len(infos)), key=lambda k: (not infos[k].hosts_store, infos[k].host, infos[k].pid))
    if not infos[order[0]].hosts_store:
        raise RendezvousError("no agent of this round hosts the store (node 0's agent must take part)")
    port = infos[order[0]].worker_port
    if not port:
        raise RendezvousError(f"node 0 ({infos[order[0]].who()}) did not publish the workers' port")
    nodes = []
    offset = 0
    for r, k in enumerate(order):
        i = infos[k]
        nodes.append(
            NodeSlot(node_rank=r, slot=slots[k], host=i.host, pid=i.pid, nproc=i.nproc, rank_offset=offset, conn=i.conn)
        )
        offset += i.nproc
    return Assignment(nodes=tuple(nodes), worker_port=int(port))


def _closed_round(st: object) -> int:
    """The last generation whose round was closed, -1 before the first."""
    try:
        return int(st.get(ROUND_KEY)) if st.check([ROUND_KEY]) else -1  # type: ignore[attr-defined]
    except (ValueError, StoreTimeoutError):
        return -1


def _coordinate(
    gang: "Gang",
    gen: int,
    slot: int,
    *,
    min_nodes: int,
    max_nodes: int,
    window: float,
    first_wait: float,
    lost: Sequence[str],
) -> None:
    """Node 0's agent: close round ``gen`` (write ``closed`` and ``launch/round``) or fail it below MIN."""
    st = gang.store
    assert st is not None
    spec = f"--nnodes {min_nodes}:{max_nodes}"
    deadline = Deadline.after(first_wait)
    joined = st.add(key(gen, "joined"), 0)
    while joined < min_nodes:
        if gang.interrupted():
            raise _Aborted("interrupted during the rendezvous")
        if deadline.expired():
            why = (
                f"only {joined} node(s) joined generation {gen} of the job within {first_wait:g}s, below the "
                f"minimum of {min_nodes} ({spec})"
                + (f"; lost: {'; '.join(lost)}" if lost else "")
                + "; start more nodes, or lower MIN"
            )
            st.set(key(gen, "closed"), json.dumps({"error": why}).encode())
            raise _Aborted(why)
        time.sleep(_POLL)
        joined = st.add(key(gen, "joined"), 0)
    win = Deadline.after(window)
    while joined < max_nodes and not win.expired():
        if gang.interrupted():
            raise _Aborted("interrupted during the rendezvous")
        time.sleep(_POLL)
        joined = st.add(key(gen, "joined"), 0)
    slots = admit(joined, slot, max_nodes)
    st.wait([key(gen, "agent", s) for s in slots], timeout=_INFO_WAIT)
    st.set(key(gen, "closed"), json.dumps({"slots": slots}).encode())
    st.set(ROUND_KEY, str(gen).encode())


class _Aborted(Exception):
    """Raised inside this module; :func:`join_elastic` turns it into the gang's GangAborted."""


def join_elastic(
    gang: "Gang",
    gen: int,
    me: "AgentInfo",
    *,
    min_nodes: int,
    max_nodes: int,
    window: float,
    lost: Sequence[str] = (),
    expect: Optional[int] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> tuple["Assignment", int, int]:
    """Join the first round at or after generation ``gen`` that is still open; returns (assignment, this
    agent's node rank, the generation).  ``lost`` names the nodes lost so far; ``expect`` is how many agents
    survived the last loss: when fewer than MIN did, the coordinator waits only ``window`` seconds for
    arrivals before it fails the round (else up to the join timeout).  Raises GangAborted (interrupted, the
    store lost, the round failed below MIN) or RendezvousError (the job already has MAX nodes; the nodes'
    flags disagree)."""
    from .gang import AgentInfo, GangAborted  # noqa: PLC0415

    st = gang.store
    assert st is not None
    spec = f"--nnodes {min_nodes}:{max_nodes}"
    try:
        while True:
            closed = _closed_round(st)
            if gen <= closed:  # that generation runs already: an arrival stops it and joins the next
                d = parse_closed(st.get(key(closed, "closed")))
                if len(d.get("slots") or ()) >= max_nodes:
                    raise RendezvousError(
                        f"{me.who()} cannot join: the job already runs on the maximum of {max_nodes} nodes ({spec})"
                    )
                gen = closed + 1
                gang.abort(
                    closed,
                    {
                        "reason": f"{me.host} (agent pid {me.pid}) joined: re-forming the job as generation {gen}",
                        "membership": "join",
                        "host": me.host,
                        "timestamp": time.time(),
                    },
                )
            slot = st.add(key(gen, "joined"), 1) - 1
            st.set(key(gen, "agent", slot), me.to_json())
            if me.hosts_store:
                first_wait = window if expect is not None and expect < min_nodes else gang.join_timeout
                _coordinate(
                    gang,
                    gen,
                    slot,
                    min_nodes=min_nodes,
                    max_nodes=max_nodes,
                    window=window,
                    first_wait=max(first_wait, _POLL),
                    lost=lost,
                )
            deadline = Deadline.after(gang.join_timeout + window + _INFO_WAIT)
            next_note = time.monotonic() + 10.0
            while True:
                try:
                    st.wait([key(gen, "closed")], timeout=min(0.5, max(0.01, deadline.remaining())))
                    break
                except StoreTimeoutError:
                    pass
                if gang.interrupted():
                    raise _Aborted("interrupted during the rendezvous")
                if deadline.expired():
                    raise _Aborted(
                        f"node 0's agent did not close the membership of generation {gen} within "
                        f"{deadline.elapsed():.0f}s ({spec}); raise --join-timeout"
                    )
                if progress is not None and time.monotonic() >= next_note:
                    n = st.add(key(gen, "joined"), 0)
                    progress(f"waiting for nodes: {n} joined generation {gen} ({spec})")
                    next_note = time.monotonic() + 10.0
            d = parse_closed(st.get(key(gen, "closed")))
            if "error" in d:
                raise _Aborted(str(d["error"]))
            slots = [int(s) for s in d["slots"]]
            if slot not in slots:  # too late for this round: the next one, as an arrival
                continue
            infos = [AgentInfo.from_json(v) for v in st.multi_get([key(gen, "agent", s) for s in slots])]
            a = assign_elastic(infos, slots)
            return a, gang.after_join(a, slot), gen
    except _Aborted as e:
        raise GangAborted(str(e)) from None
    except (*LOST_ERRORS, StoreTimeoutError) as e:
        raise GangAborted(
            f"lost the connection to the agents' store at {gang.where} during the rendezvous ({e})"
        ) from None
    except ValueError as e:  # a malformed record in the store
        raise GangAborted(f"unreadable membership record in the agents' store: {e}") from None
