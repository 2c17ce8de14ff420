"""backend="mpi": a group that gets a destroyed group's id builds its own communicator (issue 11 item 4)."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(180)
def test_wrapped_group_id_gets_its_own_communicator(flavour):
    """N=3, 20 times: group [0, 1] (used, then destroyed), then groups [1, 2] and [0, 1, 2]: each gets a fresh
    id and its own communicator, and its all_reduce gives the sum over its own ranks."""
    r = flavour.run(3, "gid_wrap", timeout=160, env={"PROCGROUP_TIMEOUT": "20"})
    ctx = r.report()
    assert not r.timed_out and r.returncode == 0, ctx
    assert not r.leftovers, ctx
    for rank in (0, 1, 2):
        assert f"rank {rank}: gid wrap ok" in r.stdout, ctx
