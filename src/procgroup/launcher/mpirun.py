"""``mpirun -npernode 1 procgroup run ...``: one agent per node of an MPI job.

Without this, each agent under ``mpirun -n N`` took itself for a one-node job and started its own world:
N independent jobs of ``--nproc-per-node`` workers each, every one "succeeded", none was the job the user
asked for.  :func:`detect_mpirun_agents` reads the MPI launcher's variables through
:func:`procgroup.identity.detect_identity` (pure):

==============  ===============================================================
node rank       the agent's MPI rank (``OMPI_COMM_WORLD_RANK`` / ``PMI_RANK``)
nnodes          the MPI job's size (``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE``)
master          ``MASTER_ADDR``/``MASTER_PORT`` when exported (``mpirun -x``), else what
                the identity derives: 127.0.0.1 when every agent is on this host, Open
                MPI's mpirun host otherwise (rank 0's by default), the port from the
                MPI job id
==============  ===============================================================

Several agents on one host are several "nodes" of the job (each starts its own workers), which is what
``mpirun -n 2`` on one machine means.  When the agents span hosts and no host for agent 0 is known (MPICH's
Hydra exports none), :class:`ConfigError` says what to pass.  Explicit ``--nnodes``/``--node-rank`` turn
the detection off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import ENV, MPICH, OPENMPI
from ..errors import ConfigError
from ..identity import detect_identity

__all__ = ["MpirunAgents", "detect_mpirun_agents"]


@dataclass(frozen=True)
class MpirunAgents:
    """What the agents of one MPI job agree on without talking."""

    launcher: str  # "mpirun (Open MPI)" or "mpiexec (MPICH/Hydra)"
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    notes: tuple[str, ...]


def detect_mpirun_agents(environ: Mapping[str, str]) -> Optional[MpirunAgents]:
    """The MPI job this agent is one process of, when it has several; else None.

    None also when the environment names the agent's own rank (``RANK``/``WORLD_SIZE``: not an MPI
    launcher's process) or the MPI job has one process.  Raises :class:`ConfigError` when the agents span
    hosts and agent 0's host cannot be derived.
    """
    if environ.get(OPENMPI.RANK) is None and environ.get(MPICH.RANK) is None:
        return None
    try:
        ident = detect_identity(environ)
    except ConfigError:
        return None  # not a launcher procgroup knows: the flags decide, as before
    if ident.source not in ("openmpi", "mpich") or ident.world_size < 2:
        return None
    launcher = "mpirun (Open MPI)" if ident.source == "openmpi" else "mpiexec (MPICH/Hydra)"
    rank_var, size_var = (OPENMPI.RANK, OPENMPI.SIZE) if ident.source == "openmpi" else (MPICH.RANK, MPICH.SIZE)
    if not ident.master_addr or not ident.master_port:
        raise ConfigError(
            f"procgroup run under {launcher} as agent {ident.rank} of {ident.world_size} (from {rank_var}/"
            f"{size_var}): the agents span hosts and agent 0's host is not known here; export it to every agent "
            f"(mpirun -x {ENV.MASTER_ADDR}=<host of rank 0>, or mpiexec -genv {ENV.MASTER_ADDR} <host>), or pass "
            "--master-addr <host> (and --master-port), or --nnodes/--node-rank yourself"
        )
    notes = (
        f"node rank {ident.rank} of {ident.world_size} agents from {launcher}'s {rank_var}={ident.rank}, "
        f"{size_var}={ident.world_size} (pass --nnodes/--node-rank to choose yourself)",
        *(n for n in ident.derived if n.startswith(("MASTER_ADDR", "MASTER_PORT"))),
    )
    return MpirunAgents(
        launcher=launcher,
        node_rank=ident.rank,
        nnodes=ident.world_size,
        master_addr=ident.master_addr,
        master_port=int(ident.master_port),
        notes=notes,
    )
