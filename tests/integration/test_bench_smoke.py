"""`procgroup bench` end to end at a tiny scale: every op runs, is checked, and lands in the JSON.

No timing assertions: only that the numbers exist and are positive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from procgroup.bench.cases import OPS
from procgroup.bench.cli import mpi_unavailable

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PROCGROUP_TIMEOUT"] = "60"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PROCGROUP_SECRET"):
        env.pop(k, None)
    return env


def _bench(tmp_path: Path, *extra: str, timeout: float = 150) -> dict:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    cmd = [
        sys.executable,
        "-m",
        "procgroup",
        "bench",
        "--nproc",
        "2",
        "--max-bytes",
        "1K",
        "--iters",
        "3",
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--quiet",
        *extra,
    ]
    r = subprocess.run(cmd, cwd=str(ROOT), env=_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert "all_reduce" in r.stdout and "busbw" in r.stdout
    ops = extra[extra.index("--ops") + 1].split(",") if "--ops" in extra else OPS
    assert md.read_text().count("####") >= len(ops)
    return json.loads(out.read_text())


def _check_system(data: dict, system: str) -> None:
    assert data["systems"][system]["status"] == "ok", data["systems"][system]
    recs = data["results"][system]
    seen = {r["op"] for r in recs}
    assert seen == set(OPS)
    for r in recs:
        if r.get("skipped"):
            assert r["op"] in ("all_gather", "reduce_scatter", "all_to_all") and r["nominal_bytes"] == 4, r
            continue
        assert "error" not in r, r
        assert r["checked"] is True
        assert r["iters"] == 3
        for f in ("median_s", "p90_s", "mean_s", "min_s"):
            assert r[f] > 0, (f, r)
        if r["op"] != "barrier":
            assert r["bytes"] > 0 and r["algbw_GBps"] > 0 and r["busbw_GBps"] > 0, r
    # every op at every size of the sweep 4 .. 1K (the per-rank-split ops from 16 B at N=2)
    sized = [r for r in recs if r["op"] == "all_reduce" and not r.get("skipped")]
    assert sorted(r["bytes"] for r in sized) == [4, 16, 64, 256, 1024]


@pytest.mark.timeout(180)
def test_bench_procgroup_every_op(tmp_path):
    data = _bench(tmp_path)
    _check_system(data, "procgroup")
    assert data["machine"]["cpu_count"] >= 1 and data["machine"]["procgroup"]
    assert data["config"]["nproc"] == 2
    table = data["table"]
    assert set(table) == set(OPS)


@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed: no gloo to compare with")
def test_bench_compare_gloo(tmp_path):
    data = _bench(tmp_path, "--compare", "gloo", "--no-interleave", timeout=220)
    _check_system(data, "procgroup")
    _check_system(data, "gloo")
    row = data["table"]["all_reduce"][0]
    assert row["ratio_gloo"] > 0


@pytest.mark.timeout(240)
@pytest.mark.skipif(mpi_unavailable() is not None, reason=f"no MPI comparison here: {mpi_unavailable()}")
def test_bench_compare_mpi(tmp_path):
    data = _bench(tmp_path, "--compare", "mpi", "--ops", "all_reduce,barrier,sendrecv", "--no-interleave", timeout=220)
    assert data["systems"]["mpi"]["status"] == "ok", data["systems"]["mpi"]
    assert all(r.get("median_s", 0) > 0 for r in data["results"]["mpi"]), data["results"]["mpi"]
    assert "Open MPI" in data["systems"]["mpi"]["header"]["mpi_library"]


@pytest.mark.timeout(120)
def test_store_scale_256_clients():
    from procgroup.bench.store_scale import run_store_scale

    r = run_store_scale(256, procs=2, threads=2, timeout=90)
    assert r["ok"], r
    assert r["opened"] == 256
    assert r["total_s"] > 0 and r["set_add_s"] > 0


@pytest.mark.timeout(120)
def test_store_scale_script(tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "store_scale.py"), "--clients", "256", "--json", str(out)],
        cwd=str(ROOT),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "256 TCPStore clients" in r.stdout
    assert json.loads(out.read_text())["store_scale"][0]["ok"]
