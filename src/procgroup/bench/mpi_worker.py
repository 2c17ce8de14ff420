"""MPI (mpi4py, buffer interface) benchmark worker:
``mpirun --allow-run-as-root --oversubscribe -np N python -m procgroup.bench.mpi_worker --out F``.

Uses the upper-case, buffer-based calls on numpy arrays (no pickling):
Allreduce, Bcast, Reduce, Allgather, Reduce_scatter_block, Alltoall,
Barrier, Send/Recv.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import numpy as np

from ._common import argv_list, drive, worker_parser
from .cases import Adapter


class MPIAdapter(Adapter):
    name = "mpi"

    def __init__(self, MPI) -> None:
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._one = np.zeros(1, dtype=np.int64)

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather_rows(self, row: np.ndarray) -> Optional[np.ndarray]:
        row = np.ascontiguousarray(row, dtype=np.float64)
        out = np.empty((self.size, row.size), dtype=np.float64) if self.rank == 0 else None
        self.comm.Gather(row, out, root=0)
        return out

    def bcast_int(self, value: int) -> int:
        self._one[0] = value
        self.comm.Bcast(self._one, root=0)
        return int(self._one[0])

    def op(self, op: str, inp: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        c, MPI = self.comm, self.MPI
        r = self.rank
        if op == "all_reduce":
            return lambda: c.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM)
        if op == "broadcast":
            return lambda: c.Bcast(inp, root=0)
        if op == "reduce":
            if r == 0:
                return lambda: c.Reduce(MPI.IN_PLACE, inp, op=MPI.SUM, root=0)
            return lambda: c.Reduce(inp, None, op=MPI.SUM, root=0)
        if op == "all_gather":
            return lambda: c.Allgather(inp, out)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(inp, out, op=MPI.SUM)
        if op == "all_to_all":
            return lambda: c.Alltoall(inp, out)
        if op == "sendrecv":
            if r == 0:

                def ping() -> None:
                    c.Send(inp, dest=1, tag=7)
                    c.Recv(inp, source=1, tag=7)

                return ping
            if r == 1:

                def pong() -> None:
                    c.Recv(inp, source=0, tag=7)
                    c.Send(inp, dest=0, tag=7)

                return pong
            return lambda: None
        raise ValueError(f"unknown op {op!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = worker_parser("procgroup.bench.mpi_worker").parse_args(argv_list(argv))
    import mpi4py
    from mpi4py import MPI

    a = MPIAdapter(MPI)
    info = {"mpi4py": mpi4py.__version__, "mpi_library": MPI.Get_library_version().strip().splitlines()[0]}
    try:
        return drive(a, ns, info)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # do not leave the peers hanging in a collective
        raise


if __name__ == "__main__":
    sys.exit(main())
