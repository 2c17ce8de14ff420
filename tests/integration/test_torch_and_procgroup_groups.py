"""torch.distributed's group and procgroup's own group in one job (issue 10 item 8).

One script inits torch's gloo group and procgroup's group in the same process (N=2) and runs one all_reduce
with each, under ``procgroup run`` and under ``torchrun``, in both orders, with no port given by hand.
procgroup first under ``procgroup run`` used to fail: procgroup's rank 0 bound MASTER_PORT for its own store and
torch's TCPStore then got EADDRINUSE.  Now torch's env:// rendezvous runs over procgroup's own (authenticated)
store when procgroup's group came first on the same MASTER_ADDR:MASTER_PORT (procgroup.torch._store.
share_store_with_torch), and the script checks that torch's store is procgroup's in that case.
Skipped when torch is not importable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = """
    import sys
    import numpy as np
    import torch
    import torch.distributed as tdist
    import procgroup as dist

    if sys.argv[1] == "torch_first":
        tdist.init_process_group("gloo")
        dist.init_process_group()
    else:
        dist.init_process_group()
        tdist.init_process_group("gloo")
    n = tdist.get_world_size()
    from torch.distributed import distributed_c10d as c10d

    st = c10d._get_default_store()
    while hasattr(st, "underlying_store"):
        st = st.underlying_store
    print(f"torch store {type(st).__name__}", flush=True)
    t = torch.ones(2)
    tdist.all_reduce(t)
    a = np.ones(2)
    dist.all_reduce(a)
    assert t.tolist() == [n, n] and a.tolist() == [n, n], (t, a)
    print(f"both ok rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()
    tdist.destroy_process_group()
"""


def _run(tmp_path: Path, launcher: str, order: str) -> subprocess.CompletedProcess:
    script = tmp_path / "both_groups.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    cmd = (
        [sys.executable, "-m", "procgroup", "run"]
        if launcher == "procgroup"
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    return subprocess.run(
        [*cmd, "--standalone", "--nproc-per-node", "2", str(script), order],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launcher,order",
    [
        ("procgroup", "torch_first"),
        ("torchrun", "torch_first"),
        ("torchrun", "procgroup_first"),
        ("procgroup", "procgroup_first"),
    ],
)
def test_torch_group_and_procgroup_group_in_one_job(tmp_path, launcher, order):
    r = _run(tmp_path, launcher, order)
    ctx = f"exit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, ctx
    assert r.stdout.count("both ok rank") == 2, ctx
    if launcher == "procgroup" and order == "procgroup_first":  # torch's group runs over procgroup's store
        assert r.stdout.count("torch store ProcgroupTorchStore") == 2, ctx


PORT_HELD = """
    import os, time
    import torch.distributed  # torch loaded too: procgroup still hosts its own store on MASTER_PORT
    import procgroup as dist
    from procgroup.errors import PortInUseError

    t0 = time.monotonic()
    try:
        dist.init_process_group(timeout=20)
    except PortInUseError as e:
        print(f"RAISED after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    else:
        print("no error", flush=True)
"""


@pytest.mark.timeout(60)
def test_master_port_held_by_another_process_is_named(tmp_path):
    """With torch loaded, rank 0 hosting the job's store on a MASTER_PORT that another process holds raises
    procgroup's PortInUseError naming MASTER_PORT and the fix, at once (torch does not change procgroup's store)."""
    import socket

    from procgroup.netutil import free_port

    script = tmp_path / "port_held.py"
    script.write_text(textwrap.dedent(PORT_HELD))
    port = free_port()
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PROCGROUP_", "TORCHELASTIC_"))}
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p),
                "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": "0",
                "WORLD_SIZE": "2",
            }
        )
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50)
    out = r.stdout + r.stderr[-3000:]
    assert "RAISED after" in r.stdout, out
    assert "MASTER_PORT" in r.stdout and str(port) in r.stdout, out
    assert float(r.stdout.split("RAISED after ")[1].split("s")[0]) < 10, out
