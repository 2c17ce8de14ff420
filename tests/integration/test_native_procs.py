"""Real processes over shared memory, with the arena's compiled fast path on and off (``PROCGROUP_NATIVE``).

Every collective against numpy references, the idle-wait CPU bound, the path each rank really ran, every
fused op and dtype bit for bit, and a dead peer named while a rank waits in the C path's spin and sleep.  The
native leg skips where the extension was not built.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procgroup.netutil import free_port
from procgroup.transport.shm import arena as shm_arena

from .harness import ROOT, collect, kill_all, report, run_world, worker_env

needs_native = pytest.mark.skipif(
    not shm_arena.native_available(), reason="the compiled arena extension was not built (no C compiler?)"
)
PATHS = [pytest.param("1", id="native", marks=needs_native), pytest.param("0", id="python")]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.timeout(240)
def test_every_collective_on_both_paths(ws: int, native: str) -> None:
    env = {"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_NATIVE": native}
    results = run_world(ws, "collectives", env=env, timeout=220)
    for r in results:
        assert re.search(r"rank \d+: \d+ checks passed", r.stdout), report(results)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.timeout(90)
def test_a_waiting_rank_does_not_burn_a_core_on_either_path(native: str) -> None:
    results = run_world(3, "idle_wait", ["2"], env={"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_NATIVE": native})
    for r in results[1:]:
        m = re.search(r"waited ([\d.]+)s cpu ([\d.]+)s", r.stdout)
        assert m, report(results)
        waited, cpu = float(m.group(1)), float(m.group(2))
        assert waited > 1.5
        assert cpu < 0.1 * waited, f"rank {r.rank} used {cpu:.3f}s of CPU while waiting {waited:.2f}s"


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import procgroup as dist
    from procgroup.state import default_group

    mode = sys.argv[1]
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    a = default_group().arena()
    print(f"rank {r}: native={a.native}", flush=True)
    if mode == "ops":
        n_checks = 0
        for dt in ("float32", "float64", "int32", "int64"):
            for n in (0, 1, 7, 1001, 8192 // np.dtype(dt).itemsize):
                for op in ("SUM", "PRODUCT", "MIN", "MAX"):
                    xs = [((np.arange(n) * (q + 3)) % 11 - 5).astype(dt) for q in range(ws)]
                    want = xs[0].copy()
                    for y in xs[1:]:
                        want = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[op](
                            want, y
                        )
                    x = xs[r].copy()
                    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                    assert x.tobytes() == want.tobytes(), (op, dt, n, x, want)
                    for root in range(ws):
                        y = xs[r].copy()
                        dist.reduce(y, dst=root, op=getattr(dist.ReduceOp, op))
                        assert y.tobytes() == (want if r == root else xs[r]).tobytes(), (op, dt, n, root)
                    n_checks += 1 + ws
        print(f"rank {r}: {n_checks} fused checks passed", flush=True)
    elif mode == "die":
        dist.barrier()
        if r == 1:
            os._exit(3)
        t0 = time.monotonic()
        try:
            dist.all_reduce(np.ones(1, np.float32))
        except Exception as e:
            print(f"rank {r}: {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
            os._exit(0)
        print(f"rank {r}: all_reduce returned", flush=True)
        os._exit(1)
    dist.destroy_process_group()
    """
)


def _spawn(tmp_path: Path, ws: int, mode: str, native: str) -> list:
    script = tmp_path / "native_worker.py"
    script.write_text(_WORKER)
    port = free_port()
    extra = {"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_NATIVE": native, "PROCGROUP_TIMEOUT": "20"}
    return [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            env=worker_env(r, ws, port, "ab" * 16, extra),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(ws)
    ]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.timeout(120)
def test_the_fused_reductions_in_real_processes(tmp_path: Path, ws: int, native: str) -> None:
    procs = _spawn(tmp_path, ws, "ops", native)
    results = collect(procs, 100)
    assert all(r.returncode == 0 for r in results), report(results)
    for r in results:
        assert f"native={native == '1'}" in r.stdout, report(results)  # each rank ran the path asked for
        assert "fused checks passed" in r.stdout, report(results)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.timeout(90)
def test_a_dead_peer_is_named_while_a_rank_waits_in_the_arena(tmp_path: Path, native: str) -> None:
    t0 = time.monotonic()
    procs = _spawn(tmp_path, 2, "die", native)
    try:
        results = collect(procs, 60)
    finally:
        kill_all(procs)
    r0 = results[0]
    assert r0.returncode == 0, report(results)
    m = re.search(r"rank 0: (\w+) after ([\d.]+)s: (.*)", r0.stdout)
    assert m, report(results)
    assert m.group(1) == "PeerFailureError" and "rank 1 (pid" in m.group(3), report(results)
    assert float(m.group(2)) < 15, report(results)  # well before the 20 s deadline
    assert time.monotonic() - t0 < 60
