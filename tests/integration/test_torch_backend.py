"""procgroup as a torch.distributed backend, in real processes (tests/integration/torch_backend_workers.py).

Every test starts N ranks as subprocesses on a free port, with a deadline; the workers check closed-form
values themselves and exit non-zero naming the first difference.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

torch = pytest.importorskip("torch")

from procgroup.netutil import free_port  # noqa: E402

from .harness import Result, collect, report, spawn_world, worker_env  # noqa: E402

WORKER = Path(__file__).with_name("torch_backend_workers.py")
ROOT = Path(__file__).resolve().parents[2]


def spawn(n: int, scenario: str, init: str = "tcp", env: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
    """Start ``n`` ranks of ``scenario`` with init method ``init``."""
    extra = {"PROCGROUP_TIMEOUT": "60", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    extra.update(env or {})
    return spawn_world(n, scenario, [init], env=extra, script=WORKER)


def run(n: int, scenario: str, init: str = "tcp", timeout: float = 90.0) -> List[Result]:
    """Run ``scenario`` at world size ``n``; fail with every rank's output unless all printed OK."""
    results = collect(spawn(n, scenario, init), timeout)
    if any(r.returncode != 0 or "OK" not in r.stdout for r in results):
        raise AssertionError(f"{scenario} ({init}) failed at world size {n}:\n{report(results)}")
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_every_op_dtype_root(n: int) -> None:
    """Every collective, every root, five dtypes, non-contiguous and aliased tensors, coalesced forms, async +
    futures, scalars, empty tensors, bool and bitwise reductions, large messages."""
    run(n, "collectives+async+coalescing+edges", timeout=140)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_blocking_all_reduce_hot_path(n: int) -> None:
    """dist.all_reduce's cached numpy views and reused Works: every served dtype and op, sizes 0/1/odd/large,
    one tensor changed under the cache (resize_, set_, .data =, t_()), dying tensors, kept Works' futures."""
    run(n, "hot_path", timeout=140)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_own_api_torch_tensor_views(n: int) -> None:
    """procgroup's own API on torch tensors reuses a cached numpy view per tensor; a tensor resized, re-pointed
    (set_, .data =), transposed or restrided in place, dying tensors and async temporaries never see a stale one."""
    run(n, "own_api_views", timeout=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point(n: int) -> None:
    """send/recv, isend/irecv, recv from any source, batch_isend_irecv, tags, non-contiguous buffers."""
    run(n, "p2p")


@pytest.mark.timeout(120)
def test_new_group_and_subgroups() -> None:
    """new_group(backend="procgroup"), new_subgroups_by_enumeration, and groups inheriting the backend."""
    run(3, "subgroups")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("init", ["env", "store", "file"])
def test_init_methods(init: str, tmp_path: Path) -> None:
    """env://, store= and file:// (tcp:// is what the other tests use)."""
    run(2, "basic", f"file:{tmp_path / 'rdzv'}" if init == "file" else init)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["procgroup", "torchrun"])
def test_unmodified_script_under_launchers(launcher: str) -> None:
    """init_process_group("procgroup") with env:// under `procgroup run` and under torchrun."""
    cmd = {
        "procgroup": [sys.executable, "-m", "procgroup", "run", "--nproc-per-node", "2"],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            f"--master-port={free_port()}",
        ],
    }[launcher]
    env = worker_env(0, 2, free_port(), secrets.token_hex(16), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_SECRET"):
        env.pop(k, None)  # the launcher sets them
    out = subprocess.run(
        [*cmd, str(WORKER), "basic", "env"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.count("OK") >= 2, out.stdout + out.stderr


@pytest.mark.timeout(120)
def test_fallthrough_to_gloo_logged_once() -> None:
    """A sparse all_reduce is answered by gloo underneath, and logged once; monitored_barrier is served natively."""
    run(2, "fallthrough")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_torch_monitored_barrier(n: int) -> None:
    """torch's dist.monitored_barrier works on procgroup groups and fails in torch's wording, naming the late rank."""
    run(n, "monitored")


@pytest.mark.timeout(120)
def test_device_delegation_path() -> None:
    """The path CUDA tensors take (a torch backend built underneath on the same store), exercised with gloo on CPU."""
    run(2, "delegate")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", ["dead_peer", "dead_peer_async", "deadline"])
def test_failures_raise_instead_of_hanging(scenario: str) -> None:
    """A dead peer or a deadline raises procgroup's error naming the op, the rank and (for a death) the peer."""
    procs = spawn(2, scenario)
    results = collect(procs, 60)
    r0 = results[0]
    m = re.search(r"RAISED after ([0-9.]+)s: (\w+): (.*)", r0.stdout)
    assert r0.returncode == 0 and m, report(results)
    seconds, kind, msg = float(m.group(1)), m.group(2), m.group(3)
    assert "all_reduce" in msg and "rank 0" in msg, msg
    if scenario.startswith("dead_peer"):
        assert "rank 1" in msg and seconds < 30, msg
    else:
        assert "Timeout" in kind or "timed out" in msg or "deadline" in msg, msg
        assert 2.0 <= seconds < 12, msg


@pytest.mark.timeout(120)
def test_mismatch_is_named_on_every_rank() -> None:
    """Ranks that disagree about a collective get procgroup's mismatch error instead of garbage or a hang."""
    results = collect(spawn(2, "mismatch"), 60)
    for r in results:
        m = re.search(r"RAISED after ([0-9.]+)s: (\w+): (.*)", r.stdout)
        assert r.returncode == 0 and m, report(results)
        assert m.group(2) == "CollectiveMismatchError" and "all_reduce" in m.group(3), m.group(0)
        assert float(m.group(1)) < 30, m.group(0)


@pytest.mark.timeout(120)
def test_cuda_through_nccl() -> None:
    """ "cpu:procgroup,cuda:nccl": CUDA tensors through torch's NCCL under the same group."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the CUDA path is covered on CPU by test_device_delegation_path")
    run(min(2, torch.cuda.device_count()), "cuda")


EXIT_WITH_QUEUED = """
import torch, torch.distributed as dist
import procgroup.torch
dist.init_process_group("procgroup", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(1)
opts = dist.AllreduceOptions()  # asyncOp: the executor thread runs them
for _ in range(1000):
    dist.group.WORLD.allreduce([t], opts)
print("exiting with async ops queued", flush=True)
"""


@pytest.mark.timeout(60)
def test_exit_with_async_ops_queued_and_no_destroy() -> None:
    """A script that exits with async ops still queued and never calls destroy_process_group exits 0 (it used to
    abort with 134, "terminate called without an active exception", from the executor's daemon thread)."""
    env = worker_env(0, 1, free_port(), secrets.token_hex(16), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    r = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_QUEUED.format(port=free_port())],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert r.returncode == 0 and "exiting" in r.stdout, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
