"""Transport.unmatched (issue 11 item 15): every transport names an arrived, unreceived message whose tag
differs from a receive's only in the masked bits (the p2p dtype code), and nothing else."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from procgroup.process_group import P2P_CODE_MASK, P2P_CODE_SHIFT, p2p_tag
from procgroup.transport import ANY_SOURCE, Transport
from tests.unit.test_transport_conformance import dl, kind, run_ranks, world  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(120)

SENT = p2p_tag(3, 5, code=12)  # float32, user tag 5 of group 3
AS_INT32 = p2p_tag(3, 5, code=6)  # the same tag received as int32
SENTINEL = p2p_tag(3, 6)


@pytest.mark.parametrize("nbytes", [16, 2 << 20], ids=["small", "large"])
def test_unmatched_names_a_message_that_differs_only_in_the_code(world: Any, nbytes: int) -> None:  # noqa: F811
    ts = world(2)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            big = np.ones(nbytes, np.uint8)
            req = t.isend(1, SENT, big)
            t.send(1, SENTINEL, b"x", dl())
            req.wait(dl())  # completes once rank 1 receives it with the right tag
            return None
        out = bytearray(1)
        t.recv(0, SENTINEL, out, dl())  # everything sent before it has arrived
        seen = {
            "from 0": t.unmatched(0, AS_INT32, P2P_CODE_MASK),
            "any": t.unmatched(ANY_SOURCE, AS_INT32, P2P_CODE_MASK),
            "same tag": t.unmatched(0, SENT, P2P_CODE_MASK),  # not a mismatch: it would match
            "other user tag": t.unmatched(0, p2p_tag(3, 4, code=6), P2P_CODE_MASK),
            "other group": t.unmatched(0, p2p_tag(2, 5, code=6), P2P_CODE_MASK),
            "no mask": t.unmatched(0, AS_INT32, 0),
        }
        buf = np.empty(nbytes, np.uint8)
        t.recv(0, SENT, buf, dl())
        seen["after recv"] = t.unmatched(0, AS_INT32, P2P_CODE_MASK)
        return seen

    _, seen = run_ranks(ts, body)
    assert seen["from 0"] == (0, SENT) and seen["any"] == (0, SENT)
    assert (SENT & P2P_CODE_MASK) >> P2P_CODE_SHIFT == 12
    for k in ("same tag", "other user tag", "other group", "no mask", "after recv"):
        assert seen[k] is None, (k, seen)


def test_unmatched_on_a_fresh_transport_is_none(world: Any) -> None:  # noqa: F811
    ts = world(2)
    assert all(t.unmatched(ANY_SOURCE, AS_INT32, P2P_CODE_MASK) is None for t in ts)
    assert ts[0].unmatched(1, AS_INT32, P2P_CODE_MASK) is None
