"""Big-slot collectives (issue 14 item 1) with real processes on one host.

Correct closed-form results for every big-slot collective at sizes above the
arena and above one slot (several double-buffered steps), in the world and
in a subgroup; a peer killed mid-collective fails the others fast; a rank
blocked on a big-slot collective sleeps; mismatched collectives are named by
the watchdog; nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from procgroup.config import SHM_DIR
from procgroup.netutil import free_port

from .harness import ROOT, Result, collect, report, worker_env

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import os, sys, time, numpy as np, procgroup as dist
from procgroup.state import default_group
dist.init_process_group("cpu")
r, p = dist.get_rank(), dist.get_world_size()
pg = default_group()
assert pg.arena() is not None and pg.arena().big is not None, "no big slots"
assert pg.arena().big.slot_bytes == int(os.environ["PROCGROUP_SHM_BIG_SLOT"])
"""

OPS = (
    PRELUDE
    + """
from procgroup.algorithms import bigarena as B
from procgroup.algorithms import select
calls = []
for name in ("allreduce_big", "reduce_big", "reduce_scatter_big", "bcast_big", "allgather_big"):
    f = getattr(select, name)
    setattr(select, name, (lambda f, name: lambda *a: calls.append(name) or f(*a))(f, name))
def check(groups):
    for g in groups:
        gr, gp = dist.get_rank(g), dist.get_world_size(g)
        for n in (8193, 100_003, 300_001):
            for dt in (np.float32, np.int64, np.float16):
                a = (np.arange(n) % 97 * (gr + 1)).astype(dt)
                dist.all_reduce(a, group=g)
                assert np.array_equal(a, (np.arange(n) % 97 * (gp * (gp + 1) // 2)).astype(dt)), (n, dt)
            a = np.full(n, gr + 1, np.int32)
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=g)
            assert (a == gp).all()
            for root in range(gp):
                src = dist.get_global_rank(g, root) if g is not None else root
                b = np.arange(n, dtype=np.float64) + root if gr == root else np.zeros(n)
                dist.broadcast(b, src=src, group=g)
                assert np.array_equal(b, np.arange(n) + root), (n, root)
                c = np.full(n, gr + 2, np.int64)
                dist.reduce(c, dst=src, op=dist.ReduceOp.PRODUCT, group=g)
                want = np.prod(np.arange(2, gp + 2)) if gr == root else gr + 2
                assert (c == want).all(), (n, root)
            out = np.empty(gp * n, np.int16)
            dist.all_gather_into_tensor(out, np.full(n, gr, np.int16), group=g)
            assert np.array_equal(out, np.repeat(np.arange(gp), n).astype(np.int16))
            o = np.empty(n, np.float64)
            dist.reduce_scatter_tensor(o, np.arange(gp * n, dtype=np.float64), group=g)
            assert np.array_equal(o, gp * np.arange(gr * n, (gr + 1) * n)), n
sub = dist.new_group(list(range(p - 1))) if p > 2 else None
check([None] + ([sub] if sub is not None and r < p - 1 else []))
want = {"allreduce_big", "reduce_big", "reduce_scatter_big", "bcast_big", "allgather_big"}
if p == 2 and pg.arena().reader() is not None:  # a pair reads the other's part instead (select.ONECOPY_MIN_PAIR)
    want.discard("allgather_big")
assert set(calls) == want, calls
print(f"rank {r} ok", flush=True)
dist.destroy_process_group()
"""
)

KILLED = (
    PRELUDE
    + """
a = np.ones(1 << 20, np.float32)
dist.all_reduce(a)
if r == 1:
    os._exit(7)  # dies between collectives; the others block in the next one
t0 = time.monotonic()
try:
    dist.all_reduce(a)
except Exception as e:
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(3)
print("no error", flush=True)
"""
)

SLEEPER = (
    PRELUDE
    + """
a = np.ones(1 << 18, np.float32)
dist.all_reduce(a)
if r == 0:
    time.sleep(2.0)
t0, c0 = time.monotonic(), time.process_time()
dist.broadcast(a, src=0)
print(f"rank {r} waited {time.monotonic() - t0:.2f}s cpu {time.process_time() - c0:.3f}s", flush=True)
dist.destroy_process_group()
"""
)

MISMATCH = (
    PRELUDE
    + """
a = np.ones(1 << 18, np.float32)
dist.all_reduce(a)
t0 = time.monotonic()
try:
    if r == 0:
        dist.all_reduce(a)
    else:
        dist.broadcast(a, src=0)
except Exception as e:
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(3)
print("no error", flush=True)
"""
)


def _run(
    tmp_path: Path, script: str, n: int, env: Optional[Dict[str, str]] = None, timeout: float = 90
) -> List[Result]:
    f = tmp_path / "worker.py"
    f.write_text(script)
    port = free_port()
    job = f"big-{os.getpid()}-{port}"
    extra = {"PROCGROUP_SHM_BIG_SLOT": "65536", "PROCGROUP_RUN_ID": job, **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, str(f)],
            env=worker_env(r, n, port, "bigarena-secret", extra),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    res = collect(procs, timeout)
    leaked = [x for x in os.listdir(SHM_DIR) if job in x]
    assert not leaked, f"/dev/shm segments left behind: {leaked}"
    return res


@pytest.mark.parametrize("n", [2, 3, 4])
def test_big_slot_collectives_give_closed_form_results(tmp_path: Path, n: int) -> None:
    res = _run(tmp_path, OPS, n)
    assert all(r.returncode == 0 for r in res), report(res)
    assert all(f"rank {r.rank} ok" in r.stdout for r in res), report(res)


def test_a_peer_killed_between_collectives_fails_the_others_fast(tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = _run(tmp_path, KILLED, 3, env={"PROCGROUP_TIMEOUT": "60"})
    took = time.monotonic() - t0
    assert res[1].returncode == 7
    for r in (res[0], res[2]):
        assert r.returncode == 3 and "rank 1" in r.stdout, report(res)
    assert took < 30, (took, report(res))


def test_a_rank_blocked_on_a_big_slot_collective_sleeps(tmp_path: Path) -> None:
    res = _run(tmp_path, SLEEPER, 2)
    assert all(r.returncode == 0 for r in res), report(res)
    line = res[1].stdout.strip().splitlines()[-1]
    waited, cpu = float(line.split()[3][:-1]), float(line.split()[5][:-1])
    assert waited > 1.5, line
    assert cpu < 0.1 * waited, line  # well under 10% of a core while blocked
    print(line)


def test_mismatched_collectives_never_complete_and_are_named(tmp_path: Path) -> None:
    res = _run(tmp_path, MISMATCH, 2, env={"PROCGROUP_TIMEOUT": "6"})
    text = report(res)
    assert all(r.returncode == 3 for r in res), text
    assert "all_reduce" in text and "broadcast" in text, text
