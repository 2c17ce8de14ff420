"""One-way big-slot reduce (issue 14) with real processes on one host, on the compiled path, the pure-Python path
and both mixed in one job (``PROCGROUP_NATIVE`` per rank).

A reduce's non-roots return without waiting for the root (the root here only calls once the store says every
non-root returned); long sequences of reduces with every root, among every other big-slot collective and a
rank that lags, give the closed-form values; warm plans of the big slots follow ``select.BIG_LIMIT`` per call; a
root that dies before it takes its part is named at a non-root's next call; a reduce in which every rank names
another root is stopped at the next call and the watchdog names both calls.  Nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from procgroup.config import SHM_DIR
from procgroup.netutil import free_port
from procgroup.transport.shm import arena as shm_arena

from .harness import ROOT, Result, collect, kill_all, report, worker_env

pytestmark = pytest.mark.timeout(180)

needs_native = pytest.mark.skipif(
    not shm_arena.native_available(), reason="the compiled arena extension was not built (no C compiler?)"
)
#: PROCGROUP_NATIVE of rank r: PATHS[...][r % 2]
PATHS = [
    pytest.param("11", id="native", marks=needs_native),
    pytest.param("00", id="python"),
    pytest.param("10", id="mixed", marks=needs_native),
]
SLOT = 65536

WORKER = """
import os, sys, time, numpy as np, procgroup as dist
from procgroup.state import default_group
mode = sys.argv[1]
dist.init_process_group("cpu")
r, p = dist.get_rank(), dist.get_world_size()
big = default_group().arena().big
assert big is not None and big.slot_bytes == int(os.environ["PROCGROUP_SHM_BIG_SLOT"]), "no big slots"
print(f"rank {r}: native={big.native}", flush=True)

def vals(q, n, dt="int64"):
    return ((np.arange(n) * (q + 3)) % 13 - 6 + q).astype(dt)

def total(n, dt="int64", k=0):
    return sum(vals(q + k, n, dt) for q in range(p))

if mode == "oneway":
    store = default_group().world.store
    for k, n in enumerate((5000, 2, 8192)):  # above the arena, within one buffer: one direct step
        x = vals(r, n)
        if r == 0:
            store.wait([f"gone{k}"])  # only once every non-root's reduce returned
        dist.reduce(x, dst=0)
        if r:
            assert np.array_equal(x, vals(r, n)), k
            if store.add(f"n{k}", 1) == p - 1:
                store.set(f"gone{k}", b"1")
        else:
            assert np.array_equal(x, total(n)), k
    y = vals(r, 9000)
    dist.all_reduce(y)
    assert np.array_equal(y, total(9000))
    print(f"rank {r} ok", flush=True)
