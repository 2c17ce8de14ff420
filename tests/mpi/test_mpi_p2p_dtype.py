"""backend="mpi": a point-to-point dtype mismatch is an error on the receiver (issue 11 item 15)."""

from __future__ import annotations

import re

import pytest


@pytest.mark.timeout(120)
def test_p2p_dtype_mismatch_under_mpi(flavour):
    """float32 sent, int32 received: ConfigError on the receiver in milliseconds, through MPI's own tags (the
    engine) and the transport's envelopes (a tag too big for MPI); the same dtype still gets its values."""
    r = flavour.run(2, "p2p_dtype", timeout=100, env={"PROCGROUP_TIMEOUT": "20"})
    ctx = r.report()
    assert not r.timed_out and r.returncode == 0, ctx
    assert not r.leftovers, ctx
    for rank in (0, 1):
        assert f"rank {rank}: p2p dtype ok" in r.stdout, ctx
    times = [float(x) for x in re.findall(r"mismatch raised in ([\d.]+) ms", r.stdout)]
    assert len(times) == 2 and max(times) < 5000, ctx
