"""The public API (collectives, p2p, objects, subgroups, async) with ranks as threads.

Each thread holds its own world ProcessGroup over the in-memory transport and
passes it as ``group=``; expected values are closed forms.
"""

from __future__ import annotations

import numpy as np
import pytest

import procgroup as dist
from procgroup.errors import ConfigError
from procgroup.store import HashStore
from procgroup.subgroups import _make_group

from ..conftest import run_ranks, thread_world

SIZES = [1, 2, 3, 5, 8]


def contrib(r: int, n: int, dtype) -> np.ndarray:
    return ((r + 1) * (np.arange(n) % 7 + 1)).astype(dtype)


@pytest.mark.parametrize("ws", SIZES)
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float64, np.int64])
def test_all_reduce_sum_max_avg(ws, dtype):
    pgs = thread_world(ws)
    n = 11
    base = np.arange(n) % 7 + 1

    def body(r):
        x = contrib(r, n, dtype)
        dist.all_reduce(x, group=pgs[r])
        assert np.array_equal(x, (base * ws * (ws + 1) // 2).astype(dtype))
        y = contrib(r, n, dtype)
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=pgs[r])
        assert np.array_equal(y, contrib(ws - 1, n, dtype))
        if np.dtype(dtype).kind == "f":
            z = contrib(r, n, dtype)
            dist.all_reduce(z, op=dist.ReduceOp.AVG, group=pgs[r])
            assert np.allclose(z, base * (ws + 1) / 2)

    run_ranks(ws, body)


@pytest.mark.parametrize("ws", SIZES)
def test_rooted_ops_every_root(ws):
    pgs = thread_world(ws)
    n = 5

    def body(r):
        g = pgs[r]
        for root in range(ws):
            b = np.full(n, r, np.int16) if r != root else np.arange(n, dtype=np.int16) + 100
            dist.broadcast(b, src=root, group=g)
            assert np.array_equal(b, np.arange(n) + 100)
            x = contrib(r, n, np.int64)
            orig = x.copy()
            dist.reduce(x, dst=root, group=g)
            if r == root:
                assert np.array_equal(x, (np.arange(n) % 7 + 1) * ws * (ws + 1) // 2)
            else:
                assert np.array_equal(x, orig)
            outs = [np.zeros(n, np.float32) for _ in range(ws)] if r == root else None
            dist.gather(np.full(n, r, np.float32), outs, dst=root, group=g)
            if r == root:
                assert [int(o[0]) for o in outs] == list(range(ws))
            got = np.zeros(3, np.uint8)
            ins = [np.full(3, 10 + i, np.uint8) for i in range(ws)] if r == root else None
            dist.scatter(got, ins, src=root, group=g)
            assert np.all(got == 10 + r)

    run_ranks(ws, body)


@pytest.mark.parametrize("ws", SIZES)
def test_gather_family(ws):
    pgs = thread_world(ws)

    def body(r):
        g = pgs[r]
        outs = [np.zeros((2, 3), np.float64) for _ in range(ws)]
        dist.all_gather(outs, np.full((2, 3), r, np.float64), group=g)
        assert [o[1, 2] for o in outs] == list(range(ws))
        big = np.zeros(ws * 4, np.int32)
        dist.all_gather_into_tensor(big, np.arange(4, dtype=np.int32) + 4 * r, group=g)
        assert np.array_equal(big, np.arange(4 * ws))
        # reduce_scatter: rank r gets block r of the sum
        inp = np.arange(ws * 3, dtype=np.int64) * (r + 1)
        out = np.zeros(3, np.int64)
        dist.reduce_scatter_tensor(out, inp, group=g)
        assert np.array_equal(out, np.arange(3 * r, 3 * r + 3) * ws * (ws + 1) // 2)
        lst = [np.full(2, (i + 1) * (r + 1), np.float32) for i in range(ws)]
        o2 = np.zeros(2, np.float32)
        dist.reduce_scatter(o2, lst, group=g)
        assert np.allclose(o2, (r + 1) * ws * (ws + 1) / 2)
        # all_to_all: rank r sends value 100*r + j to rank j
        ins = [np.array([100 * r + j], np.int64) for j in range(ws)]
        outs2 = [np.zeros(1, np.int64) for _ in range(ws)]
        dist.all_to_all(outs2, ins, group=g)
        assert [int(o[0]) for o in outs2] == [100 * j + r for j in range(ws)]
        dist.barrier(group=g)

    run_ranks(ws, body)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_all_to_all_single_uneven_splits(ws):
    pgs = thread_world(ws)

    def body(r):
        # rank r sends (j + 1) rows of width 2 to rank j; so it receives (r + 1) rows from each
        send_sizes = [j + 1 for j in range(ws)]
        inp = np.concatenate([np.full((j + 1, 2), 10 * r + j, np.float32) for j in range(ws)])
        out = np.zeros(((r + 1) * ws, 2), np.float32)
        dist.all_to_all_single(out, inp, output_split_sizes=[r + 1] * ws, input_split_sizes=send_sizes, group=pgs[r])
        expect = np.concatenate([np.full((r + 1, 2), 10 * j + r, np.float32) for j in range(ws)])
        assert np.array_equal(out, expect)

    run_ranks(ws, body)


def test_p2p_any_source_tags_and_batch():
    pgs = thread_world(3)

    def body(r):
        g = pgs[r]
        if r == 0:
            got = np.zeros(1, np.int64)
            senders = sorted(dist.recv(got, group=g, tag=5) for _ in range(2))
            assert senders == [1, 2]
            b = np.zeros(1, np.int64)
            a = np.zeros(1, np.int64)
            dist.recv(b, 1, group=g, tag=2)  # tag 2 was sent after tag 1: tags are independent
            dist.recv(a, 1, group=g, tag=1)
            assert (a[0], b[0]) == (11, 22)
        else:
            dist.send(np.array([r], np.int64), 0, group=g, tag=5)
            if r == 1:
                dist.send(np.array([11], np.int64), 0, group=g, tag=1)
                dist.send(np.array([22], np.int64), 0, group=g, tag=2)
        # ring with batch_isend_irecv
        nxt, prv = (r + 1) % 3, (r - 1) % 3
        out = np.zeros(4, np.float64)
        ops = [dist.P2POp(dist.isend, np.full(4, r, np.float64), nxt, g), dist.P2POp(dist.irecv, out, prv, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert np.all(out == prv)

    run_ranks(3, body)


def test_async_work_and_order():
    pgs = thread_world(4)

    def body(r):
        g = pgs[r]
        xs = [np.full(100, r + i, np.float64) for i in range(5)]
        works = [dist.all_reduce(x, group=g, async_op=True) for x in xs]
        y = np.ones(3)
        dist.all_reduce(y, group=g)  # blocking op after async ones: program order kept
        for w in works:
            assert w.wait(timeout=10)
            assert w.is_completed()
        for i, x in enumerate(xs):
            assert np.all(x == sum(rr + i for rr in range(4)))
        assert np.all(y == 4)

    run_ranks(4, body)


def test_object_collectives():
    pgs = thread_world(3)

    def body(r):
        g = pgs[r]
        objs = [{"rank": r, "arr": np.arange(5) * r}, f"s{r}"] if r == 1 else [None, None]
        dist.broadcast_object_list(objs, src=1, group=g)
        assert objs[0]["rank"] == 1 and np.array_equal(objs[0]["arr"], np.arange(5)) and objs[1] == "s1"
        lst = [None] * 3
        dist.all_gather_object(lst, {"r": r, "pad": "x" * (r * 1000)}, group=g)
        assert [d["r"] for d in lst] == [0, 1, 2] and len(lst[2]["pad"]) == 2000
        gl = [None] * 3 if r == 2 else None
        dist.gather_object((r, [r] * r), gl, dst=2, group=g)
        if r == 2:
            assert gl == [(0, []), (1, [1]), (2, [2, 2])]
        out = [None]
        dist.scatter_object_list(out, [f"to{i}" for i in range(3)] if r == 0 else None, src=0, group=g)
        assert out == [f"to{r}"]
        if r == 0:
            dist.send_object_list([np.ones(1000), "hello"], dst=2, group=g)
        elif r == 2:
            got = [None, None]
            assert dist.recv_object_list(got, group=g) == 0
            assert got[1] == "hello" and got[0].sum() == 1000

    run_ranks(3, body)


def test_subgroups_do_not_cross():
    store = HashStore()
    pgs = thread_world(4, store=store)

    def body(r):
        w = pgs[r]
        a = _make_group(w, [0, 1], 20, None)
        b = _make_group(w, [2, 3], 20, None)
        c = _make_group(w, [1, 3], 20, None)
        mine = a if r in (0, 1) else b
        x = np.array([r], np.int64)
        dist.all_reduce(x, group=mine)
        assert x[0] == (1 if r < 2 else 5)
        if r in (1, 3):
            assert c is not dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(c) == (0 if r == 1 else 1)
            assert dist.get_global_rank(c, 1) == 3 and dist.get_group_rank(c, 3) == 1
            y = np.array([r * 10], np.int64)
            dist.all_reduce(y, group=c)
            assert y[0] == 40
        else:
            assert c is dist.GroupMember.NON_GROUP_MEMBER
            assert dist.all_reduce(np.zeros(1), group=c) is None  # no-op for non-members, as torch
        assert (a is dist.GroupMember.NON_GROUP_MEMBER) == (r >= 2)
        return mine.gid, (c.gid if r in (1, 3) else None)

    got = run_ranks(4, body)
    gid_a, gid_b, gid_c = got[0][0], got[2][0], got[1][1]
    assert got[1][0] == gid_a and got[3][0] == gid_b and got[3][1] == gid_c
    assert len({gid_a, gid_b, gid_c, 0}) == 4  # distinct from each other and from WORLD


def test_bad_inputs_are_clear_errors():
    pgs = thread_world(1)
    g = pgs[0]
    x = np.zeros((4, 4), np.float32)
    x[...] = 3.0
    dist.all_reduce(x[:, ::2], group=g)  # a strided view works (copied back), as with torch's gloo
    assert np.all(x == 3.0)
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        dist.broadcast(ro, src=0, group=g)
    with pytest.raises(ConfigError, match="BAND is not defined for float32"):
        dist.all_reduce(np.zeros(2, np.float32), op=dist.ReduceOp.BAND, group=g)
    with pytest.raises(ConfigError, match="not a rank of group"):
        dist.broadcast(np.zeros(2), src=3, group=g)
    with pytest.raises(ConfigError, match="output has 3 elements but must have 2"):
        dist.all_gather_into_tensor(np.zeros(3), np.zeros(2), group=g)
    with pytest.raises(ConfigError, match="itself"):
        dist.send(np.zeros(1), 0, group=g)
    with pytest.raises(ConfigError, match="tensor_list has 2 entries"):
        dist.all_gather([np.zeros(1), np.zeros(1)], np.zeros(1), group=g)


def test_buffers_and_bytearray():
    pgs = thread_world(2)

    def body(r):
        buf = bytearray([r + 1] * 6)
        dist.all_reduce(buf, group=pgs[r])
        assert buf == bytearray([3] * 6)

    run_ranks(2, body)


def test_torch_tensors_in_place():
    torch = pytest.importorskip("torch")
    pgs = thread_world(2)

    def body(r):
        t = torch.full((2, 3), float(r + 1))
        ptr = t.data_ptr()
        dist.all_reduce(t, group=pgs[r])
        assert t.data_ptr() == ptr and torch.all(t == 3.0)
        b = torch.full((5,), 1.5 * (r + 1), dtype=torch.bfloat16)
        dist.all_reduce(b, group=pgs[r])
        assert torch.all(b == 4.5)
        h = torch.full((3,), r + 0.5, dtype=torch.float16)
        dist.all_reduce(h, op=dist.ReduceOp.MAX, group=pgs[r])
        assert torch.all(h == 1.5)

    run_ranks(2, body)
