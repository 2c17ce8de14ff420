"""procgroup's benchmark worker: ``procgroup run --standalone --nproc-per-node N -m procgroup.bench.worker --out F``."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import procgroup as dist

from ..config import RuntimeConfig
from ._common import argv_list, drive, worker_parser
from .cases import TorchStyleAdapter


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = worker_parser("procgroup.bench.worker").parse_args(argv_list(argv))
    dist.init_process_group(timeout=ns.timeout)
    try:
        a = TorchStyleAdapter("procgroup", dist)
        info = {"procgroup": dist.__version__, "transport": RuntimeConfig.load().transport}
        return drive(a, ns, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
