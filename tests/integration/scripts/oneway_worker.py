"""Ranks of tests/integration/test_oneway_procs.py: the one-directional shared-slot broadcast (issue 14).

``python oneway_worker.py MODE [ARGS]`` under the env:// contract (harness.spawn_world).  Every value is checked
against its closed form; a rank prints ``rank R: N checks passed`` at the end, or the error it was meant to get.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("ONEWAY_MIXED"):  # ranks on both paths in one job: even ranks compiled, odd ranks Python
    os.environ["PROCGROUP_NATIVE"] = "1" if int(os.environ["RANK"]) % 2 == 0 else "0"

import numpy as np  # noqa: E402

import procgroup as dist  # noqa: E402
from procgroup.state import default_group  # noqa: E402
from procgroup.transport.shm import ARENA_BYTES, layout  # noqa: E402

# (defaults where the queue does not exist: the old code, to show the tests fail there)
QUEUE_BYTES, QUEUE_DEPTH = getattr(layout, "QUEUE_BYTES", 2048), getattr(layout, "QUEUE_DEPTH", 32)

DTYPES = ("float32", "float64", "int32", "int64", "int8", "uint8", "int16", "float16", "bool", "complex64")


def pattern(dt: str, n: int, root: int, salt: int) -> np.ndarray:
    """The root's data of one call: a closed form of (root, salt), never the readers' starting values."""
    v = (np.arange(n, dtype=np.int64) * (root + 3) + 7 * salt + 1) % 97
    if dt == "bool":
        return (v % 2).astype(bool)
    if dt == "complex64":
        return (v + 1j * (v % 5)).astype(np.complex64)
    return v.astype(dt)


def stale(dt: str, n: int) -> np.ndarray:
    """What a reader starts with (differs from every pattern: 0 for bool is excluded by the odd check below)."""
    if dt == "bool":
        return np.zeros(n, bool)
    return np.full(n, 99, dt)


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.tobytes() != want.tobytes():
        raise AssertionError(f"{what}: got {got[:8]} want {want[:8]}")


def values(quick: str = "") -> int:
    """Every dtype, sizes 0, 1, odd, a full slot and one element past it, every root; planned and unplanned
    (``quick``: three dtypes and four sizes, for large worlds)."""
    r, ws = dist.get_rank(), dist.get_world_size()
    n_checks = 0
    for dt in ("float32", "uint8", "complex64") if quick else DTYPES:
        isz = np.dtype(dt).itemsize
        q = QUEUE_BYTES // isz  # the queue's last size and the first past it (the arena slots)
        sizes = (0, 1, 7, q, q + 1) if quick else (0, 1, 7, 1001, q, q + 1, ARENA_BYTES // isz, ARENA_BYTES // isz + 1)
        for n in sizes:
            for root in range(ws):
                for rep in range(3):  # the second and third calls of a shape run from a warm plan
                    want = pattern(dt, n, root, rep)
                    x = want.copy() if r == root else stale(dt, n)
                    if dt == "bool" and r != root:
                        x[:] = ~want  # every element differs from the root's
                    dist.broadcast(x, src=root)
                    check(x, want, f"broadcast {dt} n={n} root={root} rep={rep}")
                    n_checks += 1
            n_checks += reduce_values(dt, n, r, ws)
    return n_checks


#: the reductions checked per dtype (the compiled path reduces the first four dtypes itself)
FUSED = ("float32", "float64", "int32", "int64")
OPS = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}


def reduce_values(dt: str, n: int, r: int, ws: int) -> int:
    """reduce of ``n`` elements of ``dt`` to every root with every op that applies, against numpy's reduction in
    member order (bit for bit); the non-roots' buffers stay as they were."""
    if dt in ("bool", "complex64"):
        ops = ["SUM"] if dt == "complex64" else ["MAX", "MIN"]
    else:
        ops = list(OPS) if dt in FUSED else ["SUM", "MAX"]
    checks = 0
    for op in ops + (["AVG"] if dt in ("float32", "float64") else []):
        xs = [pattern(dt, n, q, 2) for q in range(ws)]
        if op == "AVG":
            want = xs[0].copy()
            for y in xs[1:]:
                want = np.add(want, y)
            want = (want / ws).astype(dt)
        else:
            want = xs[0].copy()
            for y in xs[1:]:
                want = OPS[op](want, y)
        for root in range(ws):
            for rep in range(2):  # the second call of a shape runs from a warm plan
                x = xs[r].copy()
                dist.reduce(x, dst=root, op=getattr(dist.ReduceOp, op))
                got_want = want if r == root else xs[r]
                if op == "AVG" and r == root:
                    assert np.allclose(x, got_want), (dt, n, root, x[:4], got_want[:4])
                else:
                    check(x, got_want, f"reduce {op} {dt} n={n} root={root} rep={rep}")
                checks += 1
    return checks