elif mode == "mix":
    for k in range(30):
        if r == (k // 2) % p:
            time.sleep(0.002)
        root = k % p
        for dt in ("int64", "float32") if k % 5 == 0 else ("int64",):
            n = (5000, 3 * 16384 + 5)[k % 2] + k  # direct; reduce-scatter + gather steps
            x = vals(r + k, n, dt)
            dist.reduce(x, dst=root)
            want = total(n, dt, k)
            assert x.tobytes() == (want if r == root else vals(r + k, n, dt)).tobytes(), (k, dt)
        kind = k % 6
        n = 9000 + k
        if kind == 0:
            y = vals(r, n)
            dist.all_reduce(y)
            assert np.array_equal(y, total(n)), k
        elif kind == 1:
            y = vals(root, n) if r == root else np.zeros(n, np.int64)
            dist.broadcast(y, src=root)
            assert np.array_equal(y, vals(root, n)), k
        elif kind == 2:
            out = np.empty(p * n, np.int64)
            dist.all_gather_into_tensor(out, vals(r, n))
            assert np.array_equal(out, np.concatenate([vals(q, n) for q in range(p)])), k
        elif kind == 3:
            out = np.empty(n, np.int64)
            dist.reduce_scatter_tensor(out, np.tile(vals(r, n), p))
            assert np.array_equal(out, total(n)), k
        elif kind == 4:
            send = np.concatenate([np.full(n, 100 * r + j, np.int64) for j in range(p)])
            recv = np.empty(p * n, np.int64)
            dist.all_to_all_single(recv, send)
            assert np.array_equal(recv, np.repeat(100 * np.arange(p) + r, n)), k
        else:
            dist.barrier()
    print(f"rank {r} ok", flush=True)
elif mode == "plans":
    # warm plans (a shape's second call on) of the big slots' one-step broadcast and one-sync all_reduce / reduce:
    # on the compiled path one bound call (bigarena.bind_bcast / bind_reduce), never the general helpers
    from procgroup.algorithms import bigarena as B
    from procgroup.algorithms import select as S

    S.BIG_MIN_PAIR["broadcast"] = 0  # a pair's broadcasts here take the big slots too (its reads: test_pair_reads)
    general = []
    for name in ("bcast_big", "_reduce_direct", "reduce_scatter_big"):
        setattr(B, name, (lambda real, name: lambda *a: general.append(name) or real(*a))(getattr(B, name), name))
    S.bcast_big, S.reduce_scatter_big = B.bcast_big, B.reduce_scatter_big  # the selection's own references
    ops = {"SUM": np.add, "MAX": np.maximum, "PRODUCT": np.multiply}
    shapes = 0
    for dt in ("float32", "int64", "float64"):
        for n in (40001 // np.dtype(dt).itemsize, 60000 // np.dtype(dt).itemsize):  # above the arena, in one buffer
            for op in ("SUM", "MAX", "PRODUCT"):
                xs = [vals(q, n, dt) for q in range(p)]
                want = xs[0].copy()
                for y in xs[1:]:
                    ops[op](want, y, out=want)
                for _ in range(3):
                    x = xs[r].copy()
                    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                    assert x.tobytes() == want.tobytes(), (dt, n, op)
                    for root in range(p):
                        y = xs[r].copy()
                        dist.reduce(y, dst=root, op=getattr(dist.ReduceOp, op))
                        assert y.tobytes() == (want if r == root else xs[r]).tobytes(), (dt, n, op, root)
                shapes += 1 + p
            for root in range(p):
                for _ in range(3):
                    b = vals(root, n, dt) if r == root else np.zeros(n, dt)
                    dist.broadcast(b, src=root)
                    assert np.array_equal(b, vals(root, n, dt)), (dt, n, root)
                shapes += 1
    for dt in ("float32", "int64"):
        m = 48000 // (np.dtype(dt).itemsize * p)  # the whole input above the arena, in one buffer
        for op in ("SUM", "MAX"):
            xs = [vals(q, p * m, dt) for q in range(p)]
            want = xs[0].copy()
            for y in xs[1:]:
                ops[op](want, y, out=want)
            for _ in range(3):
                o = np.full(m, 9, dt)
                dist.reduce_scatter_tensor(o, xs[r], op=getattr(dist.ReduceOp, op))
                assert o.tobytes() == want[r * m : (r + 1) * m].tobytes(), (dt, op)
            shapes += 1
            inp = xs[r].copy()  # in place: the output is this rank's block of the input (the general path)
            dist.reduce_scatter_tensor(inp[r * m : (r + 1) * m], inp, op=getattr(dist.ReduceOp, op))
            assert inp[r * m : (r + 1) * m].tobytes() == want[r * m : (r + 1) * m].tobytes(), (dt, op, "in place")
            shapes += 1  # its first call (its only one) is general on every path
    raw = np.zeros(4 * 10001 + 1, np.uint8)  # misaligned: the bound call refuses it, the general path runs
    x = raw[1:].view(np.float32)
    for _ in range(3):
        x[...] = vals(r, 10001, "float32")
        dist.all_reduce(x)
        assert np.array_equal(x, sum(vals(q, 10001, "float32") for q in range(p)))
    once = 4  # the in-place reduce_scatters: one call each
    if big.native:  # each shape's first call is general; the warm ones bound (the misaligned array: all 3)
        assert len(general) == shapes + 3, (len(general), shapes)
    else:
        assert len(general) == 3 * (shapes - once) + once + 3, (len(general), shapes)
    print(f"rank {r} ok", flush=True)
elif mode == "limit":
    # a warm plan bound to the big slots compares select.BIG_LIMIT per call: lowered after the plans were built,
    # the same calls take select's message algorithms (their messages counted here), with the same results; raised,
    # the big slots (no message)
    from procgroup.algorithms import select as S

    S.BIG_MIN_PAIR["broadcast"] = 0  # a pair's broadcast of n takes the big slots, ...
    S.ONECOPY_MIN_PAIR["broadcast"] = 1 << 62  # ... or, above the lowered limit, messages (not the reads)
    for op in ("all_reduce", "reduce_scatter"):  # the same for the reductions that read where the big slots do not
        S.ONECOPY_MIN[op] = S.ONECOPY_MIN_PAIR[op] = 1 << 62
    msgs = []
    t = default_group().world.transport
    real_isend, real_irecv = t.isend, t.irecv
    t.isend = lambda *a: msgs.append(a[:2]) or real_isend(*a)  # every message this rank sends ...
    t.irecv = lambda *a: msgs.append(a[:2]) or real_irecv(*a)  # ... or receives
    n = 6000  # int64: 48 KB, above the arena, in one big slot (the compiled path binds the call)
    m = 6000 // p  # reduce_scatter: the whole input of p * m in one big slot
    ops = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
    counts = []
    for i, lowered in enumerate([False, False, True, True, False]):
        for op in ops:
            S.BIG_LIMIT[op] = 0 if lowered else 1 << 62
        before = len(msgs)
        x = vals(r, n)
        dist.all_reduce(x)
        assert np.array_equal(x, total(n)), i
        b = vals(p - 1, n) if r == p - 1 else np.zeros(n, np.int64)
        dist.broadcast(b, src=p - 1)
        assert np.array_equal(b, vals(p - 1, n)), i
        d = vals(r, n)
        dist.reduce(d, dst=0)
        assert np.array_equal(d, total(n) if r == 0 else vals(r, n)), i
        out = np.empty(p * n, np.int64)
        dist.all_gather_into_tensor(out, vals(r, n))
        assert np.array_equal(out, np.concatenate([vals(q, n) for q in range(p)])), i
        rs = np.empty(m, np.int64)
        dist.reduce_scatter_tensor(rs, np.tile(vals(r, m), p))
        assert np.array_equal(rs, total(m)), i
        counts.append(len(msgs) - before)
    assert counts[0] == counts[1] == counts[4] == 0 and counts[2] == counts[3] >= 5, counts  # each op's messages
    # a group of two has its own, lower broadcast limit (BIG_LIMIT_PAIR), also compared per call: lowered, a pair's
    # broadcast goes as a message and a larger group's stays in the big slots; raised again, the slots
    pair = []
    for lowered in (True, False, True):
        S.BIG_LIMIT_PAIR["broadcast"] = 0 if lowered else 32 << 20
        before = len(msgs)
        b = vals(p - 1, n) if r == p - 1 else np.zeros(n, np.int64)
        dist.broadcast(b, src=p - 1)
        assert np.array_equal(b, vals(p - 1, n)), lowered
        pair.append(len(msgs) - before)
    assert pair == ([1, 0, 1] if p == 2 else [0, 0, 0]), pair
    print(f"rank {r} ok {counts} {pair}", flush=True)
elif mode == "steps":
    # the default 1 MiB buffers: all_gather parts and broadcasts around STEP_MAX (512 KiB), in one step, two and
    # three, each called three times so that the warm calls run from a plan (compiled) where they can
    for n in (65536, 65537, 131072, 131073, 262145):  # int64: 512 KiB, +8 B, 1 MiB, +8 B, 2 MiB + 8 B
        for k in range(3):
            out = np.empty(p * n, np.int64)
            dist.all_gather_into_tensor(out, vals(r + k, n))
            assert np.array_equal(out, np.concatenate([vals(q + k, n) for q in range(p)])), (n, k)
            root = (k + n) % p
            b = vals(root + k, n) if r == root else np.zeros(n, np.int64)
            dist.broadcast(b, src=root)
            assert np.array_equal(b, vals(root + k, n)), (n, k, root)
    # all_to_all streams ((p - 1) pieces) of 512 KiB, just above, 1 MiB (in the big slots, within BIG_LIMIT's 1 MiB,
    # in windows of at most STEP_MAX: two rounds), just above and 2 MiB (read straight out of the senders)
    for stream in (65536, 65537, 131072, 131073, 262144):
        m = stream // (p - 1)  # int64 elements a piece
        for k in range(3):
            src = np.concatenate([vals(r * p + q + k, m) for q in range(p)])
            got = np.empty(p * m, np.int64)
            dist.all_to_all_single(got, src)
            assert np.array_equal(got, np.concatenate([vals(q * p + r + k, m) for q in range(p)])), (m, k)
            outs = [np.empty(m, np.int64) for _ in range(p)]  # the list form (its own compiled plan)
            dist.all_to_all(outs, [vals(r * p + q + k, m) for q in range(p)])
            assert all(np.array_equal(outs[q], vals(q * p + r + k, m)) for q in range(p)), (m, k, "list")
    print(f"rank {r} ok", flush=True)
elif mode in ("die", "noroot"):
    x = vals(r, 5000)
    if mode == "die":
        dist.all_reduce(x)
        if r == 0:
            os._exit(7)  # the root dies before it takes the parts
        dist.reduce(x, dst=0)  # one-way: returns
    else:
        dist.reduce(x, dst=(r + 1) % p)  # every rank names another root
        assert np.array_equal(x, vals(r, 5000))
    t0 = time.monotonic()
    try:  # the next call is where it is named
        dist.all_reduce(x)
    except Exception as e:
        print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
        sys.exit(3)
    print(f"rank {r}: all_reduce returned", flush=True)
dist.destroy_process_group()
"""


def _run(tmp_path: Path, mode: str, n: int, paths: str, timeout_s: str = "30", slot: int = SLOT) -> List[Result]:
    f = tmp_path / "oneway_worker.py"
    f.write_text(WORKER)
    port = free_port()
    job = f"bigow-{os.getpid()}-{port}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(f), mode],
            env=worker_env(
                r,
                n,
                port,
                "oneway-secret",
                {
                    "PROCGROUP_TRANSPORT": "shm",
                    "PROCGROUP_SHM_BIG_SLOT": str(slot),
                    "PROCGROUP_NATIVE": paths[r % 2],
                    "PROCGROUP_TIMEOUT": timeout_s,
                    "PROCGROUP_RUN_ID": job,
                },
            ),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    try:
        res = collect(procs, 150)
    finally:
        kill_all(procs)
    for r in res:
        if "native=" in r.stdout:  # each rank ran the path asked for
            assert f"native={paths[r.rank % 2] == '1'}" in r.stdout, report(res)
    leaked = [x for x in os.listdir(SHM_DIR) if job in x]
    assert not leaked, f"/dev/shm segments left behind: {leaked}"
    return res


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_non_roots_return_before_the_root_calls(tmp_path: Path, n: int, paths: str) -> None:
    res = _run(tmp_path, "oneway", n, paths, timeout_s="20")
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduces_with_every_root_among_every_other_op_and_a_lagging_rank(tmp_path: Path, n: int, paths: str) -> None:
    res = _run(tmp_path, "mix", n, paths)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("n", [2, 3])
def test_warm_plans_of_big_slot_broadcasts_reductions_and_reduce_scatters(tmp_path: Path, n: int, paths: str) -> None:
    res = _run(tmp_path, "plans", n, paths)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_all_gather_and_all_to_all_steps_around_step_max(tmp_path: Path, n: int, paths: str) -> None:
    """1 MiB buffers: parts and streams of at most STEP_MAX go in one step, larger ones in steps of at most
    STEP_MAX, on the compiled, pure-Python and mixed paths alike (every rank must cut the same steps)."""
    res = _run(tmp_path, "steps", n, paths, slot=1 << 20)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("paths", PATHS)
@pytest.mark.parametrize("n", [2, 3])
def test_warm_big_slot_plans_follow_big_limit_per_call(tmp_path: Path, n: int, paths: str) -> None:
    res = _run(tmp_path, "limit", n, paths)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("paths", PATHS)
def test_a_root_that_dies_before_its_part_is_named_at_the_next_call(tmp_path: Path, paths: str) -> None:
    t0 = time.monotonic()
    res = _run(tmp_path, "die", 3, paths, timeout_s="60")
    assert res[0].returncode == 7, report(res)
    for r in res[1:]:
        assert r.returncode == 3 and "rank 0" in r.stdout, report(res)
    assert time.monotonic() - t0 < 40, report(res)


def test_every_rank_naming_another_root_is_stopped_and_named(tmp_path: Path) -> None:
    res = _run(tmp_path, "noroot", 2, "11" if shm_arena.native_available() else "00", timeout_s="6")
    text = report(res)
    assert all(r.returncode == 3 for r in res), text
    assert "reduce" in text, text
