"""Non-contiguous outputs (strided numpy views, transposed torch tensors) work as with torch's gloo (issue 10 item 7).

Each rank runs every collective that writes a user tensor, blocking and async, into a strided view, and checks the
closed-form result landed in the user's own object (and nowhere else in its base).
"""

from __future__ import annotations

import pytest

from .harness import run_world


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.timeout(150)
def test_noncontiguous_outputs_are_written_back(ws):
    results = run_world(ws, "noncontig", timeout=140)
    assert all("noncontig ok" in r.stdout for r in results)
