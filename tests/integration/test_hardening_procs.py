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

from .harness import shell_env

pytestmark = pytest.mark.timeout(60)

TWO_SHELL = """
import procgroup as dist
dist.init_process_group("cpu")
print(f"rank={dist.get_rank()} local={dist.get_local_rank()}/{dist.get_local_world_size()}", flush=True)
dist.destroy_process_group()
"""


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
            env=shell_env(r, n, port, (extra or [{}] * n)[r]),
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


# --------------------------------------------------------------------------- the secret policy (items 13, 14)

AGREE = """
import os, stat, procgroup as dist, numpy as np
dist.init_process_group("cpu")
x = np.ones(2)
dist.all_reduce(x)
print(f"rank={dist.get_rank()} sum={x[0]:g}", flush=True)
dist.destroy_process_group()
"""


def _no_secret(home: Path, **more: Optional[str]) -> Dict[str, Optional[str]]:
    """A shell with no PROCGROUP_SECRET and ``home`` as its home directory."""
    return {"HOME": str(home), "XDG_CONFIG_HOME": None, "PROCGROUP_SECRET": None, **more}


def test_fresh_home_creates_a_private_secret_file_and_both_ranks_agree(tmp_path):  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    home.mkdir()
    res = _run_ranks(tmp_path, AGREE, extra=[_no_secret(home), _no_secret(home)])
    assert all(r.returncode == 0 for r in res), [r.stderr for r in res]
    assert "rank=0 sum=2" in res[0].stdout and "rank=1 sum=2" in res[1].stdout
    f = home / ".config" / "procgroup" / "secret"
    assert f.is_file() and (f.stat().st_mode & 0o777) == 0o600
    assert (f.parent.stat().st_mode & 0o077) == 0
    assert len(f.read_text().strip()) == 64
    assert "derived from the job id" not in res[0].stderr + res[1].stderr


def test_different_secret_files_fail_at_once_naming_the_file(tmp_path):  # type: ignore[no-untyped-def]
    a, b = tmp_path / "a.secret", tmp_path / "b.secret"
    a.write_text("aaaa\n")
    b.write_text("bbbb\n")
    t0 = __import__("time").monotonic()
    res = _run_ranks(
        tmp_path,
        AGREE,
        extra=[{"PROCGROUP_SECRET": None, "PROCGROUP_SECRET_FILE": str(p), "PROCGROUP_TIMEOUT": "4"} for p in (a, b)],
    )
    took = __import__("time").monotonic() - t0
    assert res[1].returncode != 0, res[1].stderr
    assert "AuthenticationError" in res[1].stderr and f"PROCGROUP_SECRET_FILE={b}" in res[1].stderr, res[1].stderr
    # the store (rank 0) names its own side's file
    assert "secrets differ: this side uses PROCGROUP_SECRET_FILE=" + str(a) in res[0].stderr, res[0].stderr
    assert took < 15, took


def test_different_homes_fail_naming_the_per_user_file(tmp_path):  # type: ignore[no-untyped-def]
    homes = [tmp_path / "h0", tmp_path / "h1"]
    for h in homes:
        h.mkdir()
    res = _run_ranks(tmp_path, AGREE, extra=[_no_secret(h, PROCGROUP_TIMEOUT="4") for h in homes])
    assert res[1].returncode != 0
    want = f"the per-user secret file {homes[1] / '.config' / 'procgroup' / 'secret'}"
    assert want in res[1].stderr, res[1].stderr


def test_a_group_readable_secret_file_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    home = tmp_path / "home"
    f = home / ".config" / "procgroup" / "secret"
    f.parent.mkdir(parents=True)
    f.write_text("x" * 64)
    f.chmod(0o644)
    res = _run_ranks(tmp_path, AGREE, n=1, extra=[_no_secret(home)])
    assert res[0].returncode != 0 and f"chmod 600 {f}" in res[0].stderr, res[0].stderr


OUTSIDER_JOB = """
import os, sys, time, procgroup as dist, numpy as np
dist.init_process_group("cpu")
flag = sys.argv[0] + ".outsider-done"
if dist.get_rank() == 0:
    print("ready", flush=True)
end = time.monotonic() + 20
while not os.path.exists(flag) and time.monotonic() < end:
    time.sleep(0.05)
for _ in range(20):  # the job goes on, unaffected
    x = np.ones(2)
    dist.all_reduce(x)
    time.sleep(0.05)
print(f"rank={dist.get_rank()} sum={x[0]:g}", flush=True)
dist.destroy_process_group()
"""


def test_an_outsider_without_the_secret_cannot_write_a_failure_record(tmp_path):  # type: ignore[no-untyped-def]
    """The issue's attack: with no PROCGROUP_SECRET the key was derived from host:port, so anyone who could
    reach the port wrote ``failure`` and stopped the job.  Now the key is the per-user secret."""
    import json
    import threading

    from procgroup.errors import AuthenticationError
    from procgroup.store import TCPStore

    home = tmp_path / "home"
    home.mkdir()
    path = tmp_path / "prog.py"
    port_box: List[int] = []
    outcome: Dict[str, object] = {}

    def outsider() -> None:
        deadline = __import__("time").monotonic() + 20
        while not (tmp_path / "ready").exists() and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.05)
        port = port_box[0]
        for job_id in (f"127.0.0.1:{port}", "default"):  # every key the old derivation could give
            try:
                s = TCPStore("127.0.0.1", port, secret=f"procgroup-derived:{job_id}", timeout=5, connect_timeout=5)
            except AuthenticationError as e:
                outcome.setdefault("refused", []).append(str(e))  # type: ignore[union-attr]
                continue
            for key in ("failure", "pg/0/failure"):
                s.set(key, json.dumps({"peer": 1, "text": "outsider"}))
            outcome["wrote"] = True
        Path(str(path) + ".outsider-done").write_text("")

    body = OUTSIDER_JOB.replace('print("ready", flush=True)', f'open({str(tmp_path / "ready")!r}, "w").close()')
    t = threading.Thread(target=outsider, daemon=True)
    real_free_port = free_port

    def grab_port() -> int:
        p = real_free_port()
        port_box.append(p)
        return p

    globals()["free_port"] = grab_port
    try:
        t.start()
        res = _run_ranks(tmp_path, body, extra=[_no_secret(home), _no_secret(home)])
    finally:
        globals()["free_port"] = real_free_port
    t.join(10)
    assert "wrote" not in outcome, outcome
    assert len(outcome.get("refused", [])) == 2, outcome  # type: ignore[arg-type]
    assert all(r.returncode == 0 for r in res), [r.stderr for r in res]
    assert "rank=0 sum=2" in res[0].stdout and "rank=1 sum=2" in res[1].stdout
    assert "client failed authentication" in res[0].stderr, res[0].stderr
