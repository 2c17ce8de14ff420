"""The phases of a stage between hosts, bound once to their peers (issue 14).

A phase is what the direct reduce-scatter and all-gather between hosts do twice a call: send one message to each
of a few peers and receive one from each, all with one tag.  :class:`TcpPhases` binds the peers' connections and
``read_frames``' socket tuple once per Comm; :meth:`TcpPhases.run` then does a phase in one call from the
algorithm, without the per-message layers (the Comm, the router, the engine's matching):

* **claim** (the first phase of a call): every connection's reading role, each decoder at a message boundary with
  no message half placed, no peer failed.  The roles stay held across the call's phases (the algorithm reduces in
  between) until :meth:`TcpPhases.end`, so nobody else reads those sockets meanwhile;
* each phase checks that no message of its tag was read or posted already, **sends** each message with one
  non-blocking ``sendmsg`` (the writer thread takes any remainder, as ``isend``), and **reads** every receive in
  compiled calls (``read_frames``, straight into the buffers, never a byte past a message);
* where every message arrived whole, that is all: no request object, no hold of the transport lock.  Anything else
  (a message of another tag first, EOF, a protocol violation, the deadline, an abort, an error in the caller's
  progress pass) hands every connection back to its decoder at the exact byte reached, as
  :meth:`TcpReading.wait_many` does, and waits for the unfinished receives as ``irecv``'s, with their usual errors;
  the roles are then given back.

Where a phase cannot be claimed, nothing is done and :meth:`TcpPhases.run` returns None: the caller posts and
waits as usual.  The messages on the wire are those of ``isend``, so a peer on the usual path meets a rank on this
one.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..deadline import Deadline
from ..errors import ClosedError, ConfigError
from . import _tcp_read
from ._engine import RecvReq
from .base import TAG_LIMIT, Request, as_bytes_view, as_writable_view

__all__ = ["TcpPhases"]

Progress = Tuple[Optional[Callable[[], float]], Optional[Callable[[], None]]]
_R_ALL, _R_SLICE = 0, 1  # read_frames: nothing pending any more; the slice is over
_ST_DONE = 1


class TcpPhases:
    """Phases of sends to ``send_to`` and receives from ``recv_from`` (distinct ranks each) on a tcp transport,
    bound once; see the module docstring.  Made by :meth:`TcpTransport.phases`.  One thread at a time."""

    __slots__ = ("t", "sconns", "rconns", "fds", "held")

    def __init__(self, t: Any, send_to: Sequence[int], recv_from: Sequence[int]) -> None:
        self.t = t
        self.sconns = [t._conns[p] for p in send_to]
        self.rconns = [t._conns[p] for p in recv_from]
        self.fds = tuple(c.fd for c in self.rconns)
        self.held = False  # the receive connections' roles are ours (between a claimed phase and end())

    def _claim(self) -> bool:
        """Take every receive connection's role where each is free, alive and at a message boundary (the compiled
        read and ``PROCGROUP_NATIVE`` were checked when the phases were bound: :meth:`TcpTransport.phases`)."""
        t = self.t
        if t._closed or t._aborted is not None or t._failed:
            return False
        held = []
        for c in self.rconns:
            if c.dead or not t._take(c):
                break
            held.append(c)
            if c.dec is None or not c.dec.at_boundary or c.rx is not None or c.peer in t._inflight:
                break
        else:
            self.held = True
            return True
        for c in held:
            t._give(c)
        return False

    def end(self) -> None:
        """Give the roles back (after the call's last phase, or on any way out of it); nothing when not held."""
        if self.held:
            self.held = False
            t = self.t
            for c in self.rconns:
                t._give(c)

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
        ``recvs[i]``, all with ``tag``, reading the receives in compiled calls (``slice_for()``: how long to read
        before ``between()`` runs, as in :meth:`TcpReading.wait_many`).

        None where the phase cannot be claimed (nothing done, the roles given back: post and wait as usual).  Else
        (the sends not yet complete, the receives that did not arrive whole): with every message whole, no receive
        and the roles still held for the next phase; else every connection handed back to its decoder, the roles
        given back, and each receive's ``wait`` reporting its outcome.  Raises as ``isend`` does for a send that
        fails (a peer lost), the roles given back first.
        """
        if not 0 <= tag < TAG_LIMIT:
            raise ConfigError(f"tag {tag} is outside [0, 2**63)")
        t = self.t
        if not self.held and not self._claim():
            return None
        # nobody else reads these sockets while we hold their roles: an earlier message of this tag is already
        # queued (unexpected) or someone posted for it, or it never comes in ahead of ours
        if t._unexpected.get(tag) or t._posted.get(tag) or t._aborted is not None or t._closed:
            self.end()
            return None
        outs = tuple(as_writable_view(o) for o in recvs)
        try:
            pending: List[Request] = []
            for c, data in zip(self.sconns, sends):
                view = as_bytes_view(data)
                t.bytes_sent += view.nbytes  # as isend counts it, for `procgroup top`
                q = t._send_now(c, tag, view)
                if q is not None:
                    pending.append(q)
        except BaseException:
            self.end()
            raise
        n = len(outs)
        hdr = bytearray(24 * n)
        prog = array("q", bytes(8 * _tcp_read._PROG * n))
        read_frames = _tcp_read.read_frames()  # built: TcpTransport.phases binds nothing otherwise
        spin = int(t._spin * 1e9)
        tags = (tag,) * n
        code = _R_SLICE
        try:
            while True:
                s = _tcp_read._SLICE if slice_for is None else slice_for()
                if deadline is not None:
                    rem = deadline.remaining()
                    if rem <= 0:
                        break
                    s = min(s, rem)
                try:  # hold: sleep for the pending sockets with the finished ones' roles kept (all are ours)
                    code = read_frames(self.fds, tags, outs, hdr, prog, spin, max(1, int(s * 1e9)), t._wake_r, True)
                except (ValueError, TypeError, BufferError, OverflowError):  # an odd buffer: irecv's path does it
                    break
                spin = 0
                if code != _R_SLICE or t._aborted is not None or t._closed:
                    break
                if between is not None:
                    between()
        except BaseException:  # between() failed, or a signal's handler raised: the decoders take over first
            self._hand_back(tag, outs, hdr, prog)
            raise
        if code == _R_ALL and all(prog[i] == _ST_DONE for i in range(0, len(prog), _tcp_read._PROG)):
            return pending, []
        return pending, self._hand_back(tag, outs, hdr, prog)

    def _hand_back(self, tag: int, outs: Tuple[memoryview, ...], hdr: bytearray, prog: "array[int]") -> List[RecvReq]:
        """After a phase that did not end with every message whole: each connection back to its decoder at the
        byte reached (:meth:`TcpReading._settle_many`, with a receive of the tag placed as the claim would have),
        the roles given back; the receives that did not arrive whole."""
        t = self.t
        taken = [(c, RecvReq(t, c.peer, tag, out)) for c, out in zip(self.rconns, outs)]
        with t._lock:  # what a failure or an abort during the read would have done to receives in flight
            for c, req in taken:
                reason = t._failed.get(c.peer)
                if t._aborted is not None:
                    req.error = t._aborted
                elif t._closed:
                    req.error = ClosedError(
                        f"rank {t.rank}: the tcp transport was closed while this request was pending"
                    )
                elif reason is not None:
                    req.error = t._peer_error(req, c.peer, reason)
                t._inflight[c.peer] = req
        self.held = False  # _settle_many gives every role back
        t._settle_many(taken, hdr, list(prog))
        return [req for _, req in taken if req.status is None]

    def run(
        self,
        tag: int,
        sends: Sequence[Any],
        recvs: Sequence[Any],
        deadline: Optional[Deadline],
        progress: Optional[Callable[[], Progress]] = None,
        wrap: Optional[Callable[[Request], Request]] = None,
    ) -> Optional[List[Request]]:
        """:meth:`start`, then wait for every receive that did not arrive whole (``wrap(req)``: the request to wait
        on, e.g. the router's, which drives shm progress meanwhile); raises its error.  Returns the sends not yet
        complete (wait for them before reusing their buffers), or None where the phase was not claimed (nothing
        done).  Call :meth:`end` after the call's last phase."""
        got = self.start(tag, sends, recvs, deadline, *(progress() if progress is not None else (None, None)))
        if got is None:
            return None
        pending, left = got
        for q in left:
            (q if wrap is None else wrap(q)).wait(deadline)
        return pending if wrap is None else [wrap(q) for q in pending]
