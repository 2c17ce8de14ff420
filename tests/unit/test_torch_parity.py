"""procgroup's own API matches torch.distributed's names (issue 10 item 7); torch is optional here."""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np
import pytest

import procgroup as dist


@pytest.fixture
def world1():
    dist.init_process_group("cpu", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_reduce_op_alias_and_names() -> None:
    assert dist.reduce_op is dist.ReduceOp
    assert dist.default_pg_timeout == timedelta(minutes=30)
    assert dist.supports_complex(dist.ReduceOp.SUM) and not dist.supports_complex("max")
    assert dist.is_backend_available("cpu") and not dist.is_backend_available("no-such-backend")
    assert dist.get_default_backend_for_device("cpu") == "gloo"


def test_get_node_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert dist.get_node_local_rank() == 1


def test_torch_reduce_ops_accepted(world1: None) -> None:
    tdist = pytest.importorskip("torch.distributed")
    for op in (tdist.ReduceOp.MAX, tdist.ReduceOp.RedOpType.MAX, tdist.ReduceOp(tdist.ReduceOp.MAX)):
        assert dist.ReduceOp.coerce(op) is dist.ReduceOp.MAX
        a = np.arange(4.0)
        dist.all_reduce(a, op=op)
        assert a.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_work_get_future(world1: None) -> None:
    a = np.ones(3)
    work = dist.all_reduce(a, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: "seen")
    assert chained.wait() == "seen" and fut.done() and chained.done()
    fut.value()
    with pytest.raises(TypeError):
        fut.then(3)  # type: ignore[arg-type]


def test_future_raises_the_callbacks_error(world1: None) -> None:
    fut = dist.all_reduce(np.ones(2), async_op=True).get_future()

    def boom(_f: object) -> None:
        raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed"):
        fut.then(boom).wait()


def test_tcpstore_torch_signature() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    try:
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        try:
            master.set("k", b"v")
            assert client.get("k") == b"v"
            pre = dist.PrefixStore("p", client)
            pre.set("x", "1")
            assert master.get("p/x") == b"1"
        finally:
            client.close()
    finally:
        master.close()


def test_filestore_torch_signature(tmp_path) -> None:
    s = dist.FileStore(str(tmp_path / "st ore"), 2)
    try:
        s.set("a", b"b")
        assert s.get("a") == b"b" and s.world_size == 2
    finally:
        s.close()


def test_init_with_torch_store() -> None:
    tdist = pytest.importorskip("torch.distributed")
    dist.init_process_group("cpu", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        a = np.ones(2)
        dist.all_reduce(a)
        assert a.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_init_rejects_a_foreign_store() -> None:
    with pytest.raises(TypeError, match="store="):
        dist.init_process_group("cpu", store=object(), rank=0, world_size=1)


def test_non_contiguous_inplace_gets_a_copy_written_back() -> None:
    """As torch's gloo: a strided output is computed on a contiguous copy, then copied back (issue 10 item 7)."""
    from procgroup.data import as_flat

    base = np.ones((4, 4))
    f = as_flat(base[:, ::2])
    assert f.array.flags.c_contiguous and f.back is not None
    f.array[...] = 5.0
    f.back()
    assert np.all(base[:, ::2] == 5.0) and np.all(base[:, 1::2] == 1.0)
    assert as_flat(np.ones(3)).back is None  # the contiguous fast path has no copy


def test_ray_identity_source() -> None:
    from procgroup.identity import detect_identity

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RAY_JOB_ID": "01000000"}
    ident = detect_identity(env)
    assert ident.source == "ray" and ident.rank == 1 and ident.job_id is None
    assert detect_identity({"RANK": "0", "WORLD_SIZE": "1"}).source == "torchrun"


def test_torch_tensor_views_follow_the_tensor(world1: None) -> None:
    """The own API's view of a torch tensor is built from its current memory on every call: a tensor that was
    reduced can still be resized (Tensor.numpy() used to pin its storage), and a resized, re-pointed or retyped
    tensor is reduced where its data now is."""
    torch = pytest.importorskip("torch")
    from procgroup.data import as_flat

    t = torch.ones(4)
    dist.all_reduce(t)
    t.resize_(1000)  # raised "Trying to resize storage that is not resizable" before
    f = as_flat(t)
    assert f.array.size == 1000 and f.array.ctypes.data == t.data_ptr()
    t.resize_(3)
    assert as_flat(t).array.size == 3
    other = torch.arange(6.0)
    t.set_(other)
    f = as_flat(t)
    assert f.array.ctypes.data == other.data_ptr() and f.array.tolist() == list(range(6))
    t.data = torch.ones(2, dtype=torch.bfloat16)
    f = as_flat(t)
    assert f.dtype == "bfloat16" and f.array.dtype == np.uint16 and f.array.ctypes.data == t.data_ptr()
    f = as_flat(torch.zeros(3, 4).t())  # not contiguous: a copy written back after the op
    assert f.back is not None
    w = dist.all_reduce(torch.full((5,), 2.0), async_op=True)  # the caller keeps no reference: the view does
    w.wait()
