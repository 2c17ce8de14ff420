"""Per-process mode on this one machine: ``mpirun -np 4`` and ``mpiexec.mpich -n 4``.

Each rank runs tests/infra/scripts/allreduce_worker.py, which calls ``init_process_group()`` with
no arguments: procgroup must read the rank, world size and local rank from Open MPI's / MPICH's
variables and derive the rendezvous address (127.0.0.1: every rank is local).  Needs no root and
no test infrastructure, only the launchers (skipped where they are missing).  Every rank's line,
the exit status, and the absence of leftover processes are checked.  mpi4py is hidden from the
ranks (tests/infra/scripts/hide_mpi4py), so the result does not depend on whether it is installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from ..infra.launch import check_world, clean_env, launch, new_tag, worker_cmd

pytestmark = pytest.mark.timeout(180, method="signal")

NP = 4
LAUNCH_TIMEOUT = 120.0


def _need(binary: str, flavour: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} not found: install {flavour} (Debian: infra/install_debian.sh)")
    return path


def test_openmpi_mpirun_single_host():
    mpirun = _need("mpirun", "Open MPI (openmpi-bin)")
    v = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in v.stdout + v.stderr:
        pytest.skip(f"mpirun is not Open MPI's ({(v.stdout + v.stderr).strip().splitlines()[:1]})")
    tag = new_tag()
    # --oversubscribe: 4 ranks may exceed the cores; --allow-run-as-root: harmless when not root
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(NP), *worker_cmd(sys.executable, tag, NP, NP)]
    r = launch(cmd, env=clean_env(hide_mpi4py=True), timeout=LAUNCH_TIMEOUT, tag=tag)
    check_world(r, NP, NP, [socket.gethostname()])


def test_mpich_mpiexec_single_host():
    mpiexec = _need("mpiexec.mpich", "MPICH (mpich)")
    tag = new_tag()
    # Hydra exports no job id, so procgroup's port would be the fixed default 29500; another job on
    # this shared machine may hold it, so give this job its own (an env var, still no init arguments).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [mpiexec, "-n", str(NP), *worker_cmd(sys.executable, tag, NP, NP)]
    r = launch(cmd, env=clean_env({"MASTER_PORT": str(port)}, hide_mpi4py=True), timeout=LAUNCH_TIMEOUT, tag=tag)
    check_world(r, NP, NP, [socket.gethostname()])
