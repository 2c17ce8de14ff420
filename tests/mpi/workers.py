"""Worker programs of the mpi backend's tests: ``mpirun -np N python -m tests.mpi.workers NAME [args]``.

The cpu backend's reference workers (``tests/integration/workers.py``: every collective x every root x
dtypes x sizes 0, 1, 7, 1000 against closed forms, 64 MiB, any-source p2p, objects, subgroups) run here
unchanged, with ``init_process_group()`` defaulting to backend="mpi".  The extra cases cover what MPI lacks
(AVG, bfloat16, float16, bool, NaN under MIN/MAX), compared with the cpu backend's own reduction kernels.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import procgroup as dist
from procgroup.ops import ReduceOp, bfloat16_to_float32, float32_to_bfloat16, reducer

from ..integration import workers as ref

_init = dist.init_process_group


def _init_mpi(backend=None, *args, **kwargs):
    """init_process_group with backend="mpi" unless another one is named."""
    return _init("mpi" if backend is None else backend, *args, **kwargs)


dist.init_process_group = _init_mpi  # the reference workers call dist.init_process_group()


def _expected(op: ReduceOp, parts: list, dtype) -> np.ndarray:
    """What the cpu backend computes: its kernel applied rank by rank, AVG divided once."""
    acc = parts[0].copy()
    k = reducer(op, dtype)
    for p in parts[1:]:
        k(acc, p)
    if op is ReduceOp.AVG:
        if dtype == "bfloat16":
            acc = float32_to_bfloat16(bfloat16_to_float32(acc) / np.float32(len(parts)))
        else:
            acc = (acc / len(parts)).astype(acc.dtype)
    return acc


def _contrib(r: int, n: int, dtype):
    base = (r + 1) * (np.arange(n) % 5 + 1)
    if dtype == "bfloat16":
        return float32_to_bfloat16(base.astype(np.float32))
    if dtype == "bool":
        return (base + r) % 3 == 0
    return base.astype(dtype)


def _tensor(a: np.ndarray, dtype):
    """A copy of ``a``; for bfloat16 a torch bfloat16 tensor holding the bits (procgroup sees "bfloat16")."""
    if dtype != "bfloat16":
        return a.copy()
    import torch

    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)


def _bits(x, dtype) -> np.ndarray:
    return x.view(__import__("torch").int16).numpy().view(np.uint16) if dtype == "bfloat16" else x


def extras() -> None:
    """AVG, PRODUCT, bool, float16, bfloat16 and NaN under MIN/MAX, in the world and in a subgroup."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    count = 0
    cases = [
        ("float32", ReduceOp.AVG),
        ("float64", ReduceOp.AVG),
        ("float16", ReduceOp.AVG),
        ("float16", ReduceOp.SUM),
        ("bfloat16", ReduceOp.SUM),
        ("bfloat16", ReduceOp.AVG),
        ("bfloat16", ReduceOp.MAX),
        ("int32", ReduceOp.PRODUCT),
        ("int64", ReduceOp.BAND),
        ("uint8", ReduceOp.BOR),
        ("bool", ReduceOp.SUM),
        ("bool", ReduceOp.MIN),
        ("complex64", ReduceOp.AVG),
        ("float32", ReduceOp.MAX),
    ]
    groups = [None]
    if ws > 2:
        groups.append(dist.new_group(list(range(1, ws))))
    for grp in groups:
        members = list(range(ws)) if grp is None else list(range(1, ws))
        if r not in members:
            continue
        for dtype, op in cases:
            for n in (0, 1, 7, 1000):
                parts = [_contrib(q, n, dtype) for q in members]
                if dtype == "float32" and op is ReduceOp.MAX and n:
                    parts[-1][0] = np.nan  # numpy (and the cpu backend) propagate NaN
                x = _tensor(parts[members.index(r)], dtype)
                dist.all_reduce(x, op=op, group=grp)
                want = _expected(op, parts, dtype)
                got = _bits(x, dtype)
                ref.check(
                    np.array_equal(got, want, equal_nan=True), f"all_reduce {op.name} {dtype} n={n}: {got} != {want}"
                )
                if dtype not in ("bfloat16", "bool"):
                    y = parts[members.index(r)].copy()
                    dist.reduce(y, dst=members[-1], op=op, group=grp)
                    if r == members[-1]:
                        ref.check(np.array_equal(y, want, equal_nan=True), f"reduce {op.name} {dtype} n={n}")
                    out = np.zeros(n, parts[0].dtype)
                    inp = [_contrib(q, n * len(members), dtype) for q in members]
                    want_rs = _expected(op, inp, dtype)
                    dist.reduce_scatter_tensor(out, inp[members.index(r)].copy(), op=op, group=grp)
                    i = members.index(r)
                    ref.check(
                        np.array_equal(out, want_rs[i * n : (i + 1) * n], equal_nan=True),
                        f"reduce_scatter {op.name} {dtype} n={n}",
                    )
                count += 1
    # torch-style p2p in a subgroup and with tags beyond MPI's tag space (the transport's path)
    if ws >= 2:
        for tag in (0, 5, (1 << 39) + 3):
            if r == 0:
                dist.send(np.full(4, tag % 1000, np.int64), dst=1, tag=tag)
            elif r == 1:
                z = np.zeros(4, np.int64)
                src = dist.recv(z, tag=tag)
                ref.check(src == 0 and np.all(z == tag % 1000), f"p2p tag={tag}: {src} {z}")
        count += 1
    dist.barrier()
    print(f"rank {r}: {count} extra checks passed", flush=True)
    dist.destroy_process_group()


