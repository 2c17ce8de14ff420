"""The mpi backend ("mpi"): procgroup's API and diagnostics over the MPI library that runs the job (mpi4py).

Start the program with ``mpirun``/``mpiexec`` (Open MPI, MPICH) or ``srun --mpi=pmix``/``pmi2`` and call
``init_process_group("mpi")``.  The rendezvous, the failure records, the roll call and mismatch detection go
through procgroup's store exactly as on the cpu backend; MPI carries the data: MPI's nonblocking
collectives where they compute what procgroup computes (:mod:`.engine`), procgroup's own algorithms over
MPI point-to-point (:mod:`.transport`) for the rest.  mpi4py is imported (which initializes MPI) only when a
world forms, never when procgroup is imported.  Details: ``docs/mpi.md``.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from ...process_group import World
from ..base import Backend, WorldSpec, register

__all__ = ["MpiBackend", "INSTALL_HINT"]

INSTALL_HINT = (
    "pip install 'procgroup[mpi]' (mpi4py) and an MPI library: apt-get install openmpi-bin (or mpich), "
    "then start the ranks with mpirun/mpiexec or srun --mpi=pmix"
)


class MpiBackend(Backend):
    """Collectives of the MPI library under mpirun/srun, with procgroup's deadlines and failure reports."""

    names = ("mpi",)

    def __init__(self) -> None:
        self._reason: Optional[str] = None
        self._checked = False

    def unavailable_reason(self) -> Optional[str]:
        """None when mpi4py is installed, else why not (checked once, without starting MPI).

        Whether mpi4py can load an MPI library shows only when it starts MPI: :meth:`prepare` raises
        ConfigError naming the library and the fix when it cannot.
        """
        if not self._checked:
            if importlib.util.find_spec("mpi4py") is None:
                self._reason = "backend='mpi' needs mpi4py, which is not installed"
            self._checked = True
        return self._reason

    def install_hint(self) -> str:
        """What to install for the mpi backend."""
        return INSTALL_HINT

    def prepare(self) -> None:
        """Import mpi4py, which initializes MPI, before the rendezvous (ConfigError when it cannot load).

        ``MPI_Init`` waits for every rank and keeps the GIL: were rank 0 to enter it after starting the store
        (as in ``create_world``), its store thread could not answer the others, still connecting, and
        neither side would get on until the deadline.
        """
        from .world import import_mpi, refuse_agent_worker

        refuse_agent_worker()
        import_mpi()

    def create_world(self, spec: WorldSpec) -> World:
        """Rendezvous through ``spec.store``, then build MPI's communicators (see :func:`.world.build_world`)."""
        from .world import build_world

        return build_world(spec)


register(MpiBackend())
