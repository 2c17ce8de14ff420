"""Worker programs for the device-engine tests: ``python device_workers.py SCENARIO``.

One program serves two test files: tests/integration/test_device_engine_procs.py runs it with
``PG_BACKEND=torch_gloo PG_DEVICE=cpu`` (the nccl backend's engine with torch's gloo on the CPU: every torch
tensor goes through the engine), and tests/cuda/test_own_api_nccl.py with ``PG_BACKEND=nccl PG_DEVICE=cuda``
(CUDA tensors through torch's NCCL).  Each rank reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, checks
closed-form values, prints OK and exits 0, or raises (exit 1) naming the first difference.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.backends

import numpy as np  # noqa: E402
import torch  # noqa: E402

import procgroup as dist  # noqa: E402
from procgroup.errors import (  # noqa: E402
    BrokenError,
    CollectiveMismatchError,
    ConfigError,
    DistTimeoutError,
    ProcGroupError,
)

RANK = int(os.environ["RANK"])
WS = int(os.environ["WORLD_SIZE"])
BACKEND = os.environ.get("PG_BACKEND", "torch_gloo")
DEV = os.environ.get("PG_DEVICE", "cpu")
S = WS * (WS + 1) // 2  # the sum over ranks of rank + 1
#: reductions: what torch's NCCL reduces (gloo too); int16 and complex only move
RED_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
MOVE_DTYPES = RED_DTYPES + [torch.int16, torch.complex64]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]


def check(cond: bool, what: str) -> None:
    """Raise naming the rank and the failed expectation."""
    if not cond:
        raise AssertionError(f"rank {RANK}/{WS} ({BACKEND}, {DEV}): {what}")


def device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (modulo the GPUs here), or the CPU."""
    if DEV == "cuda":
        i = int(os.environ.get("LOCAL_RANK", RANK)) % torch.cuda.device_count()
        torch.cuda.set_device(i)
        return torch.device("cuda", i)
    return torch.device("cpu")


def init(timeout: float = 60.0) -> torch.device:
    """Join the default group of the scenario's backend; this rank's device."""
    if BACKEND != "nccl":
        import tests.backends.torch_gloo  # noqa: F401 - registers the stand-in backends
    d = device()
    dist.init_process_group(backend=BACKEND, timeout=timeout)
    check(dist.get_backend() == BACKEND, f"backend {dist.get_backend()}")
    return d


