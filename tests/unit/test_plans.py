"""Planned calls (procgroup.plans, issue 14 item 2): a repeated collective runs from its group's plan.

Ranks are threads over the in-memory transport (which has an arena, as shm does).  Every test checks
closed-form results on the second and later calls, which are the planned ones; ``spy`` counts the calls
that took the general path (``ProcessGroup.run``) instead.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import procgroup as dist
from procgroup import groupcore
from procgroup.algorithms import select
from procgroup.errors import ClosedError, ConfigError, DistTimeoutError, GroupBrokenError
from procgroup.ops import ReduceOp, reducer
from procgroup.process_group import ProcessGroup

from ..conftest import run_ranks, thread_world

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True, params=["compiled", "python"])
def run_plan_path(request, monkeypatch):
    """Every test on both paths of ProcessGroup.run_plan: the compiled one (procgroup.groupcore) and
    _run_plan_py."""
    if request.param == "python":
        monkeypatch.setattr(ProcessGroup, "run_plan", ProcessGroup._run_plan_py)
    elif not groupcore.COMPILED:
        pytest.skip("the _groupcore extension was not built")
    return request.param


DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
#: 0, 1, odd, and above the arena's 32 KiB slot for every dtype (planned calls there select per call)
SIZES = [0, 1, 7, 40000]


def spy(g: ProcessGroup) -> list:
    """Count the calls of ``g`` that take the general path (ProcessGroup.run)."""
    calls: list = []
    run = g.run

    def counting(op, *a, **k):
        calls.append(op)
        return run(op, *a, **k)

    g.run = counting  # type: ignore[method-assign]
    return calls


def contrib(r: int, n: int, dtype) -> np.ndarray:
    """Rank r's values: small, so that SUM and PRODUCT are exact in every dtype (ints wrap alike)."""
    if np.dtype(dtype) == np.bool_:
        return ((np.arange(n) + r) % 3 == 0).astype(np.bool_)
    return ((np.arange(n) % 3) + 1 + (r % 2)).astype(dtype)


def reference(op: ReduceOp, dtype, ws: int, n: int) -> np.ndarray:
    """``op`` over the ranks' contributions, in member order (as the algorithms reduce)."""
    if op is ReduceOp.AVG:
        total = reference(ReduceOp.SUM, dtype, ws, n)
        return (total / ws).astype(dtype)
    k = reducer(op, np.dtype(dtype))
    acc = contrib(0, n, dtype)
    for r in range(1, ws):
        k(acc, contrib(r, n, dtype))
    return acc


def _valid(op: ReduceOp, dtype) -> bool:
    try:
        reducer(op, np.dtype(dtype))
    except ConfigError:
        return False
    return True


def _same(got: np.ndarray, want: np.ndarray, op: ReduceOp) -> bool:
    if op is ReduceOp.AVG:
        return np.allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=1e-2)
    return np.array_equal(got, want)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_planned_all_reduce_every_dtype_op_and_size(ws):
    pgs = thread_world(ws)

    def body(r):
        g = pgs[r]
        slow = spy(g)
        for dtype in DTYPES:
            for op in ReduceOp:
                if not _valid(op, dtype):
                    continue
                for n in SIZES:
                    want = reference(op, dtype, ws, n)
                    for i in range(3):  # the first builds the plan, the others run from it (new buffers)
                        x = contrib(r, n, dtype)
                        before = len(slow)
                        dist.all_reduce(x, op=op, group=g)
                        assert _same(x, want, op), (dtype, op, n, i, x[:4], want[:4])
                        assert len(slow) == before + (1 if i == 0 else 0), (dtype, op, n, i)
        return g.seq

    seqs = run_ranks(ws, body, timeout=110)
    assert len(set(seqs)) == 1


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_planned_rooted_gather_and_barrier_every_root(ws):
    pgs = thread_world(ws)

    def body(r):
        g = pgs[r]
        slow = spy(g)
        for n in SIZES:
            for root in range(ws):
                for _ in range(2):
                    b = np.arange(n, dtype=np.int32) + 100 if r == root else np.full(n, -1, np.int32)
                    dist.broadcast(b, src=root, group=g)
                    assert np.array_equal(b, np.arange(n) + 100)
                    for op in (ReduceOp.SUM, ReduceOp.AVG):
                        x = contrib(r, n, np.float64)
                        dist.reduce(x, dst=root, op=op, group=g)
                        if r == root:
                            assert _same(x, reference(op, np.float64, ws, n), op)
            for _ in range(2):
                inp = np.full(n, r + 1, np.int64)
                out = np.zeros(n * ws, np.int64)
                dist.all_gather_into_tensor(out, inp, group=g)
                assert np.array_equal(out, np.repeat(np.arange(1, ws + 1), n))
                dist.barrier(group=g)
        # each distinct call shape went the general path once: 2 broadcasts + 2 reduces per root, one gather
        assert len(slow) == len(SIZES) * (3 * ws + 1) + 1, slow

    run_ranks(ws, body, timeout=110)


