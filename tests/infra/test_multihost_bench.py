"""Smoke test of benchmarks/multihost.py (procgroup vs Open MPI all_reduce across the namespace hosts).

Runs the benchmark on the session's hosts h1..h3 (``--prefix h --no-lock``: the ``netns_hosts``
fixture made them and holds their lock) with tiny sizes and one round, and checks what the real
measurement relies on: both systems ran 6 ranks, 2 per host, every result was checked against its
closed form, procgroup reached the other hosts' ranks over TCP and its own host's over shm, the
report was written, and nothing was left behind (processes in the hosts, /dev/shm segments); the
hosts themselves, which the benchmark found up, stay up.  Skips like every infra test (not root,
namespaces refused, binaries missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .fixtures import NetnsHosts, require_binaries
from .launch import REPO, clean_env, mpi4py_library, netns_inodes, pids_in_netns

pytestmark = [pytest.mark.infra, pytest.mark.timeout(120, method="signal")]

BENCH = REPO / "benchmarks" / "multihost.py"


def test_multihost_benchmark_smoke(netns_hosts: NetnsHosts, tmp_path):
    require_binaries("mpirun", "orted", why="benchmarks/multihost.py's Open MPI side")
    lib = mpi4py_library()
    if lib is None or "Open MPI" not in lib:
        pytest.skip(f"needs mpi4py built for Open MPI (installed: {lib or 'none'})")
    names = list(netns_hosts.names)
    inodes = netns_inodes(names)
    before = pids_in_netns(inodes)
    shm_before = set(os.listdir("/dev/shm"))
    cmd = [
        sys.executable,
        str(BENCH),
        "--prefix",
        "h",
        "--no-lock",
        "--sizes",
        "4K,64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--repeat",
        "1",
        "--mpi-configs",
        "yield",
        "--timeout",
        "60",
        "--run-timeout",
        "60",
        "--out-dir",
        str(tmp_path),
        "--name",
        "smoke",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=clean_env(), stdin=subprocess.DEVNULL)
    ctx = f"$ {' '.join(cmd)}\nexit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, ctx
    res = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").read_text().count("| 0 | 4K |") == 1, ctx

    assert [x["system"] for x in res["runs"]] == ["procgroup", "mpi-yield"], ctx
    for run in res["runs"]:
        assert run["status"] == "ok", ctx
        assert run["header"]["world_size"] == 6, ctx
        assert run["header"]["rank_hosts"] == [h for h in names for _ in range(2)], ctx
        assert [rec["bytes"] for rec in run["records"]] == [4096, 65536], ctx
        assert all(rec["checked"] and rec["median_s"] > 0 for rec in run["records"]), ctx
    assert res["all_checked"] is True
    pt = res["procgroup_header"]["peer_transports"]
    for rank in range(6):  # the other rank of its host over shm, the four on other hosts over tcp
        mate = rank ^ 1
        assert pt[rank] == {"shm": [mate], "tcp": [p for p in range(6) if p not in (rank, mate)]}, pt
    assert {row["bytes"] for row in res["summary"]["ratios"]} == {4096, 65536}

    td = res["teardown"]
    assert td["processes_left"] == [] and td["shm_left"] == [] and td["hosts_removed"] == [], td
    assert all(os.path.exists(f"/run/netns/{h}") for h in names), "the benchmark removed hosts it did not make"
    assert not (pids_in_netns(inodes) - before), "processes left in the hosts"
    new_shm = set(os.listdir("/dev/shm")) - shm_before
    assert not [n for n in new_shm if n.startswith(("procgroup-mhb-", "vader_segment.h"))], new_shm