def same(t: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``t`` equals ``want`` (on the CPU) exactly, dtype included."""
    got = t.cpu()
    check(got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}")
    ok = torch.equal(got, want) if got.numel() else got.shape == want.shape
    check(ok, f"{what}: got {got.tolist()}, expected {want.tolist()}")


def contrib(r: int, n: int, dt: torch.dtype, op: str) -> torch.Tensor:
    """Rank r's input of n elements: small integers, exact in every dtype and under every op at WS <= 8."""
    i = torch.arange(n)
    if dt is torch.bool:
        return (r + i) % 2 == 0
    if op == "PRODUCT":
        return (1 + (r + i) % 2).to(dt)
    return ((r + 1) + i % 3).to(dt)


def reduced(n: int, dt: torch.dtype, op: str, ws: int = WS) -> torch.Tensor:
    """The closed form of ``op`` over ranks 0..ws-1 of :func:`contrib`."""
    i = torch.arange(n)
    if dt is torch.bool:
        parts = [(r + i) % 2 == 0 for r in range(ws)]
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = acc | p if op in ("SUM", "MAX") else acc & p
        return acc
    if op == "SUM":
        return (ws * (ws + 1) // 2 + ws * (i % 3)).to(dt)
    if op == "MIN":
        return (1 + i % 3).to(dt)
    if op == "MAX":
        return (ws + i % 3).to(dt)
    if op == "PRODUCT":
        odd = sum(1 for r in range(ws) if (r + 0) % 2 == 1)
        even = sum(1 for r in range(ws) if (r + 1) % 2 == 1)
        return torch.where(i % 2 == 0, 2**odd, 2**even).to(dt)
    return ((ws * (ws + 1) / 2 + ws * (i % 3)) / ws).to(dt)  # AVG


def ops_for(dt: torch.dtype) -> list:
    """The reduce ops defined for ``dt`` (AVG of integers and bools is a ConfigError, as on the cpu backend)."""
    if dt.is_floating_point:
        return OPS
    return ["SUM", "PRODUCT", "MIN", "MAX"]


def reductions(d: torch.device) -> int:
    """all_reduce, reduce (every root), reduce_scatter(_tensor): every dtype and op, sizes 0, 1, 7."""
    count = 0
    for dt in RED_DTYPES:
        for op in ops_for(dt):
            rop = getattr(dist.ReduceOp, op)
            for n in (0, 1, 7):
                t = contrib(RANK, n, dt, op).to(d)
                dist.all_reduce(t, op=rop)
                same(t, reduced(n, dt, op), f"all_reduce {dt} {op} n={n}")
                count += 1
            for root in range(WS):
                t = contrib(RANK, 5, dt, op).to(d)
                dist.reduce(t, dst=root, op=rop)
                if RANK == root:
                    same(t, reduced(5, dt, op), f"reduce {dt} {op} root={root}")
                count += 1
            # reduce_scatter_tensor: member j's block is rows [3j, 3j+3) of every rank's input
            full = contrib(RANK, 3 * WS, dt, op).to(d)
            out = torch.empty(3, dtype=dt, device=d)
            dist.reduce_scatter_tensor(out, full, op=rop)
            same(out, reduced(3 * WS, dt, op)[3 * RANK : 3 * RANK + 3], f"reduce_scatter_tensor {dt} {op}")
            outs = torch.empty(3, dtype=dt, device=d)
            dist.reduce_scatter(outs, list(full.chunk(WS)), op=rop)
            same(outs, reduced(3 * WS, dt, op)[3 * RANK : 3 * RANK + 3], f"reduce_scatter {dt} {op}")
            count += 2
    for op in ("BAND", "BOR", "BXOR"):
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32, device=d), op=getattr(dist.ReduceOp, op))
        except ConfigError as e:
            check("no bitwise reductions" in str(e), f"{op}: {e}")
        else:
            check(False, f"all_reduce {op} of a device tensor did not raise ConfigError")
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32, device=d), op=dist.ReduceOp.AVG)
    except ConfigError as e:
        check("integer AVG" in str(e), f"AVG int32: {e}")
    else:
        check(False, "integer AVG did not raise")
    return count


def movement(d: torch.device) -> int:
    """broadcast, all_gather(+into_tensor), gather, scatter, all_to_all(+single, splits): every dtype, root."""
    count = 0
    for dt in MOVE_DTYPES:

        def val(r: int, n: int, dt: torch.dtype = dt) -> torch.Tensor:
            x = torch.arange(n) + 10 * r
            return (x % 2 == 0) if dt is torch.bool else x.to(dt)

        for root in range(WS):
            for n in (0, 1, 7):
                t = val(RANK, n).to(d)
                dist.broadcast(t, src=root)
                same(t, val(root, n), f"broadcast {dt} root={root} n={n}")
                count += 1
            g = [torch.empty(4, dtype=dt, device=d) for _ in range(WS)] if RANK == root else None
            dist.gather(val(RANK, 4).to(d), g, dst=root)
            if g is not None:
                for r in range(WS):
                    same(g[r], val(r, 4), f"gather {dt} root={root} from {r}")
            out = torch.empty(4, dtype=dt, device=d)
            sl = [val(r + 100, 4).to(d) for r in range(WS)] if RANK == root else None
            dist.scatter(out, sl, src=root)
            same(out, val(RANK + 100, 4), f"scatter {dt} root={root}")
            count += 2
        lst = [torch.empty(3, dtype=dt, device=d) for _ in range(WS)]
        dist.all_gather(lst, val(RANK, 3).to(d))
        for r in range(WS):
            same(lst[r], val(r, 3), f"all_gather {dt} [{r}]")
        big = torch.empty(3 * WS, dtype=dt, device=d)
        dist.all_gather_into_tensor(big, val(RANK, 3).to(d))
        same(big, torch.cat([val(r, 3) for r in range(WS)]), f"all_gather_into_tensor {dt}")
        # all_to_all: rank r sends val(100 r + j, j + 1) to rank j (sizes differ per pair)
        ins = [val(100 * RANK + j, j + 1).to(d) for j in range(WS)]
        outs = [torch.empty(RANK + 1, dtype=dt, device=d) for _ in range(WS)]
        dist.all_to_all(outs, ins)
        for r in range(WS):
            same(outs[r], val(100 * r + RANK, RANK + 1), f"all_to_all {dt} from {r}")
        x = torch.cat([val(100 * RANK + j, 2) for j in range(WS)]).to(d)
        y = torch.empty(2 * WS, dtype=dt, device=d)
        dist.all_to_all_single(y, x)
        same(y, torch.cat([val(100 * r + RANK, 2) for r in range(WS)]), f"all_to_all_single {dt}")
        # uneven splits along dim 0 of 2-column tensors: rank r sends j + 1 rows to rank j
        xs = torch.cat([val(100 * RANK + j, 2 * (j + 1)).reshape(j + 1, 2) for j in range(WS)]).to(d)
        ys = torch.empty(WS * (RANK + 1), 2, dtype=dt, device=d)
        dist.all_to_all_single(ys, xs, [RANK + 1] * WS, [j + 1 for j in range(WS)])
        want = torch.cat([val(100 * r + RANK, 2 * (RANK + 1)).reshape(RANK + 1, 2) for r in range(WS)])
        same(ys, want, f"all_to_all_single splits {dt}")
        count += 5
    return count