def test_plan_serves_a_reallocated_buffer_and_not_another_dtype_op_or_shape():
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        slow = spy(g)
        for _ in range(3):
            x = np.full(4, r + 1, np.float32)  # a new buffer each time, same shape and dtype
            dist.all_reduce(x, group=g)
            assert np.array_equal(x, [3, 3, 3, 3])
        assert slow == ["all_reduce"]
        x2 = np.full((2, 2), r + 1, np.float32)  # same element count, 2-D: same plan, flattened view
        dist.all_reduce(x2, group=g)
        assert np.array_equal(x2, np.full((2, 2), 3))
        y = np.full(4, r + 1, np.float64)
        dist.all_reduce(y, group=g)
        z = np.full(4, r + 1, np.float32)
        dist.all_reduce(z, op=dist.ReduceOp.MAX, group=g)
        w = np.full(5, r + 1, np.float32)
        dist.all_reduce(w, group=g)
        assert np.array_equal(y, [3] * 4) and np.array_equal(z, [2] * 4) and np.array_equal(w, [3] * 5)
        assert slow == ["all_reduce"] * 4 and len(g.plans) == 4
        ro = np.full(4, 1, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ConfigError, match="read-only"):
            dist.all_reduce(ro, group=g)  # the plan exists, but a read-only buffer still gets the error
        nc = np.full(8, r + 1, np.float32)[::2]  # non-contiguous: the general path copies back
        dist.all_reduce(nc, group=g)
        assert np.array_equal(nc, [3] * 4)

    run_ranks(2, body)


def test_destroyed_group_drops_its_plans_and_refuses_the_call():
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        x = np.ones(4, np.float32)
        dist.all_reduce(x, group=g)
        dist.barrier(group=g)
        assert g.plans
        g.close()
        assert not g.plans
        with pytest.raises(ClosedError, match="destroyed"):
            dist.all_reduce(x, group=g)
        with pytest.raises(ClosedError, match="destroyed"):
            dist.barrier(group=g)

    run_ranks(2, body)


def test_broken_group_refuses_a_planned_call():
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        x = np.ones(4, np.float32)
        dist.all_reduce(x, group=g)
        dist.all_reduce(x, group=g)
        seq = g.seq
        g.mark_broken(DistTimeoutError("injected"), "all_reduce", seq - 1)
        with pytest.raises(GroupBrokenError, match="broken since"):
            dist.all_reduce(x, group=g)
        assert g.seq == seq  # refused before a sequence number was taken

    run_ranks(2, body)


def test_reused_group_id_starts_without_plans_and_with_its_own_check_words():
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        sub = ProcessGroup(g.world, [0, 1], 5, "sub")
        x = np.ones(4, np.float32)
        dist.all_reduce(x, group=sub)
        dist.all_reduce(x, group=sub)
        old = next(iter(sub.plans.values()))
        sub.close()
        again = ProcessGroup(g.world, [0, 1], 5, "sub", gen=1)  # the id, reused
        assert not again.plans
        y = np.full(4, r + 1, np.float32)
        dist.all_reduce(y, group=again)
        dist.all_reduce(y, group=again)
        assert np.array_equal(y, [6] * 4)
        new = next(iter(again.plans.values()))
        assert new is not old and new.sig == old.sig and new.fpx != old.fpx  # the generation is in the tag

    run_ranks(2, body)


