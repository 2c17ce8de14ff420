"""The big slots' compiled syncs and fused copy-in + sync + reduce (``_native.Big``), in real processes.

Both paths (``PROCGROUP_NATIVE`` 1 and 0) against closed-form values: all_reduce and reduce (every root) for every
dtype and ReduceOp, at sizes just above the arena, odd, at ``DIRECT_MAX`` and at the slot (the fused one-sync paths
of all_reduce and of reduce) and past them (two syncs per step), a misaligned buffer (the C call refuses it, numpy
reduces), a rank that arrives late (the others' spin ends and they reduce after the doorbell sleep), broadcast and
all_gather on the compiled syncs; warm plans of all_reduce, reduce, broadcast, all_gather, reduce_scatter and
barrier (which call the compiled arena straight); and a peer that dies while the others wait in a big-slot sync. No
/dev/shm segment is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procgroup.config import SHM_DIR
from procgroup.netutil import free_port
from procgroup.transport.shm import arena as shm_arena

from .harness import ROOT, collect, kill_all, report, worker_env

needs_native = pytest.mark.skipif(
    not shm_arena.native_available(), reason="the compiled arena extension was not built (no C compiler?)"
)
PATHS = [pytest.param("1", id="native", marks=needs_native), pytest.param("0", id="python")]
SLOT = 256 << 10  # reduces up to it take the one-sync path at N=2 (REDUCE_DIRECT_READS), all_reduces up to DIRECT_MAX

_WORKER = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import procgroup as dist
    from procgroup.algorithms import bigarena as B
    from procgroup.state import default_group

    mode = sys.argv[1]
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    a = default_group().arena()
    big = None if a is None else a.big
    if ws > 1:
        assert big is not None and big.slot_bytes == 256 << 10, "no big slots"
        print(f"rank {r}: native={big.native}", flush=True)
    ops = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}

    def vals(q, n, dt):
        return ((np.arange(n) * (q + 3)) % 11 - 5).astype(dt)

    if mode == "ops":
        checks = 0
        for dt in ("float32", "float64", "int32", "int64", "float16", "uint8"):
            s = np.dtype(dt).itemsize
            edges = (B.DIRECT_MAX // s, B.DIRECT_MAX // s + 1, (256 << 10) // s, (256 << 10) // s + 1)
            for n in (32768 // s + 1, 40001) + edges:
                for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
                    if op == "AVG" and dt not in ("float32", "float64"):
                        continue
                    xs = [vals(q, n, dt) for q in range(ws)]
                    want = xs[0].copy()
                    for y in xs[1:]:
                        (ops["SUM"] if op == "AVG" else ops[op])(want, y, out=want)
                    if op == "AVG":
                        want /= ws
                    x = xs[r].copy()
                    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                    assert x.tobytes() == want.tobytes(), (op, dt, n)
                    for root in range(ws):
                        y = xs[r].copy()
                        dist.reduce(y, dst=root, op=getattr(dist.ReduceOp, op))
                        assert y.tobytes() == (want if r == root else xs[r]).tobytes(), (op, dt, n, root)
                    checks += 1 + ws
        # a float32 array one byte off its alignment: the compiled call refuses it, numpy reduces
        n = 20001
        raw = np.zeros(4 * n + 1, np.uint8)
        x = raw[1:].view(np.float32)
        assert not x.flags.aligned
        x[...] = vals(r, n, "float32")
        dist.all_reduce(x)
        assert np.array_equal(x, sum(vals(q, n, "float32") for q in range(ws)))
        # a late rank: the others' spin ends, they sleep on the doorbell and reduce after it
        for dt in ("float32", "int64"):
            x = vals(r, 40001, dt)
            if r == ws - 1:
                time.sleep(0.2)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            assert np.array_equal(x, np.max([vals(q, 40001, dt) for q in range(ws)], axis=0)), dt
            checks += 1
        # ... and a reduce's root waiting for a late member: member 0 or 1 as root did not copy its buffer into the
        # slots (nobody reads it), so its reduction after the sleep reads its own part from its buffer
        for root in range(ws):
            x = vals(r, 20001, "float32")
            if r == (root + 1) % ws:
                time.sleep(0.2)
            dist.reduce(x, dst=root)
            want = sum(vals(q, 20001, "float32") for q in range(ws)) if r == root else vals(r, 20001, "float32")
            assert np.array_equal(x, want), root
            checks += 1
        # an all_gather whose input is this rank's block of the output (its part stays in place), on time and late
        for n in (40001, 300001):
            for late in (0, 1):
                out = np.full(ws * n, -1, np.int32)
                mine = out[r * n : (r + 1) * n]
                mine[...] = np.arange(n, dtype=np.int32) * (r + 2)
                if late and r == ws - 1:
                    time.sleep(0.2)
                dist.all_gather_into_tensor(out, mine)
                want = np.concatenate([np.arange(n, dtype=np.int32) * (q + 2) for q in range(ws)])
                assert np.array_equal(out, want), (n, late)
                checks += 1
        for n in (40001, 300001):
            for root in range(ws):
                b = np.arange(n, dtype=np.float64) + root if r == root else np.zeros(n)
                dist.broadcast(b, src=root)
                assert np.array_equal(b, np.arange(n) + root), (n, root)
            out = np.empty(ws * n, np.int32)
            dist.all_gather_into_tensor(out, np.full(n, r, np.int32))
            assert np.array_equal(out, np.repeat(np.arange(ws), n)), n
            checks += ws + 1
        print(f"rank {r}: {checks} big-slot checks passed", flush=True)
    elif mode == "plans":
        # warm plans (a call shape's second call on) of the small collectives: on the compiled path they call the
        # arena's one-call methods straight; the general arena path's helper must not run then
        from procgroup import plans as P
        from procgroup.algorithms import arena as A

        P.PLAN_LIMIT = 1 << 20  # every shape here keeps its plan (the count below assumes no restart of the cache)

        general = []
        fused = A._fused
        A._fused = lambda *x: general.append(1) or fused(*x)
        checks = 0
        for dt in ("float32", "float64", "int32", "int64", "float16", "uint8"):
            s = np.dtype(dt).itemsize
            for n in (1, 7, 1001, 32768 // s):
                for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
                    if op == "AVG" and dt not in ("float32", "float64"):
                        continue
                    xs = [vals(q, n, dt) for q in range(ws)]
                    want = xs[0].copy()
                    for y in xs[1:]:
                        (ops["SUM"] if op == "AVG" else ops[op])(want, y, out=want)
                    if op == "AVG":
                        want /= ws
                    for _ in range(3):
                        x = xs[r].copy()
                        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                        assert x.tobytes() == want.tobytes(), (op, dt, n)
                        for root in range(ws):
                            y = xs[r].copy()
                            dist.reduce(y, dst=root, op=getattr(dist.ReduceOp, op))
                            assert y.tobytes() == (want if r == root else xs[r]).tobytes(), (op, dt, n, root)
                        checks += 1 + ws
                for _ in range(3):
                    out = np.full(ws * n, 99, dt)
                    dist.all_gather_into_tensor(out, vals(r, n, dt))
                    assert np.array_equal(out, np.concatenate([vals(q, n, dt) for q in range(ws)])), (dt, n)
                    checks += 1
                for root in range(ws):
                    for _ in range(3):
                        b = vals(root, n, dt) if r == root else np.zeros(n, dt)
                        dist.broadcast(b, src=root)
                        assert np.array_equal(b, vals(root, n, dt)), (dt, n, root)
                        checks += 1
        # reduce_scatter_tensor whose whole input fits a slot: the compiled block reduction once the plan is warm
        import procgroup.algorithms as ALG

        rs_general = []
        rs = ALG.reduce_scatter
        ALG.reduce_scatter = lambda *x: rs_general.append(1) or rs(*x)
        for dt in ("float32", "float64", "int32", "int64", "float16", "uint8"):
            s = np.dtype(dt).itemsize
            for n in (1, 7, 1001, 32768 // s // ws):
                for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
                    if op == "AVG" and dt not in ("float32", "float64"):
                        continue
                    xs = [vals(q, ws * n, dt) for q in range(ws)]
                    want = xs[0].copy()
                    for y in xs[1:]:
                        (ops["SUM"] if op == "AVG" else ops[op])(want, y, out=want)
                    if op == "AVG":
                        want /= ws
                    for i in range(3):
                        before = len(rs_general)
                        o = np.full(n, 99, dt)
                        dist.reduce_scatter_tensor(o, xs[r], op=getattr(dist.ReduceOp, op))
                        assert o.tobytes() == want[r * n : (r + 1) * n].tobytes(), (op, dt, n)
                        if i and ws > 1 and a.native and op != "AVG" and dt not in ("float16", "uint8"):
                            assert len(rs_general) == before, (op, dt, n)  # the warm plan's compiled call
                        checks += 1
        for _ in range(3):
            dist.barrier()
        raw = np.zeros(4 * 1001 + 1, np.uint8)  # misaligned: the compiled call refuses it, the general path runs
        x = raw[1:].view(np.float32)
        for _ in range(3):
            x[...] = vals(r, 1001, "float32")
            dist.all_reduce(x)
            assert np.array_equal(x, sum(vals(q, 1001, "float32") for q in range(ws)))
        if ws > 1 and a.native:
            # first calls of each fused shape and the non-fused dtypes run the general path; warm fused ones not
            # fused dtypes x sizes x ops: the first of 3 calls; AVG (float32/64) and float16/uint8: all 3; the
            # misaligned array: 3 (its plan's compiled call refuses it); each all_reduce + one reduce per root, but
            # reduces of at most QUEUE_BYTES take the one-way queue (never this helper): of the 4 sizes, the fused
            # dtypes have 2 above it, float16 and uint8 1
            want = (4 * 4 * 4 + 2 * 4 * 3 + 2 * 4 * 4 * 3) + (4 * 2 * 4 + 2 * 2 * 3 + 2 * 1 * 4 * 3) * ws + 3
            assert len(general) == want, (len(general), want)
        print(f"rank {r}: {checks} planned checks passed, general path {len(general)}", flush=True)
    elif mode == "die":
        x = np.ones(40001, np.float32)
        dist.all_reduce(x)
        if r == 1:
            os._exit(3)
        t0 = time.monotonic()
        try:
            dist.all_reduce(x)
        except Exception as e:
            print(f"rank {r}: {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
            os._exit(0)
        print(f"rank {r}: all_reduce returned", flush=True)
        os._exit(1)
    dist.destroy_process_group()
    """
)


