"""The nccl backend's parts that need neither a GPU nor several processes: the one-device-per-rank check, the
registry's reasons, and where a device tensor goes (see tests/integration/test_device_engine_procs.py for the
engine in real processes and tests/cuda/test_own_api_nccl.py for CUDA)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import procgroup as dist
from procgroup import backends, data
from procgroup.backends.nccl import NcclBackend
from procgroup.backends.nccl.devices import check_one_device_per_rank, decode_record, encode_record
from procgroup.errors import ConfigError, DeviceTensorError
from procgroup.netutil import free_port


# -- the one-device-per-rank check (torch-free) ------------------------------------------------------------------
def test_distinct_devices_pass():
    check_one_device_per_rank([("h1", "GPU-a"), ("h1", "GPU-b"), ("h2", "GPU-a"), ("h2", "GPU-b")], [0, 1, 2, 3])
    check_one_device_per_rank([("h1", "GPU-a")], [5])
    check_one_device_per_rank([], [])


def test_two_ranks_on_one_gpu_are_named_with_the_fix():
    entries = [("k1", "GPU-a"), ("k1", "GPU-b"), ("k1", "GPU-a")]
    with pytest.raises(ConfigError) as ei:
        check_one_device_per_rank(
            entries, [4, 5, 6], names=["cuda:0", "cuda:1", "cuda:0"], hostnames=["n1", "n1", "n1"], op="all_reduce"
        )
    msg = str(ei.value)
    for part in (
        "all_reduce",
        "ranks 4 and 6",
        "host n1",
        "cuda:0",
        "GPU-a",
        "one GPU per rank",
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))",
        "CUDA_VISIBLE_DEVICES",
    ):
        assert part in msg, (part, msg)


def test_same_device_id_on_two_hosts_is_fine_and_names_differ_per_rank():
    check_one_device_per_rank([("k1", "0000:3b:00"), ("k2", "0000:3b:00")], [0, 1])
    with pytest.raises(ConfigError, match=r"\(cuda:0 and cuda:1, id GPU-x\)"):
        check_one_device_per_rank([("k", "GPU-x"), ("k", "GPU-x")], [0, 1], names=["cuda:0", "cuda:1"])


def test_records_round_trip_and_are_fixed_size():
    raw = encode_record("GPU-1234", "cuda:3")
    assert len(raw) == len(encode_record("x" * 500, "cuda:0"))
    assert decode_record(raw) == ("GPU-1234", "cuda:3")


# -- the registry --------------------------------------------------------------------------------------------------
def test_nccl_is_registered_and_says_why_it_is_unavailable_here():
    assert "nccl" in backends.names()
    reason = NcclBackend().unavailable_reason()
    if reason is None:
        pytest.skip("this machine has torch with NCCL and a CUDA device")
    assert reason.startswith("backend='nccl' needs CUDA devices and an NCCL binding")
    assert "use backend='cpu' (or 'gloo')" in reason
    with pytest.raises(ConfigError, match="backend='nccl' needs CUDA devices") as ei:
        backends.lookup("nccl")
    assert "a CUDA build of torch" in str(ei.value)


def test_reason_without_torch(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert "torch is not installed" in NcclBackend().unavailable_reason()


def test_reason_without_nccl_or_without_a_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as tdist

    monkeypatch.setattr(tdist, "is_nccl_available", lambda: False)
    assert "has no NCCL (a CPU-only build)" in NcclBackend().unavailable_reason()
    monkeypatch.setattr(tdist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    why = NcclBackend().unavailable_reason()
    assert "sees no CUDA device" in why and "CUDA_VISIBLE_DEVICES" in why
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert NcclBackend().unavailable_reason() is None


def test_importing_procgroup_does_not_import_torch():
    import subprocess

    code = "import sys, procgroup, procgroup.backends; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- where a device tensor goes ------------------------------------------------------------------------------------
@pytest.fixture
def one_rank(monkeypatch):
    """A world of one on the cpu backend, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("another test left the default process group initialized")
    monkeypatch.setenv("PROCGROUP_SECRET", "s")
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=20)
    yield
    dist.destroy_process_group()


def test_a_device_tensor_on_the_cpu_backend_is_the_config_error_naming_the_fix(one_rank):
    torch = pytest.importorskip("torch")
    t = torch.ones(3, device="meta")  # a tensor that is not on the CPU, on any machine
    for call in (
        lambda: dist.all_reduce(t),
        lambda: dist.broadcast(t, src=0),
        lambda: dist.all_gather_into_tensor(torch.ones(3, device="meta"), t),
    ):
        with pytest.raises(ConfigError, match=r"is on device meta; the cpu backend takes CPU tensors.*backend='nccl'"):
            call()
    assert issubclass(DeviceTensorError, ConfigError)
    x = torch.arange(3.0)  # CPU tensors keep procgroup's own path
    dist.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0]
    a = np.ones(2)
    dist.all_reduce(a)
    assert a.tolist() == [1.0, 1.0]


def test_route_cpu_tensors_switches_and_restores():
    torch = pytest.importorskip("torch")
    data.route_cpu_tensors(True)
    try:
        with pytest.raises(DeviceTensorError) as ei:
            data.as_flat(torch.ones(2), "x")
        assert ei.value.device == torch.device("cpu")
        assert data.as_flat(np.ones(2), "x").numel == 2  # numpy arrays are never routed
    finally:
        data.route_cpu_tensors(False)
    assert data.as_flat(torch.ones(2), "x").numel == 2
