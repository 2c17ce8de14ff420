"""Launchers for the mpi backend's tests: Open MPI's mpirun and MPICH's mpiexec, each skipped with a reason.

mpi4py 4 carries one extension per MPI ABI and picks one at import (``MPI4PY_MPIABI``).  Debian's MPICH
runtime (libmpich12) installs ``libmpich.so.12`` but not the ``libmpi.so.12`` name that mpi4py's MPICH
extension links against (that link comes with libmpich-dev), so the MPICH flavour points
``LD_LIBRARY_PATH`` at a directory holding that one symlink.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from ..infra.launch import REPO, Launch, clean_env, launch, new_tag


@dataclass
class Flavour:
    """One MPI: how to start N ranks of ``python -m tests.mpi.workers`` under it."""

    name: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)

    def run(
        self, n: int, *args: str, timeout: float = 120.0, mpi_args: tuple = (), env: Optional[Dict[str, str]] = None
    ) -> Launch:
        """Start ``n`` ranks of the worker function ``args[0]`` (``env``: more variables for them)."""
        tag = new_tag()
        cmd = [*self.argv, *mpi_args, "-n", str(n), sys.executable, "-m", "tests.mpi.workers", *args, tag]
        full = clean_env({**self.env, **(env or {})})
        full["PYTHONPATH"] = os.pathsep.join([full["PYTHONPATH"], str(REPO)])
        full.setdefault("PROCGROUP_TIMEOUT", "60")
        return launch(cmd, env=full, timeout=timeout, tag=tag)


def _mpi4py_or_skip() -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install 'procgroup[mpi]'")


def openmpi() -> Optional[Flavour]:
    path = shutil.which("mpirun.openmpi") or shutil.which("mpirun")
    if path is None:
        return None
    v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in v.stdout + v.stderr and "OpenRTE" not in v.stdout + v.stderr:
        return None
    return Flavour("openmpi", [path, "--allow-run-as-root", "--oversubscribe"], {"MPI4PY_MPIABI": "openmpi"})


def mpich(workdir: Path) -> Optional[Flavour]:
    path = shutil.which("mpiexec.mpich")
    if path is None:
        return None
    env = {"MPI4PY_MPIABI": "mpich"}
    libs = sorted(glob.glob("/usr/lib/*/libmpich.so.12")) + sorted(glob.glob("/usr/lib/libmpich.so.12"))
    if libs and not any(glob.glob(f"{os.path.dirname(lib)}/libmpi.so.12") for lib in libs):
        link = workdir / "libmpi.so.12"
        if not link.exists():
            link.symlink_to(libs[0])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(workdir), os.environ.get("LD_LIBRARY_PATH", "")] if p)
    return Flavour("mpich", [path], env)


@pytest.fixture(scope="session", params=["openmpi", "mpich"])
def flavour(request, tmp_path_factory) -> Flavour:
    """Each test that takes it runs under Open MPI and under MPICH (skipped where one is missing)."""
    _mpi4py_or_skip()
    if request.param == "openmpi":
        f = openmpi()
        if f is None:
            pytest.skip("Open MPI's mpirun not found: apt-get install openmpi-bin")
    else:
        f = mpich(tmp_path_factory.mktemp("mpichlib"))
        if f is None:
            pytest.skip("MPICH's mpiexec.mpich not found: apt-get install mpich")
    return f


@pytest.fixture(scope="session")
def ompi() -> Flavour:
    """Open MPI only (fault tests use its mpirun options)."""
    _mpi4py_or_skip()
    f = openmpi()
    if f is None:
        pytest.skip("Open MPI's mpirun not found: apt-get install openmpi-bin")
    return f


# the network-namespace hosts (infra_guard, netns_hosts, slurm_cluster) come from tests/conftest.py, one
# definition for tests/infra and tests/mpi, so one pytest session brings them up once and holds the lock once
