"""procgroup's benchmark worker: ``procgroup run --standalone --nproc-per-node N -m procgroup.bench.worker --out F``."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

import numpy as np

import procgroup as dist

from ._common import argv_list, drive, worker_parser
from .cases import Adapter


class ProcgroupAdapter(Adapter):
    name = "procgroup"

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._one = np.zeros(1, dtype=np.int64)

    def barrier(self) -> None:
        dist.barrier()

    def gather_rows(self, row: np.ndarray) -> Optional[np.ndarray]:
        row = np.ascontiguousarray(row, dtype=np.float64)
        if self.rank == 0:
            out = [np.empty_like(row) for _ in range(self.size)]
            dist.gather(row, out, dst=0)
            return np.stack(out)
        dist.gather(row, None, dst=0)
        return None

    def bcast_int(self, value: int) -> int:
        self._one[0] = value
        dist.broadcast(self._one, src=0)
        return int(self._one[0])

    def op(self, op: str, inp: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        r = self.rank
        if op == "all_reduce":
            return lambda: dist.all_reduce(inp)
        if op == "broadcast":
            return lambda: dist.broadcast(inp, src=0)
        if op == "reduce":
            return lambda: dist.reduce(inp, dst=0)
        if op == "all_gather":
            return lambda: dist.all_gather_into_tensor(out, inp)
        if op == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(out, inp)
        if op == "all_to_all":
            return lambda: dist.all_to_all_single(out, inp)
        if op == "sendrecv":
            if r == 0:
                def ping() -> None:
                    dist.send(inp, dst=1)
                    dist.recv(inp, src=1)
                return ping
            if r == 1:
                def pong() -> None:
                    dist.recv(inp, src=0)
                    dist.send(inp, dst=0)
                return pong
            return lambda: None
        raise ValueError(f"unknown op {op!r}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = worker_parser("procgroup.bench.worker").parse_args(argv_list(argv))
    dist.init_process_group(timeout=ns.timeout)
    try:
        a = ProcgroupAdapter()
        info = {"procgroup": dist.__version__,
                "transport": os.environ.get("PROCGROUP_TRANSPORT", "auto")}
        return drive(a, ns, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
