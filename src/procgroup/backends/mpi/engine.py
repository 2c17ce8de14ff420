"""MPI's own collectives behind procgroup's API: the mpi backend's :class:`CollectiveEngine`.

Each procgroup group gets one MPI communicator whose rank order is the group's (the world's is made at
init; a subgroup's by ``MPI_Comm_create_group`` on its first collective, after a procgroup barrier over the
transport, so that creation never waits for a member that is not there).  A collective posts MPI's
nonblocking form (``Iallreduce``, ``Ibcast``, ``Ireduce``, ``Iallgather``, ``Igather``, ``Iscatter``,
``Ireduce_scatter_block``, ``Ialltoall(v)``, ``Ibarrier``) and polls it with ``Test`` under the call's
deadline (:class:`~._waiting.Liveness`: spin, then back off), so the deadline, the watchdog's abort and
dead peers end a wait as they do on the cpu backend.

What MPI computes differently from procgroup is declined, so that procgroup's own algorithms (over the
MPI transport) run it and every result equals the cpu backend's:

* reductions of bool, float16 and bfloat16 (MPI has no such reduction types);
* MIN and MAX of floating types (MPI's C MIN/MAX drop NaN where numpy, hence procgroup, propagates it).

all_reduce, reduce and reduce_scatter of :data:`LARGE_ALL_REDUCE` bytes or more also run procgroup's
algorithms over the transport, because they are faster there.  AVG runs as MPI's SUM; the caller divides.
Data movement (broadcast, gathers, scatter, all-to-all) is typed as bytes, so every dtype takes MPI's path;
beyond ``INT_MAX`` bytes it raises ConfigError (this MPI may lack the large-count calls).

Mismatches (:meth:`MpiEngine._run`): the first calls of each call shape (op, dtype, count, root, reduce op:
the fingerprint) are checked against the members' calls beside them, so a mismatch raises at once.  From its
DEDICATE_AFTER-th call a shape runs on a communicator of its own, unchecked: MPI matches collectives only
within a communicator, so members calling different shapes never meet, they wait, and the watchdog finds
the different calls through the store, as on the cpu backend (whose tags carry the fingerprint).  After a
collective of a group fails (deadline, dead peer, abort) its MPI operation stays pending, so the group's
communicator is out of step: later collectives of that group raise BrokenError at once.

Point-to-point of the user's API (send/recv/isend/irecv, batch_isend_irecv) goes straight to ``MPI_Isend``
/ ``MPI_Irecv`` on a communicator of its own, with MPI tag ``gid << TAG_BITS | tag`` when both fit
(the others take the transport); ``ANY_SOURCE`` is MPI's.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ... import algorithms
from ...algorithms.comm import STEP_BITS
from ...errors import BrokenError, CollectiveMismatchError, ProcGroupError
from ...ops import ReduceOp, reducer
from ...transport.base import ANY_SOURCE, Request, Status
from ..base import CollectiveEngine
from . import p2pfast as _p2pfast
from ._waiting import Liveness
from .p2pfast import QUICK as _QUICK  # the tests right after posting, before a wait is set up

__all__ = ["MpiEngine", "INT_MAX", "LARGE_ALL_REDUCE", "DEDICATE_AFTER", "DEDICATED_PER_GROUP"]

logger = logging.getLogger("procgroup")

INT_MAX = (1 << 31) - 1
#: all_reduce, reduce and reduce_scatter of at least this many (input) bytes run procgroup's own algorithms over
#: the MPI transport: Open MPI's nonblocking reductions (libnbc) are 2-6x slower than its blocking ones at large
#: sizes, and procgroup's ring / reduce-scatter over MPI point-to-point beats both (docs/mpi.md)
LARGE_ALL_REDUCE = 2 << 20
#: a call shape (fingerprint) of a group gets a communicator of its own after this many checked calls
DEDICATE_AFTER = 2
#: at most this many call shapes of one group get a communicator of their own (MPI's context ids are finite:
#: MPICH has a few thousand per process); the others keep the checked path
DEDICATED_PER_GROUP = 8
#: the fingerprint bits of a call's tag (``Comm.tag >> STEP_BITS``: gid, seq, fingerprint)
_FP = (1 << 16) - 1


class _P2P(Request):
    """An MPI point-to-point request as a procgroup Request (Status.source is a global rank)."""

    __slots__ = ("eng", "req", "st", "peer", "nbytes", "recv", "status", "error")

    def __init__(self, eng: "MpiEngine", req: Any, peer: int, nbytes: int, recv: bool) -> None:
        self.eng = eng
        self.req = req
        self.peer = peer
        self.nbytes = nbytes
        self.recv = recv
        self.st: Any = eng.MPI.Status() if recv else None
        self.status: Optional[Status] = None
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if self.status is not None or self.error is not None:
            return True
        try:
            done = self.req.Test(self.st)
        except self.eng.MPI.Exception as e:
            self.error = self.eng.mpi_error(e, self._what())
            return True
        if done:
            if self.recv:
                self.status = Status(self.st.Get_source(), self.st.Get_count(self.eng.MPI.BYTE))
            else:
                self.status = Status(self.peer, self.nbytes)
        return done

    def _what(self) -> str:
        if self.recv:
            src = "any rank" if self.peer == ANY_SOURCE else f"rank {self.peer}"
            return f"MPI_Irecv from {src} ({self.nbytes} bytes)"
        return f"MPI_Isend to rank {self.peer} ({self.nbytes} bytes)"

    def wait(self, deadline: Any = None) -> Status:
        if not self.test():
            peers = None if self.peer == ANY_SOURCE else (self.peer,)  # any source: any dead rank fails it
            self.eng.live.wait(self.test, deadline, self._what, peers, self.nbytes)
        if self.error is not None:
            raise self.error
        assert self.status is not None
        return self.status


class MpiEngine(CollectiveEngine):
    """Collectives on MPI communicators, one per procgroup group (see the module docstring).

    ``world``: a communicator of all ranks in procgroup's rank order (group 0's); ``p2p``: another one for
    the user's point-to-point; ``live``: the waits' shared state (the transport's abort reaches them);
    ``tag_ub``: MPI's largest tag.  Collective: every rank constructs it at init (it duplicates ``world``).
    """

    name = "mpi"
    #: check the first calls of each call shape beside them (see :meth:`_run`); False saves one tiny
    #: MPI_Iallreduce per such call (~1-3 us) at the price of garbage instead of an error on a mismatch, and
    #: no shape gets a communicator of its own (those that have one keep it)
    check_calls = True

    def __init__(self, MPI: Any, world: Any, p2p: Any, live: Liveness, tag_ub: int) -> None:
        self.MPI = MPI
        self.live = live
        self._world = world
        self._p2p = p2p
        self._comms: Dict[int, Any] = {0: world}
        self._checks: Dict[int, tuple] = {0: self._check_comm(world)}
        self._broken: Dict[int, str] = {}
        #: per group: call fingerprint -> its own communicator (filled in place, cleared in place on poison:
        #: plans hold the dict), and how many checked calls each fingerprint has had
        self._own: Dict[int, Dict[int, Any]] = {}
        self._seen: Dict[int, Dict[int, int]] = {}
        self._no_own: set = set()  # groups where MPI_Comm_idup failed (MPI out of communicators)
        self._make_lock = threading.Lock()
        self._plans: Dict[tuple, Optional[Callable[..., None]]] = {}
        self._in_place = MPI.IN_PLACE
        self._max = MPI.MAX
        bits = max(15, int(tag_ub).bit_length())  # MPI guarantees TAG_UB >= 32767
        self.gid_bits = 6 if bits >= 24 else 3
        self.tag_bits = bits - self.gid_bits
        self._types = self._type_table(MPI)
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVG: MPI.SUM,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }

    @staticmethod
    def _type_table(MPI: Any) -> Dict[Any, Any]:
        table = {
            "int8": MPI.INT8_T,
            "uint8": MPI.UINT8_T,
            "int16": MPI.INT16_T,
            "uint16": MPI.UINT16_T,
            "int32": MPI.INT32_T,
            "uint32": MPI.UINT32_T,
            "int64": MPI.INT64_T,
            "uint64": MPI.UINT64_T,
            "float32": MPI.FLOAT,
            "float64": MPI.DOUBLE,
            "complex64": MPI.C_FLOAT_COMPLEX,
            "complex128": MPI.C_DOUBLE_COMPLEX,
        }
        return {np.dtype(k): v for k, v in table.items() if v != MPI.DATATYPE_NULL}

    # -- errors ------------------------------------------------------------------------------
    def mpi_error(self, e: Any, what: str) -> ProcGroupError:
        """An MPI error (returned, since the error handler is MPI_ERRORS_RETURN) as a procgroup BrokenError."""
        try:
            text = e.Get_error_string()
        except Exception:  # noqa: BLE001 - the code alone still says something
            text = str(e)
        return BrokenError(f"rank {self.live.rank}: {what} failed in the MPI library: {text}")

    # -- communicators -------------------------------------------------------------------------
    def _comm(self, g: Any, c: Any) -> Any:
        comm = self._comms.get(g.gid)
        if comm is not None:
            return comm
        why = self._broken.get(g.gid)
        if why is not None:
            raise BrokenError(why)
        from ...algorithms import barrier

        barrier(c)  # every member is here (under the deadline) before the blocking MPI_Comm_create_group
        with self._make_lock:
            comm = self._comms.get(g.gid)
            if comm is None:
                grp = self._world.Get_group()
                sub = grp.Incl(list(g.ranks))
                try:
                    comm = self._world.Create_group(sub, g.gid)
                finally:
                    sub.Free()
                    grp.Free()
                comm.Set_errhandler(self.MPI.ERRORS_RETURN)
                self._checks[g.gid] = self._check_comm(comm)
                self._comms[g.gid] = comm
        return comm

    def _check_comm(self, comm: Any) -> tuple:
        """The communicator and buffer of a group's call checks (a Dup: its traffic never meets the data's)."""
        dup = comm.Dup()
        dup.Set_errhandler(self.MPI.ERRORS_RETURN)
        chk = np.zeros(2, np.int64)
        return dup, [chk, self.MPI.INT64_T], chk, chk.data

    def own(self, gid: int) -> Dict[int, Any]:
        """Group ``gid``'s call fingerprint -> communicator dict (the same object for the group's lifetime)."""
        own = self._own.get(gid)
        if own is None:
            own = self._own[gid] = {}
        return own

    def _run(self, g: Any, c: Any, post: Optional[Callable[[Any], Any]], what: str, nbytes: int) -> None:
        """Post an MPI nonblocking collective for ``g`` and wait for it under ``c.deadline``.

        ``post`` None: a barrier.  A call shape (fingerprint) that has its own communicator (see
        :meth:`_learn`) posts there and nothing else: MPI matches collectives per communicator, so a member
        calling another shape at this point posts on another communicator, the two never match, both wait,
        and the watchdog finds the different calls through the store (CollectiveMismatchError on every
        member, as on the cpu backend, whose tags carry the fingerprint).  The other calls are checked:
        beside the operation on the group's communicator, an ``MPI_Iallreduce`` (MAX) of ``[w, -w]`` on the
        group's check communicator, where ``w`` is the call's sequence number and fingerprint
        (``Comm.check_word``): members that called different collectives (op, dtype, count, root, reduce op)
        at the same point find ``max(w) != min(w)`` and raise CollectiveMismatchError at once.
        """
        fp = (c.tag >> STEP_BITS) & _FP
        own = self._own.get(g.gid)
        if own:
            ocomm = own.get(fp)
            if ocomm is not None:
                try:
                    req = post(ocomm) if post is not None else ocomm.Ibarrier()
                except self.MPI.Exception as e:
                    raise self.failed(g, what, e) from None
                self.finish(g, c, req, what, nbytes)
                return
        comm = self._comms.get(g.gid)
        if comm is None:
            comm = self._comm(g, c)
        MPI = self.MPI
        try:
            if not self.check_calls:
                assert post is not None, "without the call check every operation posts its own request"
                req = post(comm)
                if not req.Test():
                    self.live.wait(req.Test, c.deadline, lambda: what, g.ranks, nbytes)
                return
            ccomm, chkspec, chk, cv = self._checks[g.gid]
            w = (c.tag >> STEP_BITS) & 0xFFFFFFFF  # c.check_word(), inline
            cv[0] = w  # through a memoryview: Python ints in and out, no numpy scalars (~0.3 us a call)
            cv[1] = -w
            creq = ccomm.Iallreduce(self._in_place, chkspec, self._max)
            req = post(comm) if post is not None else _DONE
            if creq.Test():  # the common case: the check is done by the time the data is posted
                if cv[0] != -cv[1]:
                    raise self._mismatch(g, what, w, chk)
                if not req.Test():
                    self.live.wait(req.Test, c.deadline, lambda: what, g.ranks, nbytes)
            else:
                checked = False

                def done() -> bool:
                    nonlocal checked
                    if not checked:
                        if not creq.Test():
                            return False
                        checked = True
                        if cv[0] != -cv[1]:
                            raise self._mismatch(g, what, w, chk)
                    return bool(req.Test())

                self.live.wait(done, c.deadline, lambda: what, g.ranks, nbytes)
            self._learn(g, c, comm, fp)
        except MPI.Exception as e:
            self._poison(g, f"{what} failed in the MPI library")
            raise self.mpi_error(e, what) from None
        except ProcGroupError as e:
            self._poison(g, f"an earlier collective of this group ({what}) ended with {type(e).__name__}")
            raise

    def _learn(self, g: Any, c: Any, comm: Any, fp: int) -> None:
        """After a checked call of fingerprint ``fp``: on its DEDICATE_AFTER-th, give that call shape a
        communicator of its own (``MPI_Comm_idup`` of the group's, polled under the call's deadline).

        Every member decides alike: the counts come from calls the check just proved equal on every member,
        and the dup follows that call on the group's communicator, where MPI matches collectives in order."""
        seen = self._seen.get(g.gid)
        if seen is None:
            seen = self._seen[g.gid] = {}
        n = seen[fp] = seen.get(fp, 0) + 1
        if n != DEDICATE_AFTER:
            return
        own = self.own(g.gid)
        if len(own) >= DEDICATED_PER_GROUP or g.gid in self._no_own:
            return
        try:
            dup, req = comm.Idup()
            if not req.Test():
                self.live.wait(req.Test, c.deadline, lambda: "MPI_Comm_idup", g.ranks, 0)
        except self.MPI.Exception as e:
            # out of communicators (MPICH has ~2000 context ids a process): the members agree on a new one
            # collectively, so every member fails alike, and the group keeps the checked path
            self._no_own.add(g.gid)
            logger.info("group %s: no communicator of its own for a call shape (%s); calls stay checked", g.name, e)
            return
        dup.Set_errhandler(self.MPI.ERRORS_RETURN)
        own[fp] = dup

    def finish(self, g: Any, c: Any, req: Any, what: str, nbytes: int) -> None:
        """Complete ``req``, a collective of ``g`` on a communicator of its call shape: a few quick Tests (the
        peers are usually a few us away), then :meth:`wait`."""
        try:
            test = req.Test
            for _ in _QUICK:
                if test():
                    return
        except self.MPI.Exception as e:
            raise self.failed(g, what, e) from None
        self.wait(g, c, req, what, nbytes)

    def wait(self, g: Any, c: Any, req: Any, what: str, nbytes: int) -> None:
        """Wait for ``req`` of a collective of ``g`` under ``c.deadline``; an error poisons the group."""
        self.wait_until(g, c.deadline, req, what, nbytes)

    def wait_until(self, g: Any, deadline: Any, req: Any, what: str, nbytes: int) -> None:
        """Wait for ``req`` of a collective of ``g`` under ``deadline``; an error poisons the group."""
        try:
            self.live.wait(req.Test, deadline, lambda: what, g.ranks, nbytes)
        except self.MPI.Exception as e:
            raise self.failed(g, what, e) from None
        except ProcGroupError as e:
            self._poison(g, f"an earlier collective of this group ({what}) ended with {type(e).__name__}")
            raise

    def failed(self, g: Any, what: str, e: Any) -> ProcGroupError:
        """MPI error ``e`` of ``what`` as a BrokenError; poisons ``g``."""
        self._poison(g, f"{what} failed in the MPI library")
        return self.mpi_error(e, what)

    def _mismatch(self, g: Any, what: str, w: int, chk: np.ndarray) -> ProcGroupError:
        return CollectiveMismatchError(
            f"{what}: the members of group {g.name} called different collectives at this point (sequence "
            f"number and call fingerprint {w:#010x} here; {int(chk[0]):#010x} and {int(-chk[1]):#010x} are "
            "the highest and lowest among the members): make every rank call the same collectives, in the same "
            "order, with the same dtype, size, root and reduce op"
        )

    def _poison(self, g: Any, why: str) -> None:
        self._comms.pop(g.gid, None)  # its pending operation may still complete; the communicator is not freed
        own = self._own.get(g.gid)
        if own:
            own.clear()  # in place: the group's plans hold this dict
        self._broken[g.gid] = (
            f"group {g.name}: {why}, so MPI's communicator of the group is out of step; destroy the group "
            "(or the job) and create it again"
        )

    # -- plans ---------------------------------------------------------------------------------
    def _reduction(self, dtype: Any, op: Any) -> Optional[tuple]:
        if isinstance(dtype, str):
            return None  # bfloat16
        t = self._types.get(dtype)
        if t is None:
            return None  # bool, float16, ...
        if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind in "fc":
            return None  # NaN semantics differ
        mop = self._ops.get(op)
        return None if mop is None else (t, mop)

    def all_reduce(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``MPI_Iallreduce`` in place, or None for what MPI computes differently (see the module)."""
        key = ("ar", group.gid, dtype, op)
        try:
            return self._plans[key]
        except KeyError:
            pass
        tm = self._reduction(dtype, op)
        plan: Optional[Callable[..., None]] = None
        if tm is not None:
            t, mop = tm
            IN_PLACE = self.MPI.IN_PLACE
            run = self._run
            kern = reducer(op, dtype)

            own = self.own(group.gid)
            MPIException = self.MPI.Exception
            wait = self.wait

            def plan(c: Any, buf: np.ndarray) -> None:
                nbytes = buf.nbytes
                if nbytes >= LARGE_ALL_REDUCE:
                    algorithms.all_reduce(c, buf, kern)  # over the MPI transport: faster than MPI's here
                    return
                if own:  # _run's first branch, inline: every small all_reduce of a warm loop comes here
                    m = own.get((c.tag >> STEP_BITS) & _FP)
                    if m is not None:
                        try:
                            req = m.Iallreduce(IN_PLACE, [buf, t], mop)
                            test = req.Test
                            for _ in _QUICK:  # the peers are usually a few us away: no wait set up
                                if test():
                                    return
                        except MPIException as e:
                            raise self.failed(group, "MPI_Iallreduce", e) from None
                        wait(group, c, req, "MPI_Iallreduce", nbytes)
                        return
                run(group, c, lambda m: m.Iallreduce(IN_PLACE, [buf, t], mop), "MPI_Iallreduce", nbytes)

        self._plans[key] = plan
        return plan

    def reduce(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``MPI_Ireduce`` (in place at the root), procgroup's algorithm from LARGE_ALL_REDUCE bytes, or None."""
        key = ("rd", group.gid, dtype, op)
        try:
            return self._plans[key]
        except KeyError:
            pass
        tm = self._reduction(dtype, op)
        plan: Optional[Callable[..., None]] = None
        if tm is not None:
            t, mop = tm
            IN_PLACE = self.MPI.IN_PLACE
            run = self._run
            kern = reducer(op, dtype)

            def plan(c: Any, buf: np.ndarray, root: int) -> None:
                nbytes = buf.nbytes
                if nbytes >= LARGE_ALL_REDUCE:
                    algorithms.reduce(c, buf, kern, root)  # as for all_reduce: faster than MPI_Ireduce here
                    return
                if c.rank == root:
                    run(group, c, lambda m: m.Ireduce(IN_PLACE, [buf, t], mop, root), "MPI_Ireduce", nbytes)
                else:
                    run(group, c, lambda m: m.Ireduce([buf, t], None, mop, root), "MPI_Ireduce", nbytes)

        self._plans[key] = plan
        return plan

    def reduce_scatter(self, group: Any, dtype: Any, op: Any) -> Optional[Callable[..., None]]:
        """``MPI_Ireduce_scatter_block``, procgroup's algorithm from LARGE_ALL_REDUCE input bytes, or None."""
        key = ("rs", group.gid, dtype, op)
        try:
            return self._plans[key]
        except KeyError:
            pass
        tm = self._reduction(dtype, op)
        plan: Optional[Callable[..., None]] = None
        if tm is not None:
            t, mop = tm
            run = self._run
            kern = reducer(op, dtype)

            def plan(c: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
                nbytes = sendbuf.nbytes
                if nbytes >= LARGE_ALL_REDUCE:
                    algorithms.reduce_scatter(c, sendbuf, recvbuf, kern)  # faster than libnbc's here
                    return
                post = lambda m: m.Ireduce_scatter_block([sendbuf, t], [recvbuf, t], mop)  # noqa: E731
                run(group, c, post, "MPI_Ireduce_scatter_block", nbytes)

        self._plans[key] = plan
        return plan

    def broadcast(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``MPI_Ibcast`` of the bytes."""
        BYTE = self.MPI.BYTE
        own = self.own(group.gid)
        MPIException = self.MPI.Exception

        def plan(c: Any, buf: np.ndarray, root: int) -> None:
            nbytes = buf.nbytes
            _fits("broadcast", nbytes)
            if own:  # _run's first branch, inline
                m = own.get((c.tag >> STEP_BITS) & _FP)
                if m is not None:
                    try:
                        req = m.Ibcast([buf, BYTE], root)
                    except MPIException as e:
                        raise self.failed(group, "MPI_Ibcast", e) from None
                    self.finish(group, c, req, "MPI_Ibcast", nbytes)
                    return
            self._run(group, c, lambda m: m.Ibcast([buf, BYTE], root), "MPI_Ibcast", nbytes)

        return plan

    def all_gather(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``MPI_Iallgather`` of the bytes."""
        BYTE = self.MPI.BYTE

        def plan(c: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
            _fits("all_gather", recvbuf.nbytes)
            post = lambda m: m.Iallgather([sendbuf, BYTE], [recvbuf, BYTE])  # noqa: E731
            self._run(group, c, post, "MPI_Iallgather", recvbuf.nbytes)

        return plan

    def gather(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``MPI_Igather`` of the bytes."""
        BYTE = self.MPI.BYTE

        def plan(c: Any, sendbuf: np.ndarray, recvbuf: Optional[np.ndarray], root: int) -> None:
            _fits("gather", sendbuf.nbytes * c.size)
            rb = [recvbuf, BYTE] if c.rank == root else None
            post = lambda m: m.Igather([sendbuf, BYTE], rb, root)  # noqa: E731
            self._run(group, c, post, "MPI_Igather", sendbuf.nbytes)

        return plan

    def scatter(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``MPI_Iscatter`` of the bytes."""
        BYTE = self.MPI.BYTE

        def plan(c: Any, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray, root: int) -> None:
            _fits("scatter", recvbuf.nbytes * c.size)
            sb = [sendbuf, BYTE] if c.rank == root else None
            post = lambda m: m.Iscatter(sb, [recvbuf, BYTE], root)  # noqa: E731
            self._run(group, c, post, "MPI_Iscatter", recvbuf.nbytes)

        return plan

    def all_to_all(self, group: Any, dtype: Any) -> Optional[Callable[..., None]]:
        """``MPI_Ialltoall`` (equal blocks) or ``MPI_Ialltoallv``, of the bytes."""
        BYTE = self.MPI.BYTE

        def plan(
            c: Any, sendbuf: np.ndarray, scounts: Sequence[int], recvbuf: np.ndarray, rcounts: Sequence[int]
        ) -> None:
            _fits("all_to_all", max(sendbuf.nbytes, recvbuf.nbytes))
            item = sendbuf.itemsize
            if len(set(scounts)) <= 1 and list(scounts) == list(rcounts):
                post = lambda m: m.Ialltoall([sendbuf, BYTE], [recvbuf, BYTE])  # noqa: E731
                self._run(group, c, post, "MPI_Ialltoall", sendbuf.nbytes)
                return
            sc = [k * item for k in scounts]
            rc = [k * item for k in rcounts]
            sd = [int(x) for x in np.cumsum([0] + sc[:-1])]
            rd = [int(x) for x in np.cumsum([0] + rc[:-1])]
            post = lambda m: m.Ialltoallv([sendbuf, (sc, sd), BYTE], [recvbuf, (rc, rd), BYTE])  # noqa: E731
            self._run(group, c, post, "MPI_Ialltoallv", sendbuf.nbytes)

        return plan

    def barrier(self, group: Any) -> Optional[Callable[..., None]]:
        """``MPI_Ibarrier``; with :attr:`check_calls`, the call check alone (an allreduce is a barrier too)."""

        def plan(c: Any) -> None:
            self._run(group, c, None if self.check_calls else _ibarrier, "MPI_Ibarrier", 0)

        return plan

    def post_first(
        self, group: Any, op: str, fpx: int, nbytes: int, dtype: Any = None, reduce_op: Any = None, root: int = -1
    ) -> Optional[Tuple[Callable[..., Any], Callable[..., bool], Callable[[BaseException], BaseException]]]:
        """A warm call shape's MPI operation posted before ``run_plan``'s bookkeeping (see the base class).

        ``post`` posts on the shape's own communicator (``own[fpx]``, as :meth:`_run`'s first branch) and
        returns the request; while the shape has none (its first, checked calls; a poisoned group) it returns
        None and the plan's full function runs the call.  Sizes that take procgroup's own algorithms, AVG
        (the caller divides) and what MPI computes differently get no split."""
        own = self.own(group.gid)
        MPIException = self.MPI.Exception
        failed = self.failed
        IN_PLACE, BYTE = self.MPI.IN_PLACE, self.MPI.BYTE
        post: Optional[Callable[..., Any]] = None
        if op in ("all_reduce", "reduce"):
            tm = self._reduction(dtype, reduce_op)
            if tm is None or reduce_op is ReduceOp.AVG or nbytes >= LARGE_ALL_REDUCE:
                return None
            t, mop = tm
            if op == "all_reduce":
                what = "MPI_Iallreduce"

                def post(a: Any, b: Any) -> Any:
                    m = own.get(fpx)
                    if m is None:
                        return None
                    try:
                        return m.Iallreduce(IN_PLACE, [a, t], mop)
                    except MPIException as e:
                        raise failed(group, what, e) from None

            elif group.rank() == root:
                what = "MPI_Ireduce"

                def post(a: Any, b: Any) -> Any:
                    m = own.get(fpx)
                    if m is None:
                        return None
                    try:
                        return m.Ireduce(IN_PLACE, [a, t], mop, root)
                    except MPIException as e:
                        raise failed(group, what, e) from None

            else:
                what = "MPI_Ireduce"

                def post(a: Any, b: Any) -> Any:
                    m = own.get(fpx)
                    if m is None:
                        return None
                    try:
                        return m.Ireduce([a, t], None, mop, root)
                    except MPIException as e:
                        raise failed(group, what, e) from None

        elif op == "broadcast" and nbytes <= INT_MAX:
            what = "MPI_Ibcast"

            def post(a: Any, b: Any) -> Any:
                m = own.get(fpx)
                if m is None:
                    return None
                try:
                    return m.Ibcast([a, BYTE], root)
                except MPIException as e:
                    raise failed(group, what, e) from None

        elif op == "all_gather" and nbytes * group.size() <= INT_MAX:
            what = "MPI_Iallgather"

            def post(a: Any, b: Any) -> Any:
                m = own.get(fpx)
                if m is None:
                    return None
                try:
                    return m.Iallgather([a, BYTE], [b, BYTE])
                except MPIException as e:
                    raise failed(group, what, e) from None

        elif op == "barrier":
            what = "MPI_Ibarrier"

            def post(a: Any, b: Any) -> Any:
                m = own.get(fpx)
                if m is None:
                    return None
                try:
                    return m.Ibarrier()
                except MPIException as e:
                    raise failed(group, what, e) from None

        if post is None:
            return None
        wait_until = self.wait_until

        def done(deadline: Any, req: Any) -> bool:  # after run_plan's own first Tests found it pending
            try:
                for _ in _QUICK:  # the peers are usually a few us away: no wait set up
                    if req.Test():
                        return False
            except MPIException as e:
                raise failed(group, what, e) from None
            wait_until(group, deadline, req, what, nbytes)
            return True

        def fail(e: BaseException) -> BaseException:  # an error of the request's Test in run_plan
            return failed(group, what, e) if isinstance(e, MPIException) else e

        return post, done, fail

    # -- point-to-point ------------------------------------------------------------------------
    def _tag(self, group: Any, tag: int, code: int = 0) -> int:
        """MPI tag ``gid << tag_bits | code << (tag_bits - 5) | tag`` (code: the dtype's); -1 when it does not fit."""
        if group.gid >> self.gid_bits or tag >> (self.tag_bits - 5) or code >> 5:
            return -1
        return (group.gid << self.tag_bits) | (code << (self.tag_bits - 5)) | tag

    def unmatched(self, group: Any, src: int, tag: int, code: int) -> Optional[Tuple[int, int]]:
        """An arrived message of (group, tag) from ``src`` with another dtype code: (its source, its code), or None.

        ``MPI_Iprobe`` for each of the 31 other codes: the slow path of a receive that waits.
        """
        if self._tag(group, tag, code) < 0:
            return None
        st = self.MPI.Status()
        source = self.MPI.ANY_SOURCE if src == ANY_SOURCE else src
        for other in range(32):
            if other != code and self._p2p.Iprobe(source, self._tag(group, tag, other), st):
                return st.Get_source(), other
        return None

    def isend(self, group: Any, dst: int, tag: int, buf: Any, code: int = 0) -> Optional[Request]:
        """``MPI_Isend`` on the point-to-point communicator, or None when the (group, tag) does not fit."""
        mtag = self._tag(group, tag, code)
        if mtag < 0:
            return None
        live = self.live
        if live.aborted is not None or live.closed or live.failed:
            live.check((dst,), f"send to rank {dst}")
        try:
            req = self._p2p.Isend([buf, self.MPI.BYTE], dst, mtag)
        except self.MPI.Exception as e:
            raise self.mpi_error(e, f"MPI_Isend to rank {dst}") from None
        return _P2P(self, req, dst, buf.nbytes, False)

    def irecv(self, group: Any, src: int, tag: int, out: Any, code: int = 0) -> Optional[Request]:
        """``MPI_Irecv`` (``MPI_ANY_SOURCE`` for ANY_SOURCE), or None when the (group, tag) does not fit."""
        mtag = self._tag(group, tag, code)
        if mtag < 0:
            return None
        live = self.live
        if live.aborted is not None or live.closed:
            live.check((), f"recv from rank {src}")
        source = self.MPI.ANY_SOURCE if src == ANY_SOURCE else src
        try:
            req = self._p2p.Irecv([out, self.MPI.BYTE], source, mtag)
        except self.MPI.Exception as e:
            raise self.mpi_error(e, f"MPI_Irecv from rank {src}") from None
        return _P2P(self, req, src, out.nbytes, True)

    def p2p_fast(self, group: Any, recv: bool, tag: int, code: int) -> Optional[Callable[..., Any]]:
        """procgroup.send/recv's blocking send/recv of (group, tag, dtype code), bound (:mod:`.p2pfast`)."""
        mtag = self._tag(group, tag, code)
        if mtag < 0:
            return None
        return functools.partial(_p2pfast.recv if recv else _p2pfast.send, self, _P2P, mtag)

    def forget_group(self, gid: int) -> None:
        """Drop destroyed group ``gid``'s communicator, call-check communicator and broken mark (not freed: as
        in close), and free its call shapes' communicators unless it broke (then an operation may be pending
        on one), so that MPI's communicators are not used up by groups made and destroyed in a loop.  Ids are
        not reused under this engine (see subgroups.release_gid)."""
        if gid == 0:
            return
        with self._make_lock:
            self._comms.pop(gid, None)
            self._checks.pop(gid, None)
            broken = self._broken.pop(gid, None) is not None
            self._seen.pop(gid, None)
            self._no_own.discard(gid)
            own = self._own.pop(gid, None)
            if own:
                if not broken:
                    for m in own.values():
                        try:
                            m.Free()  # local in Open MPI and MPICH: marks it for release once idle
                        except self.MPI.Exception as e:
                            logger.debug("MPI_Comm_free of a destroyed group's communicator: %s", e)
                own.clear()

    def close(self) -> None:
        """Forget the communicators (they are released by MPI_Finalize; freeing one may wait for peers)."""
        self._comms.clear()
        self._checks.clear()
        self._plans.clear()
        for own in self._own.values():
            own.clear()
        self._seen.clear()


class _Done:
    """A request that is complete: the operation of a call whose check is the whole operation (barrier)."""

    @staticmethod
    def Test() -> bool:  # noqa: N802 - MPI's spelling, as the requests it stands in for
        return True


_DONE = _Done()


def _ibarrier(m: Any) -> Any:
    return m.Ibarrier()


def _fits(op: str, nbytes: int) -> None:
    if nbytes > INT_MAX:
        raise _too_big(op, nbytes)


def _too_big(op: str, count: int) -> ProcGroupError:
    from ...errors import ConfigError

    return ConfigError(
        f"{op}: {count} elements/bytes exceed MPI's int count limit ({INT_MAX}); split the tensor into smaller "
        "calls, or use backend='cpu'"
    )
