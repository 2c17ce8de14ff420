"""torch.distributed (gloo) benchmark worker, started the same way as procgroup's:
``procgroup run --standalone --nproc-per-node N -m procgroup.bench.torch_worker --out F``.

``procgroup run`` gives the workers torchrun's environment, so gloo joins
with ``env://`` (rank 0 binds torch's store on MASTER_PORT).  Should the
launcher say it hosts *procgroup's* store on MASTER_PORT itself
(``PROCGROUP_STORE_HOSTED=1``), which torch cannot speak, rank 0 instead
opens a torch ``TCPStore`` on a free port and publishes the port through
procgroup's store.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from ._common import argv_list, drive, worker_parser
from .cases import Adapter


class GlooAdapter(Adapter):
    name = "gloo"

    def __init__(self, torch, dist) -> None:  # type: ignore[no-untyped-def]
        self.torch, self.dist = torch, dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._one = torch.zeros(1, dtype=torch.int64)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather_rows(self, row: np.ndarray) -> Optional[np.ndarray]:
        t = self.torch.from_numpy(np.ascontiguousarray(row, dtype=np.float64))
        if self.rank == 0:
            out = [self.torch.empty_like(t) for _ in range(self.size)]
            self.dist.gather(t, out, dst=0)
            return np.stack([o.numpy() for o in out])
        self.dist.gather(t, None, dst=0)
        return None

    def bcast_int(self, value: int) -> int:
        self._one[0] = value
        self.dist.broadcast(self._one, src=0)
        return int(self._one[0])

    def op(self, op: str, inp: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        d = self.dist
        ti = self.torch.from_numpy(inp)  # shares memory: the numpy-side check sees the result
        to = self.torch.from_numpy(out)
        r = self.rank
        if op == "all_reduce":
            return lambda: d.all_reduce(ti)
        if op == "broadcast":
            return lambda: d.broadcast(ti, src=0)
        if op == "reduce":
            return lambda: d.reduce(ti, dst=0)
        if op == "all_gather":
            return lambda: d.all_gather_into_tensor(to, ti)
        if op == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(to, ti)
        if op == "all_to_all":
            return lambda: d.all_to_all_single(to, ti)
        if op == "sendrecv":
            if r == 0:
                def ping() -> None:
                    d.send(ti, dst=1)
                    d.recv(ti, src=1)
                return ping
            if r == 1:
                def pong() -> None:
                    d.recv(ti, src=0)
                    d.send(ti, dst=0)
                return pong
            return lambda: None
        raise ValueError(f"unknown op {op!r}")


def _torch_store(torch_dist, timeout: float):  # type: ignore[no-untyped-def]
    from ..config import ENV
    from ..store import TCPStore

    rank, n = int(os.environ[ENV.RANK]), int(os.environ[ENV.WORLD_SIZE])
    host = os.environ.get(ENV.MASTER_ADDR, "127.0.0.1")
    ours = TCPStore(host, int(os.environ[ENV.MASTER_PORT]), secret=os.environ[ENV.SECRET], timeout=timeout)
    key = "procgroup.bench/torch_store_port"
    td = datetime.timedelta(seconds=timeout)
    if rank == 0:
        store = torch_dist.TCPStore(host, 0, n, is_master=True, timeout=td, wait_for_workers=False)
        ours.set(key, str(store.port))
    else:
        port = int(ours.get(key))
        store = torch_dist.TCPStore(host, port, n, is_master=False, timeout=td)
    ours.close()
    return store, rank, n


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = worker_parser("procgroup.bench.torch_worker").parse_args(argv_list(argv))
    import torch
    import torch.distributed as dist

    from ..config import ENV, env_bool

    td = datetime.timedelta(seconds=ns.timeout)
    if env_bool(ENV.STORE_HOSTED):
        store, rank, n = _torch_store(dist, ns.timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=td)
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=td)
    try:
        a = GlooAdapter(torch, dist)
        info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
        return drive(a, ns, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
