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
from typing import Optional, Sequence

from ._common import argv_list, drive, worker_parser
from .cases import TorchStyleAdapter


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
        a = TorchStyleAdapter("gloo", dist, torch.from_numpy)
        info = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
        return drive(a, ns, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
