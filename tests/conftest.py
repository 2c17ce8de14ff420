"""Shared fixtures: ranks as threads over the in-memory transport."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, List, Optional, Sequence

import pytest

from procgroup.process_group import ProcessGroup, World
from procgroup.transport.memory import MemoryHub

# The real-infrastructure session fixtures live here, at the root, so that tests/infra and tests/mpi share one
# definition: two definitions would mean two session instances, and the second waits on the first's lock.
from .infra.fixtures import (  # noqa: F401 - pytest fixtures and hook
    infra_guard,
    netns_hosts,
    pytest_terminal_summary,
    slurm_cluster,
    sshd_hosts,
)

# The per-user secret file (procgroup.secretfile) is created on first use in $XDG_CONFIG_HOME/procgroup:
# keep the tests (and every process they start, which inherits this) out of the real ~/.config.
_CONFIG_HOME = tempfile.mkdtemp(prefix="procgroup-test-config-")
os.environ["XDG_CONFIG_HOME"] = _CONFIG_HOME
atexit.register(shutil.rmtree, _CONFIG_HOME, True)

# The suite runs on pytest-xdist workers (``-n auto --dist loadgroup`` in pyproject.toml): most tests wait on
# processes, sockets and deadlines for much of their time, so two at once finish the suite sooner on two CPUs.
# Tests that share one machine-wide resource stay on one worker, one after another (their xdist group):
# the network-namespace hosts h1..h3 (with their sshd and Slurm; one session lock, /run/procgroup-infra.lock)
# and the local Ray clusters (each module starts one in the test process).
_INFRA_FIXTURES = frozenset({"infra_guard", "netns_hosts", "slurm_cluster", "sshd_hosts"})
#: at most this many workers for ``-n auto`` (the multi-process tests size their deadlines for a 2-CPU machine)
XDIST_MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: Any) -> Optional[int]:  # noqa: ARG001 - pytest-xdist hook signature
    """``-n auto``: one worker per CPU, at most XDIST_MAX_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS overrides (this
    hook runs before xdist's own, which reads that variable: None leaves the choice to it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return max(1, min(XDIST_MAX_WORKERS, os.cpu_count() or 1))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the groups into the tests' node ids
def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:  # noqa: ARG001 - pytest hook signature
    """Put the tests of one machine-wide resource into one xdist group (one worker runs them in turn)."""
    for item in items:
        if _INFRA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("infra"))
        elif item.nodeid.startswith("tests/ray/"):
            item.add_marker(pytest.mark.xdist_group("ray"))


def run_ranks(n: int, fn: Callable[[int], Any], timeout: float = 30.0) -> List[Any]:
    """Run fn(rank) in n threads; re-raise the first exception; return results by rank."""
    results: List[Any] = [None] * n
    errors: List[Optional[BaseException]] = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {timeout}s")
    for e in errors:
        if e is not None:
            raise e
    return results


def thread_world(
    n: int, hosts: Optional[Sequence[str]] = None, timeout: float = 20.0, store: Any = None
) -> List[ProcessGroup]:
    """One world ProcessGroup per rank, over a MemoryHub (use from the rank threads)."""
    hub = MemoryHub(n)
    hs = list(hosts) if hosts is not None else ["h0"] * n
    groups = []
    for r in range(n):
        w = World(rank=r, size=n, transport=hub.transport(r), store=store, hosts=hs, hostnames=hs, timeout=timeout)
        groups.append(ProcessGroup(w, list(range(n)), 0, "WORLD"))
    return groups


@pytest.fixture
def ranks():
    return run_ranks