def kill_mid(victim: str = "1") -> None:
    """Every rank loops over 1 MiB all_reduces; the victim SIGKILLs itself in the middle of one.

    Survivors must raise naming the victim; each prints 'survivor R: <seconds> <error>' and exits 7.
    """
    dist.init_process_group(timeout=20)
    r = dist.get_rank()
    v = int(victim)
    x = np.ones(1 << 18, np.float32)
    for _ in range(5):
        dist.all_reduce(x)
    t0 = time.monotonic()
    try:
        i = 0
        while True:
            if r == v and i == 3:
                w = dist.all_reduce(x, async_op=True)  # the victim dies with the collective posted
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
                w.wait()
            t0 = time.monotonic()
            dist.all_reduce(x)
            i += 1
    except dist.ProcGroupError as e:
        print(f"survivor {r}: {time.monotonic() - t0:.2f}s {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


def raise_mid(victim: str = "1") -> None:
    """The victim raises an unhandled exception between collectives; the others must not hang."""
    dist.init_process_group(timeout=60)
    r = dist.get_rank()
    x = np.ones(16, np.float32)
    dist.all_reduce(x)
    if r == int(victim):
        raise RuntimeError("the victim's own bug")
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except dist.ProcGroupError as e:
        print(f"survivor {r}: {time.monotonic() - t0:.2f}s {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


def transport_conformance() -> None:
    """The Transport semantics (tests/unit/test_transport_conformance.py), SPMD over the MPI transport.

    That suite runs ranks as threads of one process, which MPI cannot; the same cases run here with one
    MPI process per rank (3 or more), each against the world's MpiTransport.
    """
    import threading

    from procgroup.deadline import Deadline
    from procgroup.errors import ClosedError, DistTimeoutError, PeerFailureError, ProcGroupError
    from procgroup.state import _state
    from procgroup.transport.base import ANY_SOURCE

    dist.init_process_group(timeout=60)
    t = _state.default.world.transport
    r, ws = t.rank, t.world_size
    ref.check(t.kind == "mpi" and ws >= 3, f"transport {t.kind} at world size {ws}")

    def dl(s: float = 30.0) -> Deadline:
        return Deadline.after(s)

    def sync() -> None:
        dist.barrier()

    tag = 77
    # send/recv, every size around the eager limit and the 64 MiB case
    for size in (0, 1, 3, 4095, 16 << 10, (16 << 10) + 1, 65537, (1 << 20) + 13, 64 << 20):
        data = (np.arange(size) % 251).astype(np.uint8)
        if r == 0:
            t.send(1, tag, data, dl())
        elif r == 1:
            out = np.zeros(size + 7, np.uint8)
            st = t.recv(0, tag, out, dl())
            ref.check(st.source == 0 and st.nbytes == size and np.array_equal(out[:size], data), f"size {size}")
    sync()
    # non-overtaking, receives posted first and messages arriving first, eager and large mixed
    for post_first in (True, False):
        n = 40
        sizes = [100 + i if i % 5 else (20 << 10) + i for i in range(n)]
        if r == 1:
            outs = [np.zeros(sizes[i] + 10, np.uint8) for i in range(n)]
            if not post_first:
                time.sleep(0.2)
            reqs = [t.irecv(0, tag, o) for o in outs]
            if post_first:
                sync()
            got = [(q.wait(dl()).nbytes, int(o[0])) for q, o in zip(reqs, outs)]
            ref.check(got == [(sizes[i], i) for i in range(n)], f"non-overtaking post_first={post_first}")
        else:
            if post_first:
                sync()
            if r == 0:
                reqs = [t.isend(1, tag, np.full(sizes[i], i, np.uint8)) for i in range(n)]
                for q in reqs:
                    q.wait(dl())
        sync()
    # tags are independent: B arrives although a large A was sent first and is received second
    big = (np.arange(6 << 20) % 253).astype(np.uint8)
    if r == 0:
        ra, rb = t.isend(1, 1, big), t.isend(1, 2, b"B")
        rb.wait(dl())
        ra.wait(dl())
    elif r == 1:
        ob = bytearray(1)
        t.recv(0, 2, ob, dl())
        oa = np.zeros_like(big)
        t.recv(0, 1, oa, dl())
        ref.check(bytes(ob) == b"B" and np.array_equal(oa, big), "tags independent")
    sync()
    # any source returns the sender; it includes self
    mine = t.isend(0, tag, np.full(8, r, np.uint8))
    if r == 0:
        got = []
        for _ in range(ws):
            out = np.zeros(8, np.uint8)
            st = t.recv(ANY_SOURCE, tag, out, dl())
            ref.check(bool((out == st.source).all()), "any-source payload")
            got.append(st.source)
        ref.check(sorted(got) == list(range(ws)), f"any-source senders {got}")
    mine.wait(dl())
    sync()
    # a message too big for the buffer is an error naming both sizes, and is consumed (eager and large)
    for size in (100, 100 << 10):
        if r == 0:
            t.send(1, tag, b"x" * size, dl())
            t.send(1, tag, b"ok", dl())
        elif r == 1:
            try:
                t.recv(0, tag, bytearray(10), dl())
                ref.check(False, "oversize message accepted")
            except DistTimeoutError:
                ref.check(False, "oversize message timed out")
            except ProcGroupError as e:
                ref.check(str(size) in str(e) and "10" in str(e), f"oversize message error: {e}")
            out = bytearray(10)
            st = t.recv(0, tag, out, dl())
            ref.check(bytes(out[: st.nbytes]) == b"ok", "transport works after an oversize message")
        sync()
    # timeout, then wait again
    if r == 1:
        out = bytearray(4)
        req = t.irecv(0, tag, out)
        t0 = time.monotonic()
        try:
            req.wait(Deadline.after(0.2))
            ref.check(False, "no timeout")
        except DistTimeoutError as e:
            ref.check(0.15 <= time.monotonic() - t0 < 5 and "rank 0" in str(e), f"timeout: {e}")
        ref.check(not req.test(), "still pending")
        sync()
        st = req.wait(dl())
        ref.check(st.source == 0 and bytes(out) == b"late" and req.wait() == st, "late message")
    else:
        sync()
        if r == 0:
            t.send(1, tag, b"late", dl())
    sync()
    # self send (unexpected and posted), polling with test()
    out = bytearray(6)
    t.send(r, tag, b"before", dl())
    ref.check(t.recv(r, tag, out, dl()).source == r and bytes(out) == b"before", "self send")
    req = t.irecv(r, tag, out)
    t.isend(r, tag, b"after!").wait(dl())
    ref.check(req.wait(dl()).nbytes == 6 and bytes(out) == b"after!", "self send posted")
    # two threads of one rank wait at once
    if r in (0, 1):
        peer = 1 - r
        res: list = []

        def side(k: int) -> None:
            o = bytearray(1)
            t.recv(peer, 1000 + k, o, dl())
            res.append(o[0])

        ths = [threading.Thread(target=side, args=(k,)) for k in range(2)]
        for th in ths:
            th.start()
        for k in (1, 0):
            t.send(peer, 1000 + k, bytes([k]), dl())
        for th in ths:
            th.join(30)
        ref.check(sorted(res) == [0, 1], f"two threads {res}")
    sync()
    print(f"rank {r}: transport conformance ok", flush=True)
    # the last two cases change the world for good (a peer marked dead, a closed transport): no collective after
    # mark_peer_failed: receives from it (and any-source ones) fail, sends to it fail
    if r == 2:
        req = t.irecv(0, 4242, bytearray(4))
        anyreq = t.irecv(ANY_SOURCE, 4243, bytearray(4))
        t.mark_peer_failed(0, "declared dead by the test")
        for q in (req, anyreq):
            try:
                q.wait(dl(5))
                ref.check(False, "no peer failure")
            except PeerFailureError as e:
                ref.check(e.peer == 0 and "declared dead by the test" in str(e), f"peer failure: {e}")
        try:
            t.isend(0, tag, b"x").wait(dl(5))
            ref.check(False, "send to a failed peer")
        except PeerFailureError:
            pass
        print(f"rank {r}: mark_peer_failed ok", flush=True)
    # close fails pending waits (rank 1, at the very end: its transport is gone afterwards)
    if r == 1:
        req = t.irecv(0, 999, bytearray(4))
        errs: list = []

        def waiter() -> None:
            try:
                req.wait(dl(10))
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.1)
        t.close()
        th.join(10)
        ref.check(len(errs) == 1 and isinstance(errs[0], ClosedError), f"close: {errs}")
        for fn in (lambda: t.isend(0, tag, b"x"), lambda: t.irecv(0, tag, bytearray(1))):
            try:
                fn()
                ref.check(False, "usable after close")
            except ClosedError:
                pass
        t.close()
        print(f"rank {r}: close ok", flush=True)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # every rank waits for rank 1's close test (its transport is gone now)
    MPI.Finalize()
    os._exit(0)  # skip destroy_process_group's exit handshake, which rank 1's closed transport cannot do


def p2p_dtype() -> None:
    """Issue 11 item 15 under MPI: float32 sent, int32 received is a ConfigError on the receiver, through the
    engine's MPI tags (small user tag) and through the transport's envelopes (a tag too big for MPI's)."""
    dist.init_process_group()
    r = dist.get_rank()
    for tag in (3, 2**30 + 3):
        if r == 0:
            dist.send(np.arange(4, dtype=np.float32), dst=1, tag=tag)
            dist.send(np.arange(4, dtype=np.int32), dst=1, tag=tag + 1)
        elif r == 1:
            out = np.zeros(4, np.int32)
            t0 = time.monotonic()
            try:
                dist.recv(out, src=0, tag=tag)
            except dist.ConfigError as e:
                assert "as float32" in str(e) and "(int32)" in str(e) and "rank 0" in str(e), e
            else:
                raise AssertionError(f"float32 received into int32 without an error: {out}")
            dt = time.monotonic() - t0
            dist.recv(out, src=0, tag=tag + 1)  # the same dtype on both sides still works, same values
            assert out.tolist() == [0, 1, 2, 3], out
            print(f"rank 1: tag {tag}: mismatch raised in {dt * 1000:.1f} ms", flush=True)
    x = np.ones(2, np.int64)
    dist.all_reduce(x)
    assert x.tolist() == [dist.get_world_size()] * 2, x
    print(f"rank {r}: p2p dtype ok", flush=True)
    dist.destroy_process_group()


def p2p_blocking() -> None:
    """Blocking send/recv of plain numpy arrays on backend="mpi" (its fast path: MPI_Isend/Irecv tested at
    once, else the request waited on): ranks 0 and 1 ping-pong every dtype at sizes 0, 1, 7 and 65537
    elements (rank 1 echoes x + 1), then messages that arrive 50 ms late (the quick tests miss them: the
    returned request is waited on), with closed-form checks; the routes of the blocking calls must be the
    engine's fast path."""
    dist.init_process_group()
    assert dist.get_backend() == "mpi", dist.get_backend()
    r = dist.get_rank()
    from procgroup.state import _state

    dtypes = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64"]
    late = 0
    for dt in dtypes:
        for n in (0, 1, 7, 65537):
            base = (np.arange(n) % 3).astype(dt)
            want = (base + 1).astype(dt) if dt != "bool" else np.ones(n, dt)
            if r == 0:
                dist.send(base, dst=1, tag=n % 7)
                y = np.zeros(n, dt)
                assert dist.recv(y, src=1, tag=n % 7) == 1
                assert (y == want).all(), (dt, n, y[:8])
            elif r == 1:
                x = np.zeros(n, dt)
                assert dist.recv(x, src=0, tag=n % 7) == 0
                assert (x == base).all(), (dt, n, x[:8])
                dist.send(want, dst=0, tag=n % 7)
    for i in range(3):  # late: the receiver's quick tests miss the message, it waits on the request
        if r == 0:
            time.sleep(0.05)
            dist.send(np.full(1000, i, np.int32), dst=1, tag=5)
        elif r == 1:
            z = np.zeros(1000, np.int32)
            t0 = time.monotonic()
            assert dist.recv(z, src=0, tag=5) == 0
            late += time.monotonic() - t0 > 0.03
            assert (z == i).all(), z[:4]
    if r < 2:
        routes = _state.default.p2p_routes
        kinds = {type(fast).__name__ for (_peer, _ptag, fast, _checks) in routes.values()}
        assert kinds == {"partial"}, (kinds, routes)
    if r == 1:
        assert late >= 2, late
    dist.barrier()
    print(f"rank {r}: p2p blocking ok", flush=True)
    dist.destroy_process_group()


def gid_wrap() -> None:
    """Issue 11 item 4 under MPI (N=3): after a destroyed group, new groups over other ranks never find its
    communicator (ids are not reused under this backend: each new group gets a fresh one)."""
    dist.init_process_group()
    r = dist.get_rank()
    seen = set()
    for i in range(20):
        first = dist.new_group([0, 1])
        if r in (0, 1):
            x = np.ones(1, np.int64)
            dist.all_reduce(x, group=first)
            assert x[0] == 2, x
            seen.add(first.gid)
            dist.destroy_process_group(first)
        dist.barrier()
        for ranks in ([1, 2], [0, 1, 2]):
            again = dist.new_group(ranks)
            if r in ranks:
                assert again.gid not in seen, (i, again.gid, seen)
                x = np.full(1, r, np.int64)
                dist.all_reduce(x, group=again)
                assert x[0] == sum(ranks), (i, ranks, x)
                seen.add(again.gid)
                dist.destroy_process_group(again)
            dist.barrier()
    x = np.ones(1, np.int64)
    dist.all_reduce(x)
    assert x[0] == 3, x
    print(f"rank {r}: gid wrap ok", flush=True)
    dist.destroy_process_group()


def own_comms() -> None:
    """Every collective, each call shape three times (checked, checked, then on its own communicator), with
    closed-form results; more shapes than a group dedicates (the rest stay checked)."""
    from procgroup.backends.mpi.engine import DEDICATED_PER_GROUP
    from procgroup.state import _state

    dist.init_process_group(timeout=60)
    r, n = dist.get_rank(), dist.get_world_size()
    eng = _state.world.engine
    groups = []

    def fresh():
        g = dist.new_group(list(range(n)))
        groups.append(g)
        return g

    def same(got, want, what):
        ok = np.allclose(got, want, rtol=1e-5) if got.dtype.kind in "fc" else np.array_equal(got, want)
        assert ok and got.shape == want.shape, (what, got, want)

    g = fresh()
    for dt in ("int32", "int64", "uint8", "float32", "float64"):
        ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX]
        ops += [ReduceOp.AVG] if dt.startswith("float") else [ReduceOp.BXOR, ReduceOp.MIN]
        for op in ops:
            for size in (0, 1, 7):
                want = _expected(op, [_contrib(q, size, dt) for q in range(n)], dt)
                for _ in range(3):
                    x = _contrib(r, size, dt)
                    dist.all_reduce(x, op, group=g)
                    same(x, want, ("all_reduce", dt, op, size))
    g = fresh()
    for root in range(n):
        for size in (0, 1, 7):
            want_b = _contrib(root, size, "float64")
            want_r = _expected(ReduceOp.SUM, [_contrib(q, size, "int64") for q in range(n)], "int64")
            for _ in range(3):
                x = _contrib(r, size, "float64")
                dist.broadcast(x, root, group=g)
                same(x, want_b, ("broadcast", root, size))
                y = _contrib(r, size, "int64")
                dist.reduce(y, root, group=g)
                if r == root:
                    same(y, want_r, ("reduce", root, size))
    g = fresh()
    for size in (0, 1, 7):
        parts = [_contrib(q, size, "int32") for q in range(n)]
        for _ in range(3):
            out = np.empty(size * n, np.int32)
            dist.all_gather_into_tensor(out, _contrib(r, size, "int32"), group=g)
            same(out, np.concatenate(parts), ("all_gather", size))
            full = [_contrib(q, size * n, "int32") for q in range(n)]
            rs = np.empty(size, np.int32)
            dist.reduce_scatter_tensor(rs, _contrib(r, size * n, "int32"), group=g)
            same(rs, sum(full)[r * size : (r + 1) * size], ("reduce_scatter", size))
            a2a = np.empty(size * n, np.int32)
            dist.all_to_all_single(a2a, _contrib(r, size * n, "int32") + 1000 * r, group=g)
            sent = [_contrib(q, size * n, "int32") + 1000 * q for q in range(n)]
            want = np.concatenate([s[r * size : (r + 1) * size] for s in sent])
            same(a2a, want, ("all_to_all", size))
            for root in range(n):
                gl = [np.empty(size, np.int32) for _ in range(n)] if r == root else None
                dist.gather(_contrib(r, size, "int32"), gl, root, group=g)
                if r == root:
                    for q in range(n):
                        same(gl[q], parts[q], ("gather", root, size))
                sc = np.empty(size, np.int32)
                sl = [_contrib(q, size, "int32") for q in range(n)] if r == root else None
                dist.scatter(sc, sl, root, group=g)
                same(sc, parts[r], ("scatter", root, size))
            dist.barrier(group=g)
    for _ in range(3):
        dist.barrier()
    for g in [dist.group.WORLD, *groups]:
        own = eng._own.get(g.gid) or {}
        assert 0 < len(own) <= DEDICATED_PER_GROUP, (g.gid, len(own))
    counts = [len(eng._own.get(g.gid) or {}) for g in groups]
    for g in groups:  # their communicators are freed; the world's go on
        dist.destroy_process_group(g)
        assert g.gid not in eng._own, g.gid
    for _ in range(3):
        x = np.full(2, r, np.int64)
        dist.all_reduce(x)
        assert x.tolist() == [n * (n - 1) // 2] * 2, x
    print(f"rank {r}: own comms ok ({counts})", flush=True)
    dist.destroy_process_group()


def _warm_split_plans(x: np.ndarray, out: np.ndarray) -> None:
    """Run every split collective three times on the default group (the third on its shape's own
    communicator) and check that each plan posts before run_plan's bookkeeping (Plan.post/done)."""
    for _ in range(3):
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        dist.reduce(x, 0)
        dist.all_gather_into_tensor(out, x)
        dist.barrier()
    plans = dist.group.WORLD.plans
    assert len(plans) == 5 and all(p.post is not None and p.done is not None for p in plans.values()), plans


def split_values() -> None:
    """Every dtype x reduce op x sizes 0, 1, 7, every root, warm (run_plan's split: posted first, on the shape's
    own communicator): closed-form results; checks that each warm shape MPI computes took the split."""
    from procgroup.backends.mpi import engine

    engine.DEDICATED_PER_GROUP = 256  # every shape of this test gets its own communicator (and the split)
    dist.init_process_group(timeout=60)
    r, n = dist.get_rank(), dist.get_world_size()
    ints = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
    everything = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.BAND, ReduceOp.BOR]
    kinds = {dt: everything + [ReduceOp.BXOR] for dt in ints}
    floats = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.AVG]
    kinds.update({dt: floats for dt in ("float32", "float64")})
    kinds.update({dt: [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG] for dt in ("complex64", "complex128")})
    checks = splits = 0

    def same(got, want, what):
        ok = np.allclose(got, want, rtol=1e-5) if got.dtype.kind in "fc" else np.array_equal(got, want)
        assert ok and got.shape == want.shape, (what, got, want)

    for dt, ops in kinds.items():
        g = dist.new_group(list(range(n)))  # one per dtype: its shapes' communicators are freed with it
        for size in (0, 1, 7):
            for op in ops:
                want = _expected(op, [_contrib(q, size, dt) for q in range(n)], dt)
                for root in range(n):
                    for _ in range(3):
                        x = _contrib(r, size, dt)
                        dist.reduce(x, root, op, group=g)
                        if r == root:
                            same(x, want, ("reduce", dt, op, size, root))
                            checks += 1
                for _ in range(3):
                    x = _contrib(r, size, dt)
                    dist.all_reduce(x, op, group=g)
                    same(x, want, ("all_reduce", dt, op, size))
                    checks += 1
            for root in range(n):
                for _ in range(3):
                    x = _contrib(r, size, dt)
                    dist.broadcast(x, root, group=g)
                    same(x, _contrib(root, size, dt), ("broadcast", dt, size, root))
                    checks += 1
            for _ in range(3):
                out = np.zeros(size * n, dt)
                dist.all_gather_into_tensor(out, _contrib(r, size, dt), group=g)
                same(out, np.concatenate([_contrib(q, size, dt) for q in range(n)]), ("all_gather", dt, size))
                dist.barrier(group=g)
                checks += 1
        own = _state_engine().own(g.gid)
        for p in g.plans.values():
            if p.post is not None:
                assert p.fpx in own, p
                splits += 1
            else:  # what MPI computes differently, and AVG, run the full path
                assert "AVG" in p.sig or (dt.startswith("float") and ("MIN" in p.sig or "MAX" in p.sig)), p
        dist.destroy_process_group(g)
    assert splits, "no call shape took the split"
    print(f"rank {r}: split values ok ({checks} checks, {splits} split shapes)", flush=True)
    dist.destroy_process_group()


