"""The environment and command lines of the benchmark's worker runs (shared by the bench and its startup part)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

__all__ = ["PKG_PARENT", "child_env", "mpirun_cmd"]

#: the directory holding the procgroup package this process imported: the workers import the same one
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["procgroup"].__file__ or "")))


def child_env(extra: Optional[dict] = None) -> dict:
    """This environment for a worker run: the same procgroup first on PYTHONPATH, no enclosing job's identity."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = PKG_PARENT + (os.pathsep + pp if pp else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # a worker inherits nothing that would make it think it is a rank of an enclosing job
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PROCGROUP_RUN_ID",
        "PROCGROUP_STORE_HOSTED",
        "PROCGROUP_SECRET",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "SLURM_PROCID",
    ):
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def mpirun_cmd(n: int, *exported: str) -> list[str]:
    """``mpirun`` of ``n`` local ranks (root allowed, oversubscribed), exporting PYTHONPATH and ``exported``."""
    cmd = [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n)]
    for var in ("PYTHONPATH", *exported):
        cmd += ["-x", var]
    return cmd
