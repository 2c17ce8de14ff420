"""tools/soak.py for ~4 s at 4 ranks through the real launcher: every result right, a summary for every rank.

4 s (it ran 10 s, RSS every 2 s) still gives about 1,300 checked operations (at least 50 are required), every
op kind, and 5-6 RSS samples per rank (RSS every 1 s; at least 3 are required).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .harness import ROOT

SOAK = ROOT / "tools" / "soak.py"


@pytest.mark.timeout(150)
def test_soak_smoke() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_RUN_ID", "TORCHELASTIC_RUN_ID")
    }
    p = subprocess.run(
        [sys.executable, str(SOAK), "--duration", "4", "--seed", "7", "--rss-interval", "1", "--progress", "0"],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    m = re.search(r"SOAK SUMMARY ops=(\d+) .* wrong=(\d+) ", out)
    assert m, out
    assert int(m.group(1)) > 50 and int(m.group(2)) == 0, out
    assert "WRONG" not in out, out
    for r in range(4):
        assert re.search(rf"SOAK RSS rank {r}: start=[\d.]+ MiB .* end=[\d.]+ max=[\d.]+ growth=", out), out
    js = json.loads(re.search(r"SOAK JSON (.*)$", out, re.M).group(1))
    assert js["wrong"] == 0 and len(js["rss"]) == 4 and all(row["samples"] >= 3 for row in js["rss"]), out
    # every op kind was drawn
    assert set(js["by_op"]) == {
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "gather",
        "scatter",
        "barrier",
        "send_recv",
    }, js["by_op"]