def _state_engine():
    from procgroup.state import _state

    return _state.world.engine


def split_faults(kind: str) -> None:
    """A warm call shape posts its MPI operation first (run_plan's split); the guarantees still hold there.

    ``deadline``: rank 1 never joins an all_reduce: rank 0 raises DistTimeoutError at the group's deadline,
    the call's flight record says failed, and the next call raises GroupBrokenError at once.
    ``mpi_error``: the post itself fails in MPI (every rank): BrokenError naming MPI_Iallreduce, recorded as
    failed, and the group refuses the next call.  ``test_error``: the same when the request's ``Test`` (which
    run_plan calls inline, then the engine's done) fails in MPI."""
    from mpi4py import MPI

    from procgroup.errors import BrokenError, DistTimeoutError, GroupBrokenError
    from procgroup.state import _state

    dist.init_process_group(timeout=3)
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.zeros(1, np.float32)
    out = np.zeros(n, np.float32)
    _warm_split_plans(x, out)
    g = dist.group.WORLD
    side = MPI.COMM_WORLD.Dup() if kind == "deadline" else None  # the test's own channel, beside procgroup's
    t0 = time.monotonic()
    if kind == "deadline":
        if r == 1:  # stays out until rank 0 has its errors (it slept 8 s before, 5 s past the 3 s deadline)
            stop = time.monotonic() + 30
            while not side.Iprobe(source=0, tag=7) and time.monotonic() < stop:
                time.sleep(0.01)
            if side.Iprobe(source=0, tag=7):
                side.recv(source=0, tag=7)
            return
        try:
            dist.all_reduce(x)
        except DistTimeoutError as e:
            took = time.monotonic() - t0
            assert g.flight[-1].state == "failed" and g.flight[-1].op == "all_reduce", g.flight[-1]
            t1 = time.monotonic()
            try:
                dist.all_reduce(x)
            except GroupBrokenError:
                print(f"rank 0: deadline after {took:.2f}s, then broken after {time.monotonic() - t1:.3f}s: {e}")
                side.send(None, dest=1, tag=7)
                sys.exit(4)
        raise AssertionError("rank 0: no DistTimeoutError")
    eng = _state.world.engine
    own = eng.own(g.gid)
    fp = next(p.fpx for k, p in g.plans.items() if p.op == "all_reduce")

    class FailingRequest:
        def Test(self, *a):  # noqa: N802 - mpi4py's name
            raise MPI.Exception(MPI.ERR_COMM)

    class Failing:
        def Iallreduce(self, *a):  # noqa: N802 - mpi4py's name
            if kind == "test_error":
                return FailingRequest()
            raise MPI.Exception(MPI.ERR_COMM)

    own[fp] = Failing()
    try:
        dist.all_reduce(x)
    except BrokenError as e:
        assert "MPI_Iallreduce" in str(e) and g.flight[-1].state == "failed", (e, g.flight[-1])
        try:
            dist.barrier()
        except GroupBrokenError:
            print(f"rank {r}: mpi error ok after {time.monotonic() - t0:.3f}s: {e}", flush=True)
            sys.exit(5)
    raise AssertionError(f"rank {r}: no BrokenError")