def stress(iters: str = "2000") -> int:
    """Back to back: broadcasts with changing roots and sizes, interleaved with all_reduce, barrier, all_gather,
    reduces, all_to_all and big-slot broadcasts, some ranks dawdling now and then so a root runs ahead; every
    value checked."""
    r, ws = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(1234)  # the same sequence on every rank
    n_checks = 0
    for i in range(int(iters)):
        root = int(rng.integers(ws))
        n = int(rng.choice([1, 3, 17, 256, 2048]))
        dt = ("float32", "int64", "uint8")[i % 3]
        want = pattern(dt, n, root, i)
        x = want.copy() if r == root else stale(dt, n)
        dist.broadcast(x, src=root)
        check(x, want, f"iteration {i} broadcast {dt} n={n} root={root}")
        n_checks += 1
        if int(rng.integers(50)) == r:
            time.sleep(0.002)  # this rank falls behind: the next root runs ahead of it
        k = int(rng.integers(8))
        if k == 0:
            y = np.full(5, r + 1, np.int64)
            dist.all_reduce(y)
            check(y, np.full(5, ws * (ws + 1) // 2, np.int64), f"iteration {i} all_reduce")
        elif k == 1:
            dist.barrier()
        elif k == 2:  # small (the arena) or above the arena's slot (the big slots' one-step all_gather)
            na = 3 if i % 2 else 9000 + i % 3
            out = np.zeros(na * ws, np.int32)
            dist.all_gather_into_tensor(out, np.full(na, i + r, np.int32))
            check(out, np.repeat(np.arange(ws, dtype=np.int32) + i, na), f"iteration {i} all_gather of {na}")
        elif k == 3:
            z = np.full(4, r + 1.0, np.float64)
            dst = int(rng.integers(ws))
            dist.reduce(z, dst=dst)
            check(z, np.full(4, ws * (ws + 1) / 2 if r == dst else r + 1.0), f"iteration {i} reduce to {dst}")
        elif k == 5:
            z32 = np.full(3, 10 * r + i % 7, np.int32)
            dst = int(rng.integers(ws))
            dist.reduce(z32, dst=dst, op=dist.ReduceOp.MAX)
            check(z32, np.full(3, 10 * (ws - 1 if r == dst else r) + i % 7, np.int32), f"iteration {i} reduce MAX")
        elif k == 6:  # writes its slot in place (all_to_all's header and data) right after a one-directional call
            m = 2 + i % 3
            src_ = (np.arange(ws * m, dtype=np.int64) + 1000 * r).reshape(ws, m)
            out = np.zeros((ws, m), np.int64)
            dist.all_to_all_single(out, src_)
            want = np.array([[1000 * q + r * m + j for j in range(m)] for q in range(ws)], np.int64)
            check(out, want, f"iteration {i} all_to_all")
        elif k == 4 and i % 40 == 4:
            big = ARENA_BYTES // 4 + 3  # past the slot: the big slots or messages
            w = pattern("float32", big, root, i)
            y = w.copy() if r == root else stale("float32", big)
            dist.broadcast(y, src=root)
            check(y, w, f"iteration {i} big broadcast")
        n_checks += 1
    # bursts of one-way calls only (past the queue's depth: its flow control and wrap-around), changing roots,
    # sizes up to the queue's limit, a rank dawdling now and then so the others run ahead of it
    for i in range(int(iters) // 10):
        root = int(rng.integers(ws))
        n = int(rng.choice([1, 5, QUEUE_BYTES // 8]))
        if int(rng.integers(40)) == r:
            time.sleep(0.001)
        if i % 3:
            want = pattern("int64", n, root, i)
            x = want.copy() if r == root else stale("int64", n)
            dist.broadcast(x, src=root)
            check(x, want, f"burst {i} broadcast n={n} root={root}")
        else:
            z = np.full(n, float(r + i), np.float64)
            dist.reduce(z, dst=root)
            check(z, np.full(n, float(ws * i + ws * (ws - 1) // 2) if r == root else float(r + i)), f"burst {i} reduce")
        n_checks += 1
    # several groups at once: the world, a copy of it and a subgroup (all but the last rank), one-way calls of
    # each interleaved (each group has its own queue), past the queue's depth, with the world's all_reduce now and
    # then; then both destroyed
    both = dist.new_group(list(range(ws)))
    sub = dist.new_group(list(range(max(1, ws - 1))))
    for i in range(3 * QUEUE_DEPTH):
        for g, size in ((None, ws), (both, ws), (sub, max(1, ws - 1))):
            if r >= size:
                continue
            root = (i + (g is both)) % size
            want = pattern("float32", 3 + i % 5, root, i)
            x = want.copy() if r == root else stale("float32", want.size)
            dist.broadcast(x, src=root, group=g)
            check(x, want, f"groups {i} broadcast root={root}")
            z = np.full(2, float(r), np.float64)
            dist.reduce(z, dst=root, group=g)
            check(z, np.full(2, size * (size - 1) / 2 if r == root else float(r)), f"groups {i} reduce")
            n_checks += 2
        if i % 17 == 16:
            y = np.ones(2, np.int64)
            dist.all_reduce(y)
            check(y, np.full(2, ws, np.int64), f"groups {i} all_reduce")
    dist.destroy_process_group(sub)
    dist.destroy_process_group(both)
    # a new group over the same ranks, destroyed after a broadcast that returned early on its root
    for _ in range(3):
        g = dist.new_group(list(range(ws)))
        for root in range(ws):
            want = pattern("int32", 9, root, 5)
            x = want.copy() if r == root else stale("int32", 9)
            dist.broadcast(x, src=root, group=g)
            check(x, want, f"new_group broadcast root={root}")
            n_checks += 1
        dist.destroy_process_group(g)
    return n_checks


def mismatch(kind: str) -> None:
    """Rank 0 broadcasts 4 float32 from rank 0 and then calls barrier; the last rank calls a different
    collective at that point (``kind``: shape, dtype, root, op); everyone else calls what rank 0 does."""
    r, ws = dist.get_rank(), dist.get_world_size()
    for root in range(ws):  # warm plans for both sides
        dist.broadcast(np.ones(4, np.float32), src=root)
    dist.barrier()
    t0 = time.monotonic()
    try:
        if r == ws - 1 and kind == "shape":
            dist.broadcast(np.ones(8, np.float32), src=0)
        elif r == ws - 1 and kind == "dtype":
            dist.broadcast(np.ones(4, np.float64), src=0)
        elif r == ws - 1 and kind == "root":
            dist.broadcast(np.ones(4, np.float32), src=r)
        elif kind == "root_loop":  # every rank its own root, then broadcasts from rank 0 (that never complete)
            dist.broadcast(np.ones(4, np.float32), src=r)
            for _ in range(100):
                dist.broadcast(np.ones(4, np.float32), src=0)
        elif r == ws - 1 and kind == "op":
            dist.all_reduce(np.ones(4, np.float32))
        elif kind == "reduce":  # the last rank reduces with another op
            op = dist.ReduceOp.MAX if r == ws - 1 else dist.ReduceOp.SUM
            for root in range(ws):  # warm plans
                dist.reduce(np.ones(4, np.float32), dst=root, op=op)
            dist.reduce(np.ones(4, np.float32), dst=0, op=op)
        else:
            dist.broadcast(np.ones(4, np.float32), src=0)
        dist.barrier()
    except dist.CollectiveMismatchError as e:
        print(f"rank {r}: mismatch after {time.monotonic() - t0:.1f}s: {e}", flush=True)
        _linger(r, ws)  # the store lives on rank 0: the others read the finding from it before it goes
        os._exit(3)
    print(f"rank {r}: no error", flush=True)
    os._exit(1)


def _linger(r: int, n: int, limit: float = 5.0) -> None:
    """Stay until ``n`` ranks (this one included) have reported their error, at most ``limit`` s: each leaves a
    file in ONEWAY_DONE_DIR (set by the test), so no rank exits (taking the store on rank 0 with it, or looking
    dead to a rank that still waits) before every rank found what it must report."""
    d = os.environ.get("ONEWAY_DONE_DIR", "")
    if not d:
        time.sleep(limit)
        return
    open(os.path.join(d, str(r)), "w").close()
    end = time.monotonic() + limit
    while time.monotonic() < end and len(os.listdir(d)) < n:
        time.sleep(0.02)


def kill(who: str, op: str = "broadcast") -> None:
    """Broadcasts (``op`` reduce: reduces) to rank 0; ``who`` (root: rank 0, reader: rank 1) dies at call 50: the
    others must raise PeerFailureError naming it."""
    r = dist.get_rank()
    victim = 0 if who == "root" else 1
    t0 = time.monotonic()
    try:
        for i in range(1000):
            if i == 50 and r == victim:
                os._exit(9)
            if i == 50:
                t0 = time.monotonic()
            if op == "reduce":
                y = np.full(4, float(r + i), np.float32)
                dist.reduce(y, dst=0)
                ws = dist.get_world_size()
                check(y, np.full(4, float(ws * i + ws * (ws - 1) // 2 if r == 0 else r + i), np.float32), f"reduce {i}")
                continue
            want = pattern("float32", 4, 0, i)
            x = want.copy() if r == 0 else stale("float32", 4)
            dist.broadcast(x, src=0)
            check(x, want, f"broadcast {i}")
    except dist.PeerFailureError as e:
        print(f"rank {r}: PeerFailureError after {time.monotonic() - t0:.2f}s: {e}", flush=True)
        # stay a while: a one-way call's survivors do not all wait for the dead rank (a reader waits for its root
        # alone), so they learn of it from the first finder (the store, on rank 0) rather than its own exit
        _linger(r, dist.get_world_size() - 1)
        os._exit(0)
    print(f"rank {r}: no error", flush=True)
    os._exit(1)


def idle(who: str) -> None:
    """A rank blocked 2 s in a one-way call sleeps: ``who`` reader (ranks 1 and 2 wait for a late root), root
    (rank 1 is late: the root's first QUEUE_DEPTH broadcasts return at once, the next waits for rank 1's done word,
    rank 2 reads them all and waits in a barrier), or reduce (the root is late: the non-roots' first QUEUE_DEPTH
    reduces return at once, the next waits for the root)."""
    r = dist.get_rank()
    dist.barrier()
    x = np.ones(4, np.float32)
    c0, t0 = time.process_time(), time.monotonic()
    if who == "reader":
        if r == 0:
            time.sleep(2.5)
        dist.broadcast(x, src=0)
    else:
        late = 1 if who == "root" else 0
        if r == late:
            time.sleep(2.5)
        for i in range(QUEUE_DEPTH + 1):
            if who == "root":
                dist.broadcast(x, src=0)
            else:
                dist.reduce(x, dst=0)
            if i == QUEUE_DEPTH - 1:
                print(f"rank {r}: first {QUEUE_DEPTH} calls returned after {time.monotonic() - t0:.2f}s", flush=True)
        dist.barrier()
    c1, t1 = time.process_time(), time.monotonic()
    print(f"rank {r}: waited {t1 - t0:.2f}s cpu {c1 - c0:.3f}s", flush=True)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group()
    r = dist.get_rank()
    a = default_group().arena()
    print(f"rank {r}: native={a is not None and a.native}", flush=True)
    if mode in ("mismatch", "kill"):
        {"mismatch": mismatch, "kill": kill}[mode](*args)
    elif mode == "idle":
        idle(*args)
    else:
        n = {"values": values, "stress": stress}[mode](*args)
        q = getattr(a, "queue", None)
        print(f"rank {r}: {n} checks passed, {q.calls if q is not None else 0} one-way calls", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
