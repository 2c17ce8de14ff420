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
import sys
from typing import Optional, Sequence

from ._common import argv_list, drive, worker_parser
from .cases import TorchStyleAdapter


def _torch_store(torch_dist, timeout: float):
    from ..config import DEFAULT_MASTER_ADDR, RuntimeConfig
    from ..identity import detect_identity
    from ..store import TCPStore

    ident, cfg = detect_identity(), RuntimeConfig.load()
    rank, n = ident.rank, ident.world_size
    host = ident.master_addr or DEFAULT_MASTER_ADDR
    if ident.master_port is None or cfg.secret is None:
        raise RuntimeError("the gloo bench worker runs under `procgroup run`, which sets MASTER_PORT and the secret")
    ours = TCPStore(host, ident.master_port, secret=cfg.secret.encode(), timeout=timeout)
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

    from ..config import RuntimeConfig

    td = datetime.timedelta(seconds=ns.timeout)
    if RuntimeConfig.load().store_hosted:
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