def shapes_and_async(d: torch.device) -> int:
    """Non-contiguous tensors (copied back), async_op Works, barrier (plain and device_ids), p2p."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (RANK + 1)
    t = base.to(d).t()  # non-contiguous
    check(not t.is_contiguous(), "t() is contiguous?")
    dist.all_reduce(t)
    same(t, (torch.arange(12, dtype=torch.float32).reshape(3, 4) * S).t(), "non-contiguous all_reduce")
    col = torch.zeros(4, 3, device=d)[:, 1]  # non-contiguous
    if RANK == 0:
        col.copy_(torch.arange(4, dtype=torch.float32) + 1)
    dist.broadcast(col, src=0)
    same(col, torch.arange(4, dtype=torch.float32) + 1, "non-contiguous broadcast")
    out = torch.zeros(2 * WS, 2, device=d)[:, 0]  # non-contiguous output
    dist.all_gather_into_tensor(out, (torch.ones(2) * RANK).to(d))
    same(out, torch.cat([torch.ones(2) * r for r in range(WS)]), "non-contiguous all_gather_into_tensor")
    works = [dist.all_reduce(torch.full((5,), float(k + RANK), device=d), async_op=True) for k in range(3)]
    for w in works:
        check(isinstance(w, dist.Work), f"async_op returned {type(w)}")
        w.wait()
    a = torch.full((4,), float(RANK + 1), device=d)
    w = dist.all_reduce(a, async_op=True)
    w.wait()
    same(a, torch.full((4,), float(S)), "async all_reduce")
    dist.barrier()
    dist.barrier(device_ids=[d.index or 0])
    # numpy arrays keep procgroup's own path in the same world
    arr = np.full(3, RANK + 1.0)
    dist.all_reduce(arr)
    check(bool((arr == S).all()), f"numpy all_reduce {arr}")
    count = 9
    if WS > 1:
        nxt, prv = (RANK + 1) % WS, (RANK - 1) % WS
        for dt in (torch.float32, torch.bfloat16, torch.int64):
            rb = torch.empty(5, dtype=dt, device=d)
            ops = [
                dist.P2POp(dist.irecv, rb, prv),
                dist.P2POp(dist.isend, (torch.arange(5) + 10 * RANK).to(dt).to(d), nxt),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            same(rb, (torch.arange(5) + 10 * prv).to(dt), f"batch_isend_irecv ring {dt}")
        if RANK == 0:
            dist.send(torch.arange(4, dtype=torch.float32).to(d) + 7, dst=1, tag=3)
            got = torch.empty(4, 2, device=d)[:, 1]  # non-contiguous receive
            check(dist.recv(got, src=1, tag=4) == 1, "recv source")
            same(got, torch.arange(4, dtype=torch.float32) * 2, "recv into a non-contiguous tensor")
        elif RANK == 1:
            r = torch.empty(4, device=d)
            check(dist.recv(r, src=0, tag=3) == 0, "recv source")
            same(r, torch.arange(4, dtype=torch.float32) + 7, "recv")
            w = dist.isend(torch.arange(4, dtype=torch.float32).to(d) * 2, dst=0, tag=4)
            w.wait()
        try:
            dist.recv(torch.empty(1, device=d))
        except ConfigError as e:
            check("any source" in str(e), f"ANY_SOURCE: {e}")
        else:
            check(False, "a device recv from any source did not raise")
        count += 4
    return count


def subgroups(d: torch.device) -> int:
    """A subgroup's own torch group; destroyed and made again (same id, next generation) it works afresh."""
    count = 0
    for rep in range(2):
        sub = dist.new_group(list(range(0, WS, 2)) if WS > 1 else [0])
        if RANK % 2 == 0:
            t = torch.full((3,), float(RANK + rep), device=d)
            dist.all_reduce(t, group=sub)
            want = float(sum(r + rep for r in range(0, WS, 2)))
            same(t, torch.full((3,), want), f"subgroup all_reduce rep {rep}")
            count += 1
            dist.destroy_process_group(sub)
    t = torch.ones(2, device=d)
    dist.all_reduce(t)
    same(t, torch.full((2,), float(WS)), "world after subgroups")
    return count + 1


