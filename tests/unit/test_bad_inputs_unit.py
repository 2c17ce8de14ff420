"""Bad inputs that need no other process: each asserts the error TYPE and that the message names the fix.

Ranks as threads (``thread_world``) for the argument checks of collectives and point-to-point; a
real ``init_process_group`` in this process (world size 1, or a rank that never finds its peers)
for the init-time checks.  The multi-process cases (mismatched calls, world-size mismatch,
duplicate rank, wrong secret, garbage on the wire) are in ``tests/integration/test_bad_inputs.py``.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

import procgroup as dist
from procgroup.errors import ConfigError, ConnectError, NotInitializedError, PortInUseError, ProcGroupError
from procgroup.netutil import free_port

from ..conftest import thread_world


@pytest.fixture
def g1():
    return thread_world(1)[0]


@pytest.fixture
def g3():
    return thread_world(3)


@pytest.fixture
def clean_default_group():
    """These tests create and destroy the default group of this process; none may be left over."""
    if dist.is_initialized():
        pytest.skip("another test left the default process group initialized")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------------------- roots / peers out of range
@pytest.mark.parametrize(
    "call, phrase",
    [
        (
            lambda g: dist.broadcast(np.zeros(2), src=3, group=g),
            r"src=3 is not a rank of group WORLD .*use group_src= for a rank within the group",
        ),
        (lambda g: dist.broadcast(np.zeros(2), group_src=5, group=g), r"group_src=5 is outside \[0, 3\)"),
        (lambda g: dist.reduce(np.zeros(2), dst=-1, group=g), r"dst=-1 is not a rank of group WORLD .*use group_dst="),
        (lambda g: dist.gather(np.zeros(2), None, dst=7, group=g), r"dst=7 is not a rank of group WORLD"),
        (lambda g: dist.scatter(np.zeros(2), None, src=99, group=g), r"src=99 is not a rank of group WORLD"),
        (lambda g: dist.send(np.zeros(2), dst=3, group=g), r"dst=3 is not a rank of group WORLD"),
        (lambda g: dist.recv(np.zeros(2), src=4, group=g), r"src=4 is not a rank of group WORLD"),
        (lambda g: dist.broadcast(np.zeros(2), group=g), r"broadcast: src= is required"),
    ],
)
def test_root_src_dst_out_of_range(g3, call, phrase):
    with pytest.raises(ConfigError, match=phrase):
        call(g3[0])


def test_send_and_recv_to_self(g3):
    with pytest.raises(ConfigError, match=r"rank 0 cannot send to/from itself \(dst=0\); pick another rank"):
        dist.send(np.zeros(1), dst=0, group=g3[0])
    with pytest.raises(ConfigError, match=r"rank 1 cannot recv to/from itself \(src=1\); pick another rank"):
        dist.irecv(np.zeros(1), src=1, group=g3[1])
    with pytest.raises(ConfigError, match=r"pick another rank"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, np.zeros(1), 2, g3[2])])


# -------------------------------------------------------------------------------- output buffers
@pytest.mark.parametrize(
    "call",
    [
        lambda g, x: dist.all_reduce(x, group=g),
        lambda g, x: dist.broadcast(x, src=0, group=g),
        lambda g, x: dist.all_gather([x], np.zeros(x.size), group=g),
        lambda g, x: dist.all_gather_into_tensor(x, np.zeros(x.size), group=g),
        lambda g, x: dist.reduce_scatter_tensor(x, np.zeros(x.size), group=g),
        lambda g, x: dist.scatter(x, [np.zeros(x.size)], src=0, group=g),
    ],
)
def test_non_contiguous_output(g1, call):
    """A strided output works as with torch's gloo: the result is copied back into the user's view."""
    base = np.zeros((4, 4))
    x = base[:, ::2]
    x[...] = 0.0
    call(g1, x)
    assert np.all(base[:, 1::2] == 0.0)  # the gaps are untouched


@pytest.mark.parametrize(
    "call",
    [
        lambda g, x: dist.all_reduce(x, group=g),
        lambda g, x: dist.reduce(x, dst=0, group=g),
        lambda g, x: dist.all_gather([x], np.zeros(x.size), group=g),
        lambda g, x: dist.all_to_all_single(x, np.zeros(x.size), group=g),
    ],
)
def test_read_only_output(g1, call):
    x = np.zeros(4)
    x.flags.writeable = False
    with pytest.raises(ConfigError, match=r"is read-only; results are written into it, so pass a writable array"):
        call(g1, x)


def test_read_only_recv_buffer(g3):
    x = np.zeros(4)
    x.flags.writeable = False
    with pytest.raises(ConfigError, match=r"recv tensor is read-only; .*pass a writable array"):
        dist.irecv(x, src=1, group=g3[0])


def test_read_only_bytes_output(g1):
    with pytest.raises(ConfigError, match=r"read-only.*pass a writable array"):
        dist.all_reduce(b"\x01\x02", group=g1)


def test_non_contiguous_input_is_fine(g1):
    """Inputs are only read: a strided input is copied, not refused."""
    src = np.arange(8.0)[::2]
    out = np.zeros(4)
    dist.all_gather_into_tensor(out, src, group=g1)
    assert np.array_equal(out, src)


def test_not_a_buffer(g1):
    with pytest.raises(ConfigError, match=r"is not a numpy array, a torch tensor or a buffer; pass np.asarray\(x\)"):
        dist.all_reduce([1, 2, 3], group=g1)
    with pytest.raises(ConfigError, match=r"use the \*_object collectives for Python objects"):
        dist.all_reduce(np.array([object()]), group=g1)


# -------------------------------------------------------------------------------- ops a dtype does not have
@pytest.mark.parametrize(
    "dtype, op, phrase",
    [
        (np.float32, "BAND", r"BAND is not defined for float32; use an integer or bool tensor"),
        (np.float64, "BXOR", r"BXOR is not defined for float64; use an integer or bool tensor"),
        (
            np.complex64,
            "MAX",
            r"MAX is not defined for complex64: complex numbers are not ordered; reduce .real/.abs\(\) instead",
        ),
        (np.int32, "AVG", r"AVG is not defined for int32: .*convert to float, or use SUM and divide yourself"),
    ],
)
def test_unsupported_op_for_dtype(g1, dtype, op, phrase):
    with pytest.raises(ConfigError, match=phrase):
        dist.all_reduce(np.zeros(2, dtype), op=getattr(dist.ReduceOp, op), group=g1)
    with pytest.raises(ConfigError, match=phrase):
        dist.reduce_scatter_tensor(np.zeros(2, dtype), np.zeros(2, dtype), op=getattr(dist.ReduceOp, op), group=g1)


def test_not_a_reduce_op(g1):
    with pytest.raises(
        ConfigError, match=r"op='MEDIAN' is not a ReduceOp \(SUM, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR\)"
    ):
        dist.all_reduce(np.zeros(2), op="MEDIAN", group=g1)


# -------------------------------------------------------------------------------- sizes within one rank's call
def test_local_count_and_dtype_mismatch(g3):
    with pytest.raises(ConfigError, match=r"all_gather: tensor_list has 2 entries but the group has 3 ranks"):
        dist.all_gather([np.zeros(1)] * 2, np.zeros(1), group=g3[0])
    with pytest.raises(ConfigError, match=r"output has 5 elements but must have 6 \(3 x the input's 2\)"):
        dist.all_gather_into_tensor(np.zeros(5), np.zeros(2), group=g3[0])
    with pytest.raises(ConfigError, match=r"has dtype float32 but .* has dtype float64; they must match"):
        dist.all_gather_into_tensor(np.zeros(6), np.zeros(2, np.float32), group=g3[0])
    with pytest.raises(ConfigError, match=r"not divisible by the group size 3; pass input_split_sizes"):
        dist.all_to_all_single(np.zeros(4), np.zeros(4), group=g3[0])


# -------------------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.all_reduce(np.zeros(2)),
        lambda: dist.barrier(),
        lambda: dist.get_rank(),
        lambda: dist.new_group([0]),
        lambda: dist.send(np.zeros(1), dst=1),
    ],
)
def test_call_before_init(clean_default_group, call):
    with pytest.raises(
        NotInitializedError, match=r"has not been initialized: call procgroup.init_process_group\(\) first"
    ):
        call()


def test_double_init(clean_default_group, monkeypatch):
    monkeypatch.setenv("PROCGROUP_SECRET", "unit-test-secret")
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=20)
    try:
        with pytest.raises(
            ProcGroupError, match=r"called twice.*call destroy_process_group\(\) first, or use new_group\(\)"
        ):
            dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=20)
        x = np.ones(3)
        dist.all_reduce(x)  # the first group still works
        assert x[0] == 1
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "url, phrase",
    [
        ("http://127.0.0.1:29500", r"is not supported; use env://"),
        ("tcp://127.0.0.1", r"needs a host and a port: tcp://HOST:PORT"),
        ("tcp://127.0.0.1:99999", r"needs a host and a port: tcp://HOST:PORT"),
        ("file://", r"needs a path: file:///shared/dir/rdzv_file"),
        ("env://?rank=x", r"rank='x' is not an integer"),
        ("env://?ranks=1", r"unknown query parameters \['ranks'\]; only rank= and world_size= are accepted"),
    ],
)
def test_invalid_init_method(clean_default_group, url, phrase):
    with pytest.raises(ConfigError, match=phrase):
        dist.init_process_group(init_method=url, rank=0, world_size=1, timeout=5)
    assert not dist.is_initialized()


def test_unreachable_master(clean_default_group, monkeypatch):
    """Rank 1 of 2, a port nobody listens on, a 2 s deadline: ConnectError naming host:port, soon after 2 s."""
    monkeypatch.setenv("PROCGROUP_SECRET", "unit-test-secret")
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as ei:
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=2)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert f"could not connect to the store at 127.0.0.1:{port}" in msg, msg
    assert "Is rank 0 / the launcher running?" in msg and "raise PROCGROUP_TIMEOUT to wait longer" in msg, msg
    assert took < 2 + 3.0, f"the ConnectError came {took:.2f}s after a 2 s deadline"
    assert not dist.is_initialized()


def test_port_in_use(clean_default_group, monkeypatch):
    """Rank 0's MASTER_PORT is held by another socket: PortInUseError naming addr:port and the fix."""
    monkeypatch.setenv("PROCGROUP_SECRET", "unit-test-secret")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(PortInUseError) as ei:
            dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=5)
    finally:
        holder.close()
    msg = str(ei.value)
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in msg, msg
    assert "choose another --master-port / MASTER_PORT, or use --standalone" in msg, msg
    assert isinstance(ei.value, ConfigError)
    assert not dist.is_initialized()


