"""Issue 11 hardening with real processes started by hand (no launcher): the two-shell layout, the
store's secret policy, strangers at the store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from procgroup.netutil import free_port

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]

TWO_SHELL = """
import procgroup as dist
dist.init_process_group("cpu")
print(f"rank={dist.get_rank()} local={dist.get_local_rank()}/{dist.get_local_world_size()}", flush=True)
dist.destroy_process_group()
"""


def _env(rank: int, n: int, port: int, extra: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
    """What a user types in one shell: ``WORLD_SIZE=n RANK=r MASTER_ADDR=... MASTER_PORT=... python x.py``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROCGROUP_", "TORCHELASTIC_", "SLURM_"))}
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        env.pop(k, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PROCGROUP_TIMEOUT="20",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        PYTHONUNBUFFERED="1",
    )
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _run_ranks(
    tmp_path: Path, body: str, n: int = 2, extra: Optional[List[Dict[str, Optional[str]]]] = None, timeout: float = 40
) -> List[subprocess.CompletedProcess]:
    """Start ``n`` copies of ``body`` as separate shells would; wait (killing all on timeout)."""
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(body))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(path)],
            env=_env(r, n, port, (extra or [{}] * n)[r]),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(5)
    return out


def test_two_shells_on_one_host_count_two_local_processes(tmp_path):  # type: ignore[no-untyped-def]
    res = _run_ranks(tmp_path, TWO_SHELL, extra=[{"PROCGROUP_SECRET": "s"}, {"PROCGROUP_SECRET": "s"}])
    assert all(r.returncode == 0 for r in res), [r.stderr for r in res]
    assert "rank=0 local=0/2" in res[0].stdout and "rank=1 local=1/2" in res[1].stdout, [r.stdout for r in res]
    text = "".join(r.stderr for r in res)
    assert "assuming one process" not in text, text