def scenario_collectives() -> None:
    """Every collective, closed forms (see the functions above)."""
    d = init()
    n = reductions(d) + movement(d) + shapes_and_async(d) + subgroups(d)
    dist.destroy_process_group()
    print(f"OK {n} checks on {d}")


def _times_out_at_two_seconds(d: Any) -> Tuple[float, Exception]:
    """An all_reduce with a 2 s deadline that the peer skips: DistTimeoutError naming the op, within 1.9-6 s."""
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2, device=d), timeout=2.0)
    except DistTimeoutError as e:
        took = time.monotonic() - t0
        check(1.9 <= took < 6.0, f"the deadline of 2 s fired after {took:.2f}s")
        check("all_reduce" in str(e), f"the error does not name the op: {e}")
        return took, e
    check(False, "no DistTimeoutError")
    raise AssertionError  # unreachable: check raised


def _stay_until_rank_0_reported() -> None:
    """Rank 1 stays alive, so that rank 0 times out (or sees the mismatch) rather than seeing a dead peer, until
    rank 0 has its error (it slept 8 s before, 6 s past the deadline); rank 0, which hosts the store, leaves once
    rank 1 has read that (2 ranks)."""
    store = dist.group.WORLD.world.store
    if RANK == 0:
        store.set("test/deadline_reported", b"1")
        store.wait(["test/deadline_seen"], timeout=30)
        return
    store.wait(["test/deadline_reported"], timeout=30)
    try:
        store.set("test/deadline_seen", b"1")
    except BrokenError:
        pass  # rank 0 exited as soon as it read the key, before the reply came: the end waited for


def scenario_deadline() -> None:
    """After one good call, rank 1 skips an all_reduce: rank 0 gets DistTimeoutError naming it at its deadline."""
    d = init(timeout=30)
    dist.all_reduce(torch.ones(2, device=d))
    if RANK == 0:
        took, e = _times_out_at_two_seconds(d)
        print(f"DEADLINE {took:.2f}s: {str(e)[:300]}")
    _stay_until_rank_0_reported()
    print("OK")
    os._exit(0)  # the group is broken (rank 0) and out of step: leave without a collective teardown


def scenario_first_deadline() -> None:
    """Rank 1 skips the group's first device call: rank 0 times out in the device check, naming the op."""
    d = init(timeout=30)
    if RANK == 0:
        _times_out_at_two_seconds(d)
    _stay_until_rank_0_reported()
    print("OK")
    os._exit(0)


def scenario_kill() -> None:
    """Rank 1 dies after one call: rank 0's next device call fails fast with PeerFailureError naming rank 1."""
    d = init(timeout=60)
    dist.all_reduce(torch.ones(2, device=d))
    dist.barrier()
    if RANK == 1:
        os._exit(9)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2, device=d))
    except ProcGroupError as e:
        took = time.monotonic() - t0
        check(took < 15.0, f"took {took:.2f}s")
        check("rank 1" in str(e), f"the error does not name rank 1: {type(e).__name__}: {e}")
        print(f"KILLED {took:.2f}s {type(e).__name__}: {str(e)[:300]}")
    else:
        check(False, "no error although rank 1 died")
    print("OK")
    os._exit(0)


