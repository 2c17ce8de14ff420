"""The shm transport's blocking small-message fast path (``procgroup.p2p.send``/``recv``; issue 14).

:class:`~procgroup.transport.shm.transport.ShmTransport` binds these functions as its methods
``send_fast``/``recv_fast``: a small blocking send is written straight into the peer's ring when nothing of
ours to that peer is queued ahead of it, and a blocking receive takes its message straight out of the ring
when nothing queued could be overtaken.  The compiled helpers (:mod:`._p2pwait`, optional) write the record
and ring the consumer's doorbell (with the fence of its sleep-flag handshake) in one call, and read the
record and release the ring (with the fence of the producer's want-space handshake) in one call.

Compiled, the whole of :func:`send_fast`/:func:`recv_fast` up to FAST_MAX is one C call: ``_p2pwait.Core``
(:func:`compiled_core`) makes these checks in the same order on the same objects under the same lock, writes
back what these functions write and polls the head with the GIL and the lock released; it hands streamed
sizes to the functions here.  ``_p2pwait.Front`` (:func:`compiled_front`) does :func:`procgroup.p2p.send`/
``recv``'s common case (array, group and route checks) and calls the Core's op in one call too.  A 4-byte
ping-pong's one way at N=2 (issue 14, quiet host): 3.1 us with the Python functions, 1.4 us with both and
the Core's calm poll (:data:`CALM_NS`; Open MPI: 0.9 us).

Larger messages (over :data:`FAST_MAX`, under the rendezvous size RNDV_MIN, or any size without CMA), compiled
only: the sender's put_stream writes the record in pieces of :data:`STREAM_CHUNK`, each when the ring has
room for it (polling the consumer's tail), publishing the head and ringing after each; when the consumer
makes no room for the spin time, the rest of the record goes to the general path (a pending send whose
header is written, which send_fast returns for the caller to wait on; the general push finishes it or fails
it when the peer dies).  The receiver's
``stream`` takes a record whose header is visible and matches while its payload still streams in, copying
(GIL released) and releasing the ring as bytes arrive.  When the head stops moving for the spin time (the
sender descheduled, stopped or killed) the receive hands the rest of the record to the general path: the
ring's ``cur`` becomes ``[out, offset, length, request]`` with a receive request (posted nowhere: it is the
ring's current record) that recv_fast returns; the caller waits on it as on an ``irecv``'s, and the general
drain completes it, or the liveness check fails it with PeerFailureError naming the sender.
"""

from __future__ import annotations

import os
import time
import types
from typing import Any

from .._engine import RecvReq, SendReq
from .ring import REC, REC_SIZE, RNDV_MIN

#: ``self`` below is the ShmTransport (typed Any: importing it here would make an import cycle)
__all__ = ["FAST_MAX", "STREAM_CHUNK", "send_fast", "recv_fast", "compiled_core", "compiled_front"]

#: the largest message of the blocking fast path's whole-record copies (put/take in one piece; larger ones stream)
FAST_MAX = 64 << 10
#: a streamed send's piece: put publishes the head (and rings) after each, so the receiver copies behind it
STREAM_CHUNK = 64 << 10
#: a receive with other rings to serve polls its head in C in slices this long (ns), serving them between
OTHERS_SLICE_NS = 20_000
#: the compiled receive (Core) polls without sched_yield for this long (ns) first, unless our ranks oversubscribe
#: the host: each yield is a syscall (~0.5 us) in which a reply goes unseen (4 B ping-pong at N=2, quiet host:
#: 1.75 us one way yielding every 16 polls from the start, 1.43 us without; a peer queued behind us on our CPU
#: waits at most this long more)
CALM_NS = 5_000

_sched_yield = getattr(os, "sched_yield", lambda: None)


