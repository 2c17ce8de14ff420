"""procgroup's benchmark worker: ``procgroup run --standalone --nproc-per-node N -m procgroup.bench.worker --out F``.

With ``--backend mpi`` it runs under ``mpirun -np N`` instead (see ``procgroup bench --backend mpi``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import procgroup as dist

from ..config import RuntimeConfig
from ._common import argv_list, drive, worker_parser
from .cases import TorchStyleAdapter


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = worker_parser("procgroup.bench.worker").parse_args(argv_list(argv))
    dist.init_process_group(backend=ns.backend, timeout=ns.timeout)
    try:
        a = TorchStyleAdapter(ns.name, dist)
        info = {"procgroup": dist.__version__, "backend": ns.backend}
        if ns.backend == "mpi":
            from mpi4py import MPI  # already imported (and initialized) by the backend

            info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        else:
            info["transport"] = RuntimeConfig.load().transport
        return drive(a, ns, info)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