def test_a_mismatch_after_the_plans_are_warm_never_mixes_data():
    pgs = thread_world(2, timeout=1.5)

    def body(r):
        g = pgs[r]
        for _ in range(3):  # warm both shapes on both ranks
            dist.all_reduce(np.ones(4, np.float32), group=g)
            dist.all_reduce(np.ones(5, np.float32), group=g)
        assert len(g.plans) == 2
        x = np.full(4 if r == 0 else 5, r + 1, np.float32)
        with pytest.raises(DistTimeoutError) as e:
            dist.all_reduce(x, group=g)  # different counts: the check words differ, nobody completes
        assert "all_reduce(float32, %d, SUM)" % x.size in str(e.value)
        assert np.array_equal(x, np.full(x.size, r + 1))  # untouched, not a mixed-up sum
        with pytest.raises(GroupBrokenError):
            dist.all_reduce(x, group=g)

    run_ranks(2, body)


def test_general_path_for_force_async_timeout_and_foreign_threads(monkeypatch):
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        g.set_home_thread()
        slow = spy(g)
        x = np.ones(4, np.float32)
        dist.all_reduce(x, group=g)
        dist.all_reduce(x, group=g)
        assert slow == ["all_reduce"]
        dist.all_reduce(x, group=g, timeout=10)
        dist.all_reduce(x, group=g, async_op=True).wait()
        dist.all_reduce(x, group=g)  # after async work: the general path (it forgets the finished Work)
        t = threading.Thread(target=lambda: dist.all_reduce(np.ones(4, np.float32), group=g), name="w")
        t.start()
        t.join(30)
        assert len(slow) == 5, slow  # timeout=, async_op=, after async, the other thread (its name is signed)
        dist.all_reduce(x, group=g)
        assert len(slow) == 5, slow
        return x

    xs = run_ranks(2, body)
    assert np.array_equal(xs[0], [64] * 4)


def test_force_pins_an_algorithm_over_the_plans(monkeypatch):
    pgs = thread_world(2)
    spies = [spy(g) for g in pgs]

    def warm(r):
        x = np.ones(4, np.float32)
        dist.all_reduce(x, group=pgs[r])
        dist.all_reduce(x, group=pgs[r])

    run_ranks(2, warm)
    monkeypatch.setitem(select.FORCE, "all_reduce", "ring")
    run_ranks(2, warm)
    assert [len(s) for s in spies] == [3, 3]


def test_blocking_send_recv_without_a_work_keep_their_errors():
    """send/recv wait on the request directly (no Work): same results, same error context, group broken after."""
    pgs = thread_world(2, timeout=0.5)

    def body(r):
        g = pgs[r]
        x = np.full(4, r, np.float32)
        for _ in range(3):
            if r == 0:
                dist.send(x, dst=1, group=g)
                assert dist.recv(x, src=1, group=g) == 1
            else:
                assert dist.recv(x, group=g) == 0
                dist.send(x, dst=0, group=g)
        assert np.array_equal(x, [0] * 4)
        dist.barrier(group=g)
        if r == 0:
            with pytest.raises(DistTimeoutError) as e:
                dist.recv(x, src=1, tag=7, group=g)  # rank 1 never sends
            assert "recv" in str(e.value) and "from rank 1, tag 7, float32[4]" in str(e.value)
            with pytest.raises(GroupBrokenError):
                dist.recv(x, src=1, tag=8, group=g)

    run_ranks(2, body)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_planned_reduce_scatter_and_all_to_all_single(ws):
    pgs = thread_world(ws)

    def body(r):
        g = pgs[r]
        slow = spy(g)
        shapes = 0
        for n in SIZES:
            for dtype in (np.int32, np.float64, np.complex64):
                for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG):
                    if not _valid(op, dtype):
                        continue
                    shapes += 1
                    want = reference(op, dtype, ws, n * ws)[r * n : (r + 1) * n]
                    for _ in range(3):
                        out = np.zeros(n, dtype)
                        dist.reduce_scatter_tensor(out, contrib(r, n * ws, dtype), op=op, group=g)
                        assert _same(out, want, op), (n, dtype, op)
            shapes += 1
            for _ in range(3):
                inp = (np.arange(n * ws, dtype=np.int64) + 1000 * r).reshape(ws, n)
                out = np.zeros((ws, n), np.int64)
                dist.all_to_all_single(out, inp, group=g)
                want = np.stack([np.arange(r * n, (r + 1) * n) + 1000 * s for s in range(ws)])
                assert np.array_equal(out, want)
        assert len(slow) == shapes, (len(slow), shapes)

    run_ranks(ws, body, timeout=110)


