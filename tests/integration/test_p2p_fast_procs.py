"""Issue 14: the blocking small-message fast path of send/recv on the shm transport, with real processes.

The fast path (``ShmTransport.send_fast``/``recv_fast``) writes a small blocking send straight into the
peer's ring and takes a blocking receive's message straight out of it, when nothing queued on that
(peer, tag) could be overtaken.  These tests mix it with isend/irecv posted before and after, batches,
any-source receives, messages above its size and rendezvous messages, every dtype, and the errors
(dtype, byte count, tag, a killed peer); the fast path's counters show it was taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest

from .harness import Result, json_lines, report, run_job

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).parent / "scripts" / "p2p_fast_worker.py"
ENV = {"PROCGROUP_TIMEOUT": "30", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


def _run(n: int, func: str, env: Dict[str, str], timeout: float = 150, ok: bool = True) -> List[Result]:
    """Run ``func`` of the worker on ``n`` ranks under a run id of its own; no segment of it may be left."""
    return run_job("p2pfast", WORKER, n, func, {**ENV, **env}, timeout=timeout, ok=ok)


@pytest.mark.parametrize(
    "n,cma,native", [(2, "1", "1"), (3, "1", "1"), (4, "1", "1"), (2, "0", "1"), (3, "0", "1"), (2, "1", "0")]
)
def test_order_stress_blocking_fast_path_mixed_with_isend_irecv_any_source(n: int, cma: str, native: str) -> None:
    """(CMA off: large messages stream through the rings and fill them, so small sends queue behind them.
    PROCGROUP_NATIVE=0: recv_fast polls in Python instead of the compiled poll.)"""
    env = {"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_SHM_CMA": cma, "PROCGROUP_NATIVE": native}
    results = _run(n, "order_stress", env)
    for r in results:
        (x,) = json_lines(r)
        assert x["fast_sends"] > 0 and x["fast_recvs"] > 0, x  # the fast path was taken (and mixed)


def test_order_stress_tcp_unchanged() -> None:
    _run(3, "order_stress", {"PROCGROUP_TRANSPORT": "tcp"}, timeout=170)


@pytest.mark.parametrize("n", [2, 3])
def test_every_dtype_and_size_around_the_threshold(n: int) -> None:
    results = _run(n, "dtypes_sizes", {"PROCGROUP_TRANSPORT": "shm"})
    x = json_lines(results[1])[0]
    assert x["fast_sends"] > 0 and x["fast_recvs"] > 0, x


def test_edges_0d_noncontiguous_readonly_bad_tags_subgroup_nonmember() -> None:
    results = _run(3, "edges", {"PROCGROUP_TRANSPORT": "shm"})
    recs = [json_lines(r)[0] for r in results]
    assert recs[1]["ro"]["err"] == "ConfigError" and "read-only" in recs[1]["ro"]["msg"], recs[1]
    for x in recs[:2]:
        assert x["neg_send"]["err"] == "ConfigError" and "tag=-1" in x["neg_send"]["msg"], x
        assert x["big_recv"]["err"] == "ConfigError" and "outside [0, 2**40)" in x["big_recv"]["msg"], x
        assert x["self"]["err"] == "ConfigError" and "itself" in x["self"]["msg"], x
    assert recs[2]["nonmember"] == [None, -1], recs[2]
    assert recs[0]["fork"] == 0, recs[0]  # the forked child's send was refused, naming the fork


def test_errors_dtype_count_size_tag() -> None:
    results = _run(2, "errors", {"PROCGROUP_TRANSPORT": "shm"})
    cases = {x["case"]: x for x in json_lines(results[1])}
    d = cases["dtype"]
    assert d["err"] == "ConfigError" and "dtype mismatch" in d["msg"] and "float32" in d["msg"], d
    assert "tag 11" in d["msg"] and "rank 0" in d["msg"] and d["s"] < 2.0, d
    c = cases["count"]
    assert c["err"] == "ConfigError" and "got 12 bytes from rank 0" in c["msg"] and "holds 16" in c["msg"], c
    big = cases["larger"]
    assert big["err"] == "ProcGroupError" and "20 bytes" in big["msg"] and "does not fit" in big["msg"], big
    t = cases["tag"]
    assert t["err"] == "DistTimeoutError" and "recv" in t["msg"] and "tag 21" in t["msg"], t
    assert "rank 1" in t["msg"] and "PROCGROUP_TIMEOUT" in t["msg"] and 1.5 < t["s"] < 8, t
    b = cases["broken"]  # the timeout broke the subgroup: a later blocking recv is refused before anything
    assert b["err"] is not None and "recv" in b["msg"] and b["s"] < 1.0, b


@pytest.mark.parametrize("n,native", [(2, "1"), (3, "1"), (2, "0")])
def test_killed_peer_is_named_and_the_waiter_sleeps(n: int, native: str) -> None:
    env = {"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_NATIVE": native}
    results = _run(n, "killed_peer", env, timeout=60, ok=False)
    assert results[1].returncode == -9, report(results)
    for i, r in enumerate(results):
        if i == 1:
            continue
        assert r.returncode == 0, report(results)
        (x,) = json_lines(r)
        assert x["err"] == "PeerFailureError" and "rank 1" in x["msg"] and "died" in x["msg"], x
        assert 1.5 < x["s"] < 6, x
        assert x["cpu"] < 0.2 * x["s"], x  # asleep, not spinning, while it waited


@pytest.mark.parametrize("native", ["1", "0"])
def test_sleeping_receiver_is_always_woken_by_the_next_send(native: str) -> None:
    """A receiver that sleeps on its doorbell (the spin off) is woken by every send: the sender writes the
    doorbell, fences and reads the sleep flag (compiled: inside _p2pwait.put; else Doorbell.ring).  Without the
    wake-up a receive whose sender waited 4-12 ms is only noticed at its next dtype probe (median ~4 ms)."""
    env = {"PROCGROUP_TRANSPORT": "shm", "PROCGROUP_SHM_SPIN_US": "0", "PROCGROUP_NATIVE": native}
    results = _run(2, "sleeper_wakeup", env, timeout=120)
    for r in results:
        (x,) = json_lines(r)
        assert x["n_long"] + x["n_short"] == 300 and x["n_long"] > 30 and x["fast_sends"] > 0, x
        assert x["median_long_ms"] < 1.5, x  # woken by the send (~0.1 ms), not by the probe's timeout
