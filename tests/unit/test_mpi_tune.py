"""backend="mpi" under Open MPI: libnbc's MPI_Iallreduce algorithm chosen before MPI_Init (world.tune_openmpi).

No MPI here: the function only edits an environment mapping; tests/mpi/test_mpi_backend.py checks the real job.
"""

from __future__ import annotations

from procgroup.backends.mpi.world import IALLREDUCE_DEFAULT, tune_openmpi
from procgroup.config import OPENMPI


def test_sets_recursive_doubling_when_the_job_did_not():
    env: dict = {}
    assert tune_openmpi(env, started=False)
    assert env == {OPENMPI.IALLREDUCE_ALGORITHM: IALLREDUCE_DEFAULT} and IALLREDUCE_DEFAULT == "4"


def test_the_jobs_own_choice_wins():
    for value in ("0", "2", "1"):
        env = {OPENMPI.IALLREDUCE_ALGORITHM: value}
        assert not tune_openmpi(env, started=False)
        assert env[OPENMPI.IALLREDUCE_ALGORITHM] == value


def test_nothing_once_mpi_started():
    env: dict = {}
    assert not tune_openmpi(env, started=True)
    assert env == {}