def _spawn(tmp_path: Path, ws: int, mode: str, native: str, job: str) -> list:
    script = tmp_path / "native_big_worker.py"
    script.write_text(_WORKER)
    port = free_port()
    extra = {
        "PROCGROUP_TRANSPORT": "shm",
        "PROCGROUP_NATIVE": native,
        "PROCGROUP_TIMEOUT": "20",
        "PROCGROUP_SHM_BIG_SLOT": str(SLOT),
        "PROCGROUP_RUN_ID": job,
    }
    return [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            env=worker_env(r, ws, port, "cd" * 16, extra),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(ws)
    ]


def _leaked(job: str) -> list:
    return [x for x in os.listdir(SHM_DIR) if job in x]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.timeout(240)
def test_big_slot_reductions_on_both_paths(tmp_path: Path, ws: int, native: str) -> None:
    job = f"nbig-{os.getpid()}-{ws}-{native}"
    procs = _spawn(tmp_path, ws, "ops", native, job)
    try:
        results = collect(procs, 220)
    finally:
        kill_all(procs)
    assert all(r.returncode == 0 for r in results), report(results)
    for r in results:
        assert "big-slot checks passed" in r.stdout, report(results)
        if ws > 1:
            assert f"native={native == '1'}" in r.stdout, report(results)  # each rank ran the path asked for
    assert not _leaked(job)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.timeout(240)
def test_warm_plans_of_the_small_collectives_on_both_paths(tmp_path: Path, ws: int, native: str) -> None:
    job = f"nplan-{os.getpid()}-{ws}-{native}"
    procs = _spawn(tmp_path, ws, "plans", native, job)
    try:
        results = collect(procs, 220)
    finally:
        kill_all(procs)
    assert all(r.returncode == 0 for r in results), report(results)
    for r in results:
        assert "planned checks passed" in r.stdout, report(results)
    assert not _leaked(job)


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.timeout(90)
def test_a_dead_peer_is_named_while_a_rank_waits_in_a_big_slot_sync(tmp_path: Path, native: str) -> None:
    job = f"nbigdie-{os.getpid()}-{native}"
    t0 = time.monotonic()
    procs = _spawn(tmp_path, 3, "die", native, job)
    try:
        results = collect(procs, 60)
    finally:
        kill_all(procs)
    for r in (results[0], results[2]):
        assert r.returncode == 0, report(results)
        assert "PeerFailureError" in r.stdout and "big-slot collective" in r.stdout, report(results)
    assert time.monotonic() - t0 < 30
    assert not _leaked(job)
