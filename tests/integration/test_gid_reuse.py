"""Issue 11 item 4: group ids are reused, so create/destroy cycles of new_group never run out of ids."""

from __future__ import annotations

import re

import pytest

from .harness import run_world

pytestmark = pytest.mark.timeout(150)


def test_twenty_thousand_new_group_cycles_past_the_id_limit():
    """20,000 new_group/destroy cycles at N=2 (the old code failed at 16,384) with a long-lived group alive."""
    res = run_world(2, "gid_cycles", ["20000"], timeout=140)
    for r in res:
        assert "gid_cycles ok" in r.stdout, r.stdout
    print(re.findall(r"rank \d: gid_cycles ok .*", res[0].stdout))


def test_reused_id_starts_clean():
    """A reused id is not broken by its last incarnation's record and its collectives agree."""
    res = run_world(2, "gid_reuse_clean", timeout=60)
    assert all("gid_reuse_clean ok" in r.stdout for r in res)