def own_comms_exhausted() -> None:
    """MPI out of communicators (its MPI_Comm_idup fails, as MPICH's after ~2000): calls stay checked, right."""
    from mpi4py import MPI

    from procgroup.state import _state

    dist.init_process_group(timeout=60)
    r, n = dist.get_rank(), dist.get_world_size()
    eng = _state.world.engine

    class NoMore:
        def __init__(self, comm):
            self.comm = comm

        def Idup(self):  # noqa: N802 - mpi4py's name
            raise MPI.Exception(MPI.ERR_INTERN)

        def __getattr__(self, name):
            return getattr(self.comm, name)

    eng._comms[0] = NoMore(eng._comms[0])
    for i in range(6):
        x = np.full(3, r + i, np.int64)
        dist.all_reduce(x)
        assert x.tolist() == [n * (n - 1) // 2 + n * i] * 3, (i, x)
    assert not eng._own.get(0) and 0 in eng._no_own, (eng._own, eng._no_own)
    print(f"rank {r}: exhausted ok", flush=True)
    dist.destroy_process_group()


def iallreduce_default() -> None:
    """Open MPI: procgroup chose libnbc's recursive-doubling MPI_Iallreduce before MPI_Init (unless the job set
    it); in-place all_reduce, warm (on the shape's own communicator), every op MPI computes, sizes 1, 7, 64K + 1
    and 300001 elements (below LARGE_ALL_REDUCE), closed forms."""
    dist.init_process_group(timeout=60)
    from mpi4py import MPI

    r, n = dist.get_rank(), dist.get_world_size()
    if MPI.Get_library_version().startswith("Open MPI"):
        name = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"  # config.OPENMPI.IALLREDUCE_ALGORITHM
        assert os.environ.get(name) == "4", f"{name}={os.environ.get(name)!r}"  # 4: recursive doubling
    kinds = {
        "int64": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.BAND, ReduceOp.BOR],
        "int32": [ReduceOp.SUM, ReduceOp.BXOR],
        "float64": [ReduceOp.SUM, ReduceOp.PRODUCT],
        "float32": [ReduceOp.SUM],
        "complex64": [ReduceOp.SUM],
    }
    checks = 0
    for dt, ops in kinds.items():
        for op in ops:
            for size in (1, 7, 65537, 300001):
                parts = [_contrib(k, size, dt) for k in range(n)]
                want = _expected(op, parts, dt)
                for _ in range(3):  # the third on the shape's own communicator
                    x = parts[r].copy()
                    dist.all_reduce(x, op)
                    assert np.array_equal(x, want), (dt, op, size, x[:8], want[:8])
                    checks += 1
    print(f"rank {r}: {checks} iallreduce checks passed", flush=True)
    dist.destroy_process_group()


def agent_worker(backend: str) -> None:
    """A worker of `procgroup run` whose agent runs under mpirun/mpiexec: init with ``backend``; "mpi" must
    raise ConfigError at once (reported, exit 3), "cpu" forms the world of every agent's workers."""
    t0 = time.monotonic()
    try:
        _init(backend, timeout=30)
    except dist.ConfigError as e:
        print(f"rank {os.environ.get('RANK')}: ConfigError after {time.monotonic() - t0:.2f}s: {e}", flush=True)
        sys.exit(3)
    r, n = dist.get_rank(), dist.get_world_size()
    x = np.full(3, r + 1, np.int64)
    dist.all_reduce(x)
    assert x.tolist() == [n * (n + 1) // 2] * 3, x
    y = np.arange(4.0) + r
    dist.broadcast(y, src=n - 1)
    assert y.tolist() == (np.arange(4.0) + n - 1).tolist(), y
    print(f"rank {r}: agent worker ok on {dist.get_backend()} ({n} ranks)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    # arguments starting with "pgtest-" are the test's tag (it finds leftover processes by it)
    argv = [a for a in sys.argv[1:] if not a.startswith("pgtest-")]
    fn = globals().get(argv[0]) or getattr(ref, argv[0])
    fn(*argv[1:])
