"""Real processes over shared memory and TCP: every collective against numpy references."""

from __future__ import annotations

import re

import pytest

from .harness import collect, report, run_world, spawn_world

TRANSPORTS = ["shm", "tcp"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.timeout(240)
def test_every_collective(ws, transport):
    results = run_world(ws, "collectives", env={"PROCGROUP_TRANSPORT": transport}, timeout=220)
    for r in results:
        assert re.search(r"rank \d+: \d+ checks passed", r.stdout), report(results)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.timeout(180)
def test_64_mib(ws, transport):
    results = run_world(ws, "big", ["64"], env={"PROCGROUP_TRANSPORT": transport}, timeout=170)
    assert all("big ok" in r.stdout for r in results)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_p2p_any_source_and_objects(transport):
    run_world(4, "p2p", env={"PROCGROUP_TRANSPORT": transport})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_waiting_rank_does_not_burn_a_core(transport):
    results = run_world(3, "idle_wait", ["2"], env={"PROCGROUP_TRANSPORT": transport})
    for r in results[1:]:
        m = re.search(r"waited ([\d.]+)s cpu ([\d.]+)s", r.stdout)
        assert m, report(results)
        waited, cpu = float(m.group(1)), float(m.group(2))
        assert waited > 1.5
        assert cpu < 0.1 * waited, f"rank {r.rank} used {cpu:.3f}s of CPU while waiting {waited:.2f}s"


def test_missing_rank_is_named_not_a_bare_timeout():
    """WORLD_SIZE=2 RANK=0 alone, short timeout: the error names rank 1."""
    procs = spawn_world(2, "init_only", env={"TEST_INIT_TIMEOUT": "3"}, ranks=[0])
    (res,) = collect(procs, 30)
    assert res.returncode != 0
    assert "RendezvousTimeoutError" in res.stderr
    assert "missing: rank [1]" in res.stderr, res.stderr
    assert "PROCGROUP_TIMEOUT" in res.stderr


def test_duplicate_rank_is_an_immediate_error():
    procs = spawn_world(3, "init_only", env={"TEST_INIT_TIMEOUT": "20"}, ranks=[0, 1, 1])
    results = collect(procs, 30)
    assert all(r.returncode != 0 for r in results), report(results)
    assert all("duplicate rank 1" in r.stderr for r in results), report(results)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_subgroups(transport):
    results = run_world(4, "subgroups", env={"PROCGROUP_TRANSPORT": transport})
    assert all("subgroups ok" in r.stdout for r in results)


@pytest.mark.parametrize("cma", ["1", "0"])
@pytest.mark.timeout(180)
def test_64_mib_shm_with_and_without_single_copy(cma):
    """Large shm messages go by process_vm_readv (one copy) or, with PROCGROUP_SHM_CMA=0, through the rings."""
    results = run_world(3, "big", ["64"], env={"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_SHM_CMA": cma}, timeout=170)
    assert all("big ok" in r.stdout for r in results)
