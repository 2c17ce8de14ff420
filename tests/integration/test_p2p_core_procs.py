"""Issue 14: the compiled shm fast path of blocking send/recv (``_p2pwait.Core``), with real processes.

Each case runs with the compiled path (PROCGROUP_NATIVE=1: the transport's send_fast/recv_fast are the Core's
C methods) and with the pure-Python one (PROCGROUP_NATIVE=0): threads on several groups sharing the transport
lock with collectives alongside, order per (peer, tag) against queued isends/irecvs and unexpected messages
of the same and other tags, every dtype and size around the fast path's limit, the counters, and blocked
ranks asleep.  No process or /dev/shm segment may be left (harness.run_job).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from .harness import Result, json_lines, run_job

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).parent / "scripts" / "p2p_core_worker.py"
FAST_WORKER = Path(__file__).parent / "scripts" / "p2p_fast_worker.py"
ENV = {"PROCGROUP_TIMEOUT": "30", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PROCGROUP_TRANSPORT": "shm"}


def _run(n: int, func: str, native: str, timeout: float = 150, worker: Path = WORKER, cma: str = "1") -> List[Result]:
    env = {**ENV, "PROCGROUP_NATIVE": native, "PROCGROUP_SHM_CMA": cma}
    return run_job("p2pcore", worker, n, func, env, timeout=timeout)


def _compiled(x: Dict[str, object], native: str) -> None:
    """The compiled Core is the path taken with PROCGROUP_NATIVE=1, and only then."""
    if native == "1":
        assert x["core"] is True and x["c_send"] == "builtin_function_or_method", x
    else:
        assert x["core"] is False and x["c_send"] == "method", x


@pytest.mark.parametrize("n,native", [(2, "1"), (3, "1"), (2, "0")])
def test_threads_on_several_groups_share_the_lock_with_collectives(n: int, native: str) -> None:
    results = _run(n, "threads", native)
    for x in (json_lines(r)[0] for r in results[:2]):
        _compiled(x, native)
        assert x["fast_sends"] > 0 and x["fast_recvs"] > 0, x
        assert x["sent"] >= x["p2p_bytes"] > 0, x  # sent_bytes counts what the Core sent


@pytest.mark.parametrize("n,native", [(2, "1"), (3, "1"), (2, "0")])
def test_order_with_queued_and_unexpected_messages_and_collectives(n: int, native: str) -> None:
    results = _run(n, "mixed", native)
    for x in (json_lines(r)[0] for r in results[:2]):
        _compiled(x, native)
        assert x["fast_sends"] > 0 and x["fast_recvs"] > 0, x


@pytest.mark.parametrize("native", ["1", "0"])
def test_every_dtype_and_size_around_the_threshold_both_paths(native: str) -> None:
    results = _run(2, "dtypes_sizes", native, worker=FAST_WORKER)
    x = json_lines(results[1])[0]
    assert x["fast_sends"] > 0 and x["fast_recvs"] > 0, x


@pytest.mark.parametrize("native", ["1", "0"])
def test_blocked_ranks_sleep(native: str) -> None:
    results = _run(2, "asleep", native, timeout=60, cma="0")
    a, b = (json_lines(r)[0] for r in results)
    _compiled(a, native)
    assert 1.8 < a["recv_s"] < 4 and a["recv_cpu"] < 0.1 * a["recv_s"], a
    assert 1.8 < b["send_s"] < 4 and b["send_cpu"] < 0.1 * b["send_s"], b
    if native == "1":  # the streamed send stalled on the full ring and was handed to the general wait
        assert b["fast_handoffs"] >= 1, b


@pytest.mark.parametrize("native", ["1", "0"])
def test_abort_ends_a_blocked_recv(native: str) -> None:
    results = _run(2, "aborted", native, timeout=60)
    x = json_lines(results[0])[0]
    _compiled(x, native)
    assert x["err"] == "BrokenError" and "test abort" in x["msg"], x
    assert 0.9 < x["s"] < 2.5 and x["cpu"] < 0.5 * x["s"], x