def test_port_in_use_env(clean_default_group, monkeypatch):
    """The same through env:// (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    for k, v in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2", PROCGROUP_SECRET="s"
    ).items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(PortInUseError, match=rf"127.0.0.1:{port}.*already in use.*MASTER_PORT"):
            dist.init_process_group(timeout=5)
    finally:
        holder.close()


_KEEP = ("PATH", "HOME", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT", "PYTEST_CURRENT_TEST")


def test_missing_environment(clean_default_group, monkeypatch):
    """env:// with no RANK / WORLD_SIZE (and no scheduler variables): ConfigError naming them and the fixes."""
    for k in list(os.environ):
        if k not in _KEEP:
            monkeypatch.delenv(k)
    with pytest.raises(ConfigError) as ei:
        dist.init_process_group(timeout=5)
    msg = str(ei.value)
    assert "does not know this process's rank and world size" in msg, msg
    assert "set RANK and WORLD_SIZE" in msg and "pass rank= and world_size=" in msg, msg
    assert "`procgroup run`" in msg, msg
    assert not dist.is_initialized()


def test_half_the_environment(clean_default_group, monkeypatch):
    """RANK without WORLD_SIZE: named precisely."""
    for k in list(os.environ):
        if k not in _KEEP:
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"RANK=0 is set but WORLD_SIZE is not; set both \(or neither\)"):
        dist.init_process_group(timeout=5)


