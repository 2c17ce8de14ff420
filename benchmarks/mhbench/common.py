"""Shared paths, Open MPI variants and help text of the multi-host benchmark (see benchmarks/multihost.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
SCRIPT = HERE / "multihost.py"  # the entry point; also the worker and the watchdog
REPO = HERE.parent
SRC = REPO / "src"
INFRA = REPO / "infra"
DEFAULT_OUT = HERE / "results" / "multihost"
sys.path.insert(0, str(SRC))  # run from a checkout without installing: the checkout's procgroup

SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

#: Open MPI variants.  Every one adds BASE_MCA (inter-host traffic over the tcp btl only).
BASE_MCA = [("pml", "ob1"), ("btl", "tcp,vader,self"), ("btl_tcp_if_include", "eth0"), ("oob_tcp_if_include", "eth0")]
MPI_CONFIGS: Dict[str, dict] = {
    "default": {
        "mca": [],
        "about": "stock Open MPI settings (tuned's decision rules; ranks bound to cores, busy-polling)",
    },
    "yield": {
        "mca": [("mpi_yield_when_idle", "1")],
        "about": "+ mpi_yield_when_idle=1: what Open MPI does by itself when it knows a node is "
        "oversubscribed (here 6 ranks share 2 CPUs, which mpirun cannot see)",
    },
    "ring": {
        "mca": [
            ("mpi_yield_when_idle", "1"),
            ("coll_tuned_use_dynamic_rules", "1"),
            ("coll_tuned_allreduce_algorithm", "4"),
        ],
        "about": "+ yield + tuned allreduce algorithm 4 (ring): the fastest Open MPI variant found "
        "for 64 MiB on these hosts",
    },
}
DEFAULT_MPI_CONFIGS = "default,yield,ring"

EPILOG = (
    """\
Open MPI variants (--mpi-configs, comma-separated; all with --mca pml ob1 --mca btl tcp,vader,self
--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0):
"""
    + "\n".join(f"  {k:<8} {v['about']}" for k, v in MPI_CONFIGS.items())
    + """

Needs root (network namespaces), ip/nsenter/unshare, Open MPI's mpirun and mpi4py built against it
(without those, --mpi-configs none measures procgroup alone).  About 35 s per round at 64 MiB with
the three MPI variants on the 2-CPU dev VM.
"""
)