def scenario_mismatch() -> None:
    """Rank 0 passes a numpy array where the others pass device tensors (argv: 'first' or 'later'): every rank
    gets CollectiveMismatchError, not a hang."""
    d = init(timeout=60)
    if sys.argv[2:] == ["later"]:
        dist.all_reduce(torch.ones(2, device=d))  # the group's torch group exists: the mismatch meets it
    t0 = time.monotonic()
    try:
        if RANK == 0:
            dist.all_reduce(np.ones(2, np.float32))
        else:
            dist.all_reduce(torch.ones(2, device=d))
    except CollectiveMismatchError as e:
        took = time.monotonic() - t0
        check(took < 20.0, f"took {took:.2f}s")
        check(f"device={d.type}" in str(e), f"the error does not show the device: {e}")
        print(f"MISMATCH {took:.2f}s: {str(e)[:400]}")
    else:
        check(False, "no CollectiveMismatchError")
    print("OK", flush=True)
    _stay_until_rank_0_reported()  # each rank saw the mismatch before any leaves (it slept 3 s before)
    os._exit(0)


def scenario_onedev() -> None:
    """Two ranks on one device: ConfigError naming both ranks, the device and the fix, on every rank."""
    if BACKEND == "nccl":
        torch.cuda.set_device(0)  # both ranks on cuda:0: what a script that forgot set_device(LOCAL_RANK) does
        dist.init_process_group(backend="nccl", timeout=60)
        d = torch.device("cuda", 0)
    else:
        import tests.backends.torch_gloo  # noqa: F401

        dist.init_process_group(backend="torch_gloo_onedev", timeout=60)
        d = torch.device("cpu")
    t0 = time.monotonic()
    for what in ("all_reduce", "send/recv"):
        try:
            if what == "all_reduce":
                dist.all_reduce(torch.ones(2, device=d))
            elif RANK == 0:
                dist.send(torch.ones(2, device=d), dst=1)
            elif RANK == 1:
                dist.recv(torch.ones(2, device=d), src=0)
            else:
                continue
        except ConfigError as e:
            msg = str(e)
            for part in ("ranks 0 and 1", "same GPU", "torch.cuda.set_device", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
                check(part in msg, f"{what}: {part!r} missing from: {msg}")
            check("Duplicate GPU" not in msg.split("(it would fail")[0], f"NCCL's raw error: {msg}")
            print(f"ONEDEV {what} {time.monotonic() - t0:.2f}s: {msg[:400]}")
        else:
            check(False, f"{what}: no ConfigError for two ranks on one device")
    # the group stays usable for CPU data
    a = np.ones(2)
    dist.all_reduce(a)
    check(bool((a == WS).all()), f"numpy after the device error: {a}")
    dist.destroy_process_group()
    print("OK")


def scenario_cpu_backend() -> None:
    """On the cpu backend a device tensor is the ConfigError naming the fix (backend='nccl'), on every op."""
    d = device() if DEV == "cuda" else torch.device("meta")
    dist.init_process_group(backend="cpu", timeout=60)
    t = torch.ones(3, device=d)
    for name, call in (
        ("all_reduce", lambda: dist.all_reduce(t)),
        ("broadcast", lambda: dist.broadcast(t, src=0)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.ones(3 * WS, device=d), t)),
    ):
        try:
            call()
        except ConfigError as e:
            check("the cpu backend takes CPU tensors" in str(e) and "backend='nccl'" in str(e), f"{name}: {e}")
        else:
            check(False, f"{name} of a {d.type} tensor on the cpu backend did not raise")
    dist.destroy_process_group()
    print("OK")


SCENARIOS = {
    "cpu_backend": scenario_cpu_backend,
    "collectives": scenario_collectives,
    "deadline": scenario_deadline,
    "first_deadline": scenario_first_deadline,
    "kill": scenario_kill,
    "mismatch": scenario_mismatch,
    "onedev": scenario_onedev,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