def test_each_planned_call_gets_its_own_full_deadline():
    """run_plan resets one Deadline per group per call: warm calls spread over several timeouts all complete,
    and a missing peer times out one timeout after its own call began, naming that elapsed time."""
    pgs = thread_world(2, timeout=0.4)
    errors: list = []

    def body(r):
        g = pgs[r]
        x = np.ones(4, np.float32)
        calls = spy(g)
        for _ in range(8):  # 8 x 0.1 s: twice the timeout in all, each call well within its own
            dist.all_reduce(x, group=g)
            time.sleep(0.1)
        assert calls == ["all_reduce"], calls  # the first call built the plan, the others ran from it
        if r == 0:
            t0 = time.monotonic()
            with pytest.raises(DistTimeoutError) as ei:
                dist.all_reduce(x, group=g)  # rank 1 never joins
            waited = time.monotonic() - t0
            errors.append((waited, str(ei.value)))

    run_ranks(2, body)
    ((waited, msg),) = errors
    assert 0.35 < waited < 2.0, waited
    assert "0.4" in msg, msg  # the deadline named is this call's own


@pytest.mark.parametrize("ws", [2, 3])
def test_torch_tensors_run_the_plans_and_bfloat16_never_shares_uint16s(ws):
    """A plain CPU torch tensor runs the planned path of all_reduce, broadcast and reduce (a numpy view of its
    memory, the same plan as a numpy array of its dtype and size); bfloat16 travels as its bytes (a uint16 view),
    so it keeps the general path: a uint16 array's plan must never reduce its bits as integers."""
    torch = pytest.importorskip("torch")
    pgs = thread_world(ws)
    tdt = {np.int32: torch.int32, np.int64: torch.int64, np.float16: torch.float16, np.float32: torch.float32}

    def body(r):
        g = pgs[r]
        slow = spy(g)
        for dtype, tt in tdt.items():
            for n in (1, 7, 40000):
                want = reference(ReduceOp.SUM, dtype, ws, n)
                for i in range(3):  # numpy first, then tensors: the tensors reuse the array's plan
                    x = contrib(r, n, dtype)
                    t = torch.from_numpy(contrib(r, n, dtype).copy())
                    before = len(slow)
                    dist.all_reduce(x, group=g)
                    dist.all_reduce(t, group=g)
                    assert np.array_equal(x, want) and np.array_equal(t.numpy(), want), (dtype, n, i)
                    assert len(slow) == before + (1 if i == 0 else 0), (dtype, n, i)
                for root in range(ws):
                    for i in range(2):
                        t = torch.full((n,), float(r + 1)).to(tt)
                        dist.broadcast(t, src=root, group=g)
                        assert bool((t == root + 1).all()), (dtype, n, root, i)
                        t = torch.full((n,), float(r + 1)).to(tt)
                        dist.reduce(t, dst=root, group=g)
                        if r == root:
                            assert bool((t == ws * (ws + 1) // 2).all()), (dtype, n, root, i)
        # bfloat16 after a warm uint16 plan of the same size: 1.5 + 2.5 + ... in bfloat16, not the bits' sum
        u = np.full(5, 7, np.uint16)
        for _ in range(2):
            dist.all_reduce(u.copy(), group=g)
        b = torch.full((5,), 1.5 + r, dtype=torch.bfloat16)
        dist.all_reduce(b, group=g)
        want = sum(1.5 + k for k in range(ws))
        assert b.to(torch.float32).tolist() == [want] * 5, b
        # a non-contiguous tensor keeps the general path and is right
        m = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
        dist.all_reduce(m, group=g)
        assert torch.equal(m, ws * torch.arange(12, dtype=torch.float32).reshape(3, 4).t())

    run_ranks(ws, body, timeout=110)


def test_a_group_keeps_at_most_29_instance_attributes():
    """CPython 3.11 keeps an object's attributes in its fast inline layout only up to 29 of them; a ProcessGroup
    past that reads and writes each one ~3 ns slower, ~20 times per planned call (see the class's defaults)."""
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        g.set_home_thread()
        x = np.ones(1, np.float32)
        dist.all_reduce(x, group=g, async_op=True).wait()  # the async worker, made on first use
        if r == 0:
            dist.send(x, 1, group=g)
        else:
            dist.recv(x, 0, group=g)
        for _ in range(3):  # planned from the second call on
            dist.all_reduce(x, group=g)
            dist.broadcast(x, 0, group=g)
            dist.reduce(x, 0, group=g)
            dist.barrier(group=g)
        return sorted(vars(g))

    for names in run_ranks(2, body, timeout=60):
        assert len(names) <= 29, (len(names), names)