def send_fast(self: Any, dst: int, tag: int, view: Any) -> Any:
    """Write a message to ``dst`` now, if it may go first; False when the caller must take ``isend``.

    Only when nothing of ours to ``dst`` is queued (order), the peer is reachable, neither failed nor closed,
    and (up to FAST_MAX) the whole record fits in its ring now.  A larger message (compiled only, below the
    rendezvous size when the peer can read us) streams into the ring as the receiver makes room; returns
    True when it was all written, or, when the receiver stopped making room for the spin time, the send
    request that now owns the rest of the record (wait on it as on an ``isend``'s).  ``view``: a flat byte
    memoryview or a C-contiguous ndarray (handed to the compiled put as it is: no view to make); ``tag``
    already checked.
    """
    n = view.nbytes
    if n > FAST_MAX and self._put_stream is None:
        return False
    with self._lock:
        o = self._out.get(dst)
        if o is None or o.pending or self._closed or self._aborted is not None or dst in self._failed:
            return False
        put = self._put
        if n > FAST_MAX:  # streamed (compiled, with the doorbell), below the rendezvous size
            if o.cma and n >= RNDV_MIN:
                return False
            b = self._bell
            ws = self.world_size
            v = (b.last + ws) & 0xFFFFFFFF
            res = self._put_stream(
                o.data, o.seg.q, o.head_i, o.tail_i, o.head, tag, view, v, STREAM_CHUNK, ws, self._spin_ns, self._yield
            )
            if res == -1:
                return False
            end, off, rings = res
            b.last = (v + (rings - 1) * ws) & 0xFFFFFFFF
            o.head = end
            self._flow.moved += 1
            if off < n:  # the receiver stopped making room: the general path (push) writes the rest
                s = SendReq(self, dst, tag, view if type(view) is memoryview else memoryview(view).cast("B"))
                s.hdr_done = True
                s.off = off
                o.pending.append(s)
                self._pending_out.append(o)
                self.fast_handoffs += 1
                self._fsends += 1
                self.bytes_sent += n
                return s
        elif put is None:
            if not o.try_write(tag, view if type(view) is memoryview else memoryview(view).cast("B")):
                return False
        elif self._c_bell:  # the doorbell's value, then put writes, publishes and rings (with its fence)
            b = self._bell
            v = b.last = (b.last + self.world_size) & 0xFFFFFFFF
            end = put(o.data, o.seg.q, o.head_i, o.tail_i, o.head, tag, view, v)
            if end < 0:
                return False
            o.head = end
        else:
            end = put(o.data, o.seg.q, o.head_i, o.tail_i, o.head, tag, view)
            if end < 0:
                return False
            o.head = end
            self._ring(o.seg)
    self.bytes_sent += n
    self._fsends += 1
    return True


def recv_fast(self: Any, src: int, tag: int, out: Any) -> Any:
    """Receive the next message from ``src`` with ``tag`` straight from its ring, polling for the spin time.

    Returns its byte count, or -1 when the caller must take the general path (``irecv`` and a wait): the
    spin ran out, a receive or an unexpected message of ``tag`` is queued (order), the ring's next record is
    another message, a control record or (``out`` of at most FAST_MAX bytes) one still streaming in, the
    message is larger than ``out``, or the peer failed or the transport closed.  Nothing is consumed then.
    A larger ``out`` (compiled only) streams the message in (see the module docstring); when its sender
    stalls mid-record, returns the receive request that now owns the rest (wait on it as on an ``irecv``'s).
    ``src`` is a peer, never ANY_SOURCE.  ``out``: a flat writable byte memoryview or a C-contiguous writable
    ndarray (as :func:`send_fast`).
    """
    r = self._in.get(src)
    if r is None:
        return -1
    stream = None
    if out.nbytes > FAST_MAX:
        stream = self._stream
        o = self._out.get(src)
        if stream is None or (o is not None and o.cma and out.nbytes >= RNDV_MIN):
            return -1  # (a message this large from a peer we can read comes by rendezvous: the general path)
    lock = self._lock
    q = r.seg.q
    head_i = r.head_i
    others = len(self._in_list) > 1
    # with other rings to serve, the receive polls its head in C in slices of OTHERS_SLICE_NS and serves the
    # other rings between them (polling all of them in Python instead: 4 B at N=4 took 7.1-7.8 us, now 3.0-3.3)
    wait_head = self._wait_head
    take = self._take
    c_bell = self._c_bell
    if take is None and type(out) is not memoryview:
        out = memoryview(out).cast("B")
    end = 0.0
    while True:
        with lock:
            if (
                self._closed
                or r.cur is not None
                or tag in self._posted
                or tag in self._unexpected
                or src in self._failed
                or self._aborted is not None
            ):
                return -1
            head = q[head_i]
            tail = r.tail
            if head != tail:
                t = (tail + 15) & ~15
                n: int
                if stream is not None:
                    return _take_streaming(self, r, stream, t, tag, out)
                if (
                    c_bell and take is not None
                ):  # take copies, releases the ring and reads the producer's want flag (fenced)
                    n = take(r.data, q, head_i, tail, tag, out, r.tail_i, r.want_i)
                    if n < 0:
                        if n == -1:
                            return -1
                        n = -2 - n
                        self._ring(r.peer_seg)  # the producer waits for room
                    r.tail = t + REC_SIZE + n
                    self._flow.moved += 1
                    if self._bell.sleepers or self._hooks:  # _notify_locked's cases, tested inline
                        self._notify_locked()
                    self._frecvs += 1
                    return n
                if take is not None:
                    n = take(r.data, q, head_i, tail, tag, out)
                    if n < 0:
                        return -1
                else:
                    if head < t + REC_SIZE:
                        return -1
                    data = r.data
                    rtag: int
                    rtag, n = REC.unpack_from(data, t & r.mask)
                    if rtag != tag or n > out.nbytes or head < t + REC_SIZE + n:
                        return -1  # another message, a control record (n > LEN_MASK), too large, or streaming
                    pos = (t + REC_SIZE) & r.mask
                    first = r.cap - pos
                    if n <= first:
                        out[:n] = data[pos : pos + n]
                    else:
                        out[:first] = data[pos:]
                        out[first:n] = data[: n - first]
                self._flow.moved += 1
                self._release(r, t + REC_SIZE + n)
                self._notify_locked()
                self._frecvs += 1
                return n
            if self._pending_out or others:
                self._progress_locked(r)
        now = time.monotonic()
        if not end:
            # a mid-size message's sender copies longer before its header shows: wait longer (at most 20 spins)
            end = now + (self._spin if stream is None else self._spin * min(20.0, out.nbytes / FAST_MAX))
        elif now >= end:
            self._fast_spun = now  # the general wait that follows sleeps at once (no second spin)
            return -1
        if wait_head is not None and not self._pending_out:  # poll the head, GIL released, until it moves
            ns = int((end - now) * 1e9)
            wait_head(q, head_i, tail, min(ns, OTHERS_SLICE_NS) if others else ns, self._yield)
        elif self._yield:
            _sched_yield()


