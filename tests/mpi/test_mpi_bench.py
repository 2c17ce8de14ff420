"""``procgroup bench --backend mpi --compare cpu,mpi``: the mpi backend beside its cpu backend and raw mpi4py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..infra.launch import REPO, clean_env


@pytest.mark.timeout(300)
def test_bench_backend_mpi_against_cpu_and_raw_mpi4py(ompi, tmp_path):
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "procgroup", "bench", "--nproc", "2", "--backend", "mpi", "--compare", "cpu,mpi"]
    cmd += ["--ops", "all_reduce,sendrecv", "--sizes", "4,64K", "--iters", "20", "--quiet", "--json", str(out)]
    env = clean_env(ompi.env)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=str(REPO))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "mpi" and data["config"]["systems"] == ["procgroup", "cpu", "mpi"]
    assert all(s["status"] == "ok" for s in data["systems"].values()), data["systems"]
    assert data["systems"]["procgroup"]["header"]["backend"] == "mpi"
    for system in ("procgroup", "cpu", "mpi"):
        got = {(x["op"], x["bytes"]) for x in data["results"][system] if x.get("median_s", 0) > 0}
        assert got == {("all_reduce", 4), ("all_reduce", 64 << 10), ("sendrecv", 4), ("sendrecv", 64 << 10)}, system
    targets = {t["target"] for t in data["targets"]}
    assert "all_reduce 4: <= 3 us over raw mpi4py" in targets, targets
    assert "pg-cpu med us" in r.stdout and "MPI med us" in r.stdout
