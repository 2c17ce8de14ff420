"""One phase of a stage between hosts, bound once to its peers (issue 14).

A phase is what the direct reduce-scatter and all-gather between hosts do twice a call: send one message to each
of a few peers and receive one from each of a few (the same or others), all with one tag.  :class:`TcpPhase` binds
the peers' connections and ``read_frames``' socket tuple once; :meth:`TcpPhase.run` then does a phase in one call
from the algorithm, without the per-message layers (the Comm, the router, the engine's matching):

* **claim** every receive with its connection's reading role straight into ``_inflight`` (the role free, the
  decoder at a message boundary, nothing of the tag unexpected or posted, no peer failed); where any of that does
  not hold, nothing is done and the caller posts and waits as usual;
* **send** each message with one non-blocking ``sendmsg`` (the writer thread takes any remainder, as ``isend``);
* **read** every receive in compiled calls (``read_frames``; :meth:`TcpReading._read_taken`), which finish each
  receive or hand its connection back to the decoder at the exact byte reached, so a receive that did not arrive
  whole is then waited for with the usual errors (deadline, peer failure, protocol violation).

The messages on the wire are those of ``isend``: a peer on the usual path meets a rank on this one.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..deadline import Deadline
from ..errors import ConfigError
from . import _tcp_read
from ._engine import RecvReq
from .base import TAG_LIMIT, Request, as_bytes_view, as_writable_view

__all__ = ["TcpPhase"]

Progress = Tuple[Optional[Callable[[], float]], Optional[Callable[[], None]]]


class TcpPhase:
    """Sends to ``send_to`` and receives from ``recv_from`` (distinct ranks) of a tcp transport, bound once; see the
    module docstring.  Made by :meth:`TcpTransport.phase`."""

    __slots__ = ("t", "sconns", "rconns")

    def __init__(self, t: Any, send_to: Sequence[int], recv_from: Sequence[int]) -> None:
        self.t = t
        self.sconns = [t._conns[p] for p in send_to]
        self.rconns = [t._conns[p] for p in recv_from]

    def start(
        self,
        tag: int,
        sends: Sequence[Any],
        recvs: Sequence[Any],
        deadline: Optional[Deadline],
        slice_for: Optional[Callable[[], float]] = None,
        between: Optional[Callable[[], None]] = None,
    ) -> Optional[Tuple[List[Request], List[RecvReq]]]:
        """Send ``sends[i]`` to the i-th bound destination and receive the i-th bound source's message into
        ``recvs[i]``, all with ``tag``; read the receives in compiled calls (``slice_for()``: how long to read before
        ``between()`` runs, as in :meth:`TcpReading.wait_many`).

        None where the phase cannot be claimed (nothing done: post and wait as usual).  Else (the sends not yet
        complete, the receives): each receive finished or handed back to the decoder, its ``wait`` reporting the
        outcome.  Raises as ``isend`` does for a send that fails (a peer lost), the receives handed back first.
        """
        t = self.t
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        if not t._native or not _tcp_read.compiled_read():
            return None
        held = []
        try:
            for c in self.rconns:
                if c.dead or not t._take(c):
                    return None
                held.append(c)
                if c.dec is None or not c.dec.at_boundary or c.rx is not None:
                    return None
            taken = [(c, RecvReq(t, c.peer, tag, as_writable_view(o))) for c, o in zip(self.rconns, recvs)]
            with t._lock:
                inflight = t._inflight
                if (
                    t._closed
                    or t._aborted is not None
                    or t._failed
                    or t._unexpected.get(tag)
                    or t._posted.get(tag)
                    or any(c.peer in inflight for c in self.rconns)
                ):
                    return None
                for c, req in taken:
                    inflight[c.peer] = req
            held = []
        finally:
            for c in held:
                t._give(c)
        pending: List[Request] = []
        try:
            for c, data in zip(self.sconns, sends):
                view = as_bytes_view(data)
                t.bytes_sent += view.nbytes  # as isend counts it, for `procgroup top`
                q = t._send_now(c, tag, view)
                if q is not None:
                    pending.append(q)
        except BaseException:  # a peer lost: the receives go back to the decoder first
            t._settle_many(taken, bytearray(24 * len(taken)), [0] * (_tcp_read._PROG * len(taken)))
            raise
        t._read_taken(taken, deadline, slice_for, between)
        return pending, [req for _, req in taken]

    def run(
        self,
        tag: int,
        sends: Sequence[Any],
        recvs: Sequence[Any],
        deadline: Optional[Deadline],
        progress: Optional[Callable[[], Progress]] = None,
        wrap: Optional[Callable[[Request], Request]] = None,
    ) -> Optional[List[Request]]:
        """:meth:`start`, then wait for every receive that did not arrive in the compiled read (``wrap(req)``: the
        request to wait on, e.g. the router's, which drives shm progress meanwhile); raises its error.  Returns the
        sends not yet complete (wait for them before reusing their buffers), or None where the phase was not
        claimed (nothing done)."""
        got = self.start(tag, sends, recvs, deadline, *(progress() if progress is not None else (None, None)))
        if got is None:
            return None
        pending, reqs = got
        for q in reqs:
            if q.status is None:
                (q if wrap is None else wrap(q)).wait(deadline)
        return pending if wrap is None else [wrap(q) for q in pending]