def _take_streaming(self: Any, r: Any, stream: Any, t: int, tag: int, out: Any) -> Any:
    """recv_fast's compiled streaming receive of the record at ``t`` of ring ``r`` (lock held; see the module).

    Returns the byte count, -1 (nothing consumed: another message, a control record, too large for ``out``)
    or, when the sender stalled mid-record, the receive request that the general path completes.
    """
    q = r.seg.q
    spin_ns = self._spin_ns
    res = stream(r.data, q, r.head_i, r.tail_i, r.want_i, t, tag, out, 0, -1, spin_ns, self._yield)
    if res == -1:
        return -1
    n, off, want = res
    while want:  # the producer waits for room (a general-path send behind or inside this record): ring it
        self._ring(r.peer_seg)
        if off == n:
            break
        n, off, want = stream(r.data, q, r.head_i, r.tail_i, r.want_i, t, tag, out, off, n, spin_ns, self._yield)
    r.tail = t + REC_SIZE + off  # (stream stored it in the ring)
    self._flow.moved += 1
    self._frecvs += 1
    if self._bell.sleepers or self._hooks:  # _notify_locked's cases, tested inline
        self._notify_locked()
    if off == n:
        return n
    # the sender stalled (descheduled, stopped or dead): the general path owns the rest of the record
    dest = out if type(out) is memoryview else memoryview(out).cast("B")
    req = RecvReq(self, r.src, tag, dest)
    r.cur = [dest, off, n, req]
    self._fast_spun = time.monotonic()  # its wait sleeps at once (no second spin)
    self.fast_handoffs += 1
    return req


def compiled_core(self: Any, fast_c: Any) -> Any:
    """The compiled send_fast/recv_fast of transport ``self`` (``_p2pwait.Core``), or None (not built, an older
    build, PROCGROUP_NATIVE=0: ``fast_c`` None, or no compiled doorbell).

    Made once the rings exist.  The instance's ``send_fast``/``recv_fast`` (what :mod:`procgroup.p2p` looks up)
    become the Core's, which take the transport's lock (non-blocking), make this module's checks on the same
    objects and write/read the record and ring the doorbell in one call; what they do not handle in C (the lock
    held by another thread, a streamed size, an unusual buffer) they hand to this module's functions.
    """
    if fast_c is None or not self._c_bell or getattr(fast_c, "FAST_MAX", 0) != FAST_MAX:
        return None
    core_t = getattr(fast_c, "Core", None)
    if core_t is None:
        return None
    core = core_t(
        self,
        self._lock,
        self._posted,
        self._unexpected,
        self._failed,
        self._hooks,
        self._pending_out,
        self._bell,
        self._flow,
        self._ring,
        self._notify_locked,
        self._progress_locked,
        types.MethodType(send_fast, self),
        types.MethodType(recv_fast, self),
        self.world_size,
        self._spin_ns,
        self._yield,
        0 if self._oversubscribed else CALM_NS,
        [(p, o, o.data, o.seg.q, o.head_i, o.tail_i, o.pending) for p, o in self._out.items()],
        [(p, r, r.data, r.seg.q, r.head_i, r.tail_i, r.want_i, r.peer_seg) for p, r in self._in.items()],
    )
    # (instance attributes shadow the methods; fast_checks_buffers: procgroup.p2p may skip its flags test)
    self.__dict__.update(send_fast=core.send, recv_fast=core.recv, fast_checks_buffers=True)
    return core


def compiled_front(state: Any, group_type: type, array_type: type, route: Any, check_count: Any) -> Any:
    """``_p2pwait.Front``: the common case of :func:`procgroup.p2p.send`/``recv`` in one call (a numpy array,
    a live group, a cached route whose fast op is the compiled Core's), or None when not built."""
    try:
        from . import _p2pwait
    except ImportError:  # pragma: no cover - not built
        return None
    front_t = getattr(_p2pwait, "Front", None)
    return None if front_t is None else front_t(state, group_type, array_type, route, check_count)