@pytest.mark.parametrize(
    "var, value, phrase",
    [
        (
            "PROCGROUP_TIMEOUT",
            "soon",
            r"PROCGROUP_TIMEOUT='soon' is not a number of seconds; set e.g. PROCGROUP_TIMEOUT=60",
        ),
        ("PROCGROUP_TRANSPORT", "carrier-pigeon", r"PROCGROUP_TRANSPORT='carrier-pigeon' is not one of auto, shm, tcp"),
        (
            "PROCGROUP_LOG_LEVEL",
            "loud",
            r"PROCGROUP_LOG_LEVEL='loud' is not a log level; use DEBUG, INFO, WARNING or ERROR",
        ),
    ],
)
def test_bad_setting(clean_default_group, monkeypatch, var, value, phrase):
    monkeypatch.setenv("PROCGROUP_SECRET", "s")
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=phrase):
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(timeout=-1), r"timeout=-1 must be > 0 seconds"),
        (dict(backend="nccl"), r"backend='nccl' needs CUDA devices.*use backend='cpu' \(or 'gloo'\)"),
        (dict(backend="carrier"), r"backend='carrier' is not one of 'cpu' \(alias 'gloo'\), 'mpi', 'nccl'"),
        (dict(init_method="env://", store=object()), r"pass either init_method= or store=, not both"),
    ],
)
def test_bad_init_arguments(clean_default_group, kwargs, phrase):
    with pytest.raises(ConfigError, match=phrase):
        dist.init_process_group(**kwargs)
    assert not dist.is_initialized()
