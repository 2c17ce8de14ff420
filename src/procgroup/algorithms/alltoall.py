"""All-to-all with per-peer element counts (displacements are prefix sums).

* :func:`alltoall_linear` -- post every receive, then every send (small: one
  round of latency; many messages in flight).
* :func:`alltoall_pairwise` -- p - 1 exchange steps, one peer at a time
  (large: bounded in-flight data).  Power-of-two sizes pair ranks by XOR
  (both directions in one exchange); others send to r + s and receive from r - s.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from ..errors import ConfigError, ProcGroupError
from ._util import P_ALLTOALL, prefix, step, u8

__all__ = ["alltoall_linear", "alltoall_pairwise", "check_alltoall"]


def check_alltoall(
    comm: Any, sendbuf: np.ndarray, send_counts: Sequence[int], recvbuf: np.ndarray, recv_counts: Sequence[int]
) -> Tuple[List[int], List[int]]:
    p, r = comm.size, comm.rank
    if len(send_counts) != p or len(recv_counts) != p:
        raise ConfigError(
            f"all_to_all needs one send and one receive count per rank ({p}), "
            f"got {len(send_counts)} and {len(recv_counts)}"
        )
    if any(int(c) < 0 for c in send_counts) or any(int(c) < 0 for c in recv_counts):
        raise ConfigError("all_to_all counts must be >= 0")
    so, ro = prefix(send_counts), prefix(recv_counts)
    if so[p] > sendbuf.shape[0]:
        raise ConfigError(f"all_to_all: send counts sum to {so[p]} elements but sendbuf has {sendbuf.shape[0]}")
    if ro[p] > recvbuf.shape[0]:
        raise ConfigError(f"all_to_all: receive counts sum to {ro[p]} elements but recvbuf has {recvbuf.shape[0]}")
    if sendbuf.dtype.itemsize != recvbuf.dtype.itemsize:
        raise ConfigError(f"all_to_all: sendbuf ({sendbuf.dtype}) and recvbuf ({recvbuf.dtype}) element sizes differ")
    if int(send_counts[r]) != int(recv_counts[r]):
        raise ConfigError(
            f"all_to_all: rank {r} sends {send_counts[r]} elements to itself but expects {recv_counts[r]}"
        )
    return so, ro


def _own(sendbuf: np.ndarray, so: List[int], recvbuf: np.ndarray, ro: List[int], r: int) -> None:
    np.copyto(u8(recvbuf[ro[r] : ro[r + 1]]), u8(sendbuf[so[r] : so[r + 1]]))


def _expect(st: Any, want: int, peer: int, r: int) -> None:
    if st.nbytes != want:
        raise ProcGroupError(
            f"all_to_all on rank {r}: rank {peer} sent {st.nbytes} bytes but recv_counts says {want}: "
            "the ranks' send/receive counts disagree"
        )


def alltoall_linear(
    comm: Any, sendbuf: np.ndarray, send_counts: Sequence[int], recvbuf: np.ndarray, recv_counts: Sequence[int]
) -> None:
    p, r = comm.size, comm.rank
    so, ro = check_alltoall(comm, sendbuf, send_counts, recvbuf, recv_counts)
    stp = step(P_ALLTOALL)
    recvs = []
    for s in range(1, p):
        src = (r - s) % p
        part = recvbuf[ro[src] : ro[src + 1]]
        if part.size:
            recvs.append((src, part.nbytes, comm.irecv(src, u8(part), stp)))
    sends = []
    for s in range(1, p):
        dst = (r + s) % p
        part = sendbuf[so[dst] : so[dst + 1]]
        if part.size:
            sends.append(comm.isend(dst, u8(part), stp))
    _own(sendbuf, so, recvbuf, ro, r)
    for src, want, req in recvs:
        _expect(req.wait(comm.deadline), want, src, r)
    comm.wait_all(sends)


def alltoall_pairwise(
    comm: Any, sendbuf: np.ndarray, send_counts: Sequence[int], recvbuf: np.ndarray, recv_counts: Sequence[int]
) -> None:
    p, r = comm.size, comm.rank
    so, ro = check_alltoall(comm, sendbuf, send_counts, recvbuf, recv_counts)
    _own(sendbuf, so, recvbuf, ro, r)
    pow2 = p & (p - 1) == 0
    stp = step(P_ALLTOALL)
    for s in range(1, p):
        if pow2:
            dst = src = r ^ s
        else:
            dst, src = (r + s) % p, (r - s) % p
        rpart = recvbuf[ro[src] : ro[src + 1]]
        spart = sendbuf[so[dst] : so[dst + 1]]
        if rpart.size:
            req = comm.irecv(src, u8(rpart), stp)
        sreq = comm.isend(dst, u8(spart), stp) if spart.size else None
        if rpart.size:
            _expect(req.wait(comm.deadline), rpart.nbytes, src, r)
        if sreq is not None:
            sreq.wait(comm.deadline)
