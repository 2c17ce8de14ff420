"""Blocking point-to-point of backend="mpi" without the general path's per-call work (issue 13).

``procgroup.send``/``recv`` on a plain contiguous numpy array cache, per group, (peer, tag, dtype) ->
this module's ``send``/``recv`` bound to the MPI tag (:meth:`MpiEngine.p2p_fast`).  Each posts
``MPI_Isend``/``MPI_Irecv`` on the engine's point-to-point communicator and tests it a few times: a message
that completes at once (the common case of a ping-pong) costs no Request object, no context closure and no
wait set-up.  One still pending is returned as the engine's Request, and the caller waits on it as on the
general path's (deadline, peer-failure naming, the dtype-mismatch probe).  The liveness checks are the
general path's: with a failed, aborted or closed engine these return False / -1 and the general path raises.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["send", "recv"]

#: Tests a call makes right after posting, before it sets up a wait (:meth:`Liveness.wait`: deadline, back-off);
#: the engine's collectives use them too
QUICK = range(32)


def send(eng: Any, wrap: Callable[..., Any], mtag: int, dst: int, ptag: int, arr: Any) -> Any:
    """``MPI_Isend`` of ``arr`` to ``dst``: True when it completed within QUICK tests, else its Request (False:
    take the general path, nothing posted).  ``ptag`` (procgroup's transport tag) is unused: ``mtag`` is MPI's."""
    live = eng.live
    if live.aborted is not None or live.closed or live.failed:
        return False
    MPI = eng.MPI
    try:
        req = eng._p2p.Isend([arr, MPI.BYTE], dst, mtag)
        test = req.Test
        for _ in QUICK:
            if test():
                return True
    except MPI.Exception as e:
        raise eng.mpi_error(e, f"MPI_Isend to rank {dst}") from None
    return wrap(eng, req, dst, arr.nbytes, False)


def recv(eng: Any, wrap: Callable[..., Any], mtag: int, src: int, ptag: int, out: Any) -> Any:
    """``MPI_Irecv`` into ``out`` from ``src``: the byte count when it completed within QUICK tests, else its
    Request (-1: take the general path, nothing posted)."""
    live = eng.live
    if live.aborted is not None or live.closed:
        return -1
    MPI = eng.MPI
    st = MPI.Status()
    try:
        req = eng._p2p.Irecv([out, MPI.BYTE], src, mtag)
        test = req.Test
        for _ in QUICK:
            if test(st):
                return st.Get_count(MPI.BYTE)
    except MPI.Exception as e:
        raise eng.mpi_error(e, f"MPI_Irecv from rank {src}") from None
    return wrap(eng, req, src, out.nbytes, True)
