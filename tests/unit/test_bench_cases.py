"""The benchmark's own logic: sizes, layouts, and that its closed-form checks match real op semantics."""

from __future__ import annotations

import numpy as np
import pytest

from procgroup.bench import cases, cli, report
from procgroup.bench.cases import OPS, expected, fill, layout


def _reference(op: str, ins: list, outs: list, n: int) -> list:
    """What each rank's checked buffer must hold after one op (numpy, root 0, ping-pong 0<->1)."""
    if op in ("all_reduce", "reduce"):
        total = sum(ins)
        return [total if (op == "all_reduce" or r == 0) else None for r in range(n)]
    if op == "broadcast":
        return [ins[0].copy() for _ in range(n)]
    if op == "sendrecv":
        return [ins[0].copy() if r in (0, 1) else None for r in range(n)]
    if op == "all_gather":
        g = np.concatenate(ins)
        return [g.copy() for _ in range(n)]
    if op == "reduce_scatter":
        total = sum(ins)
        return list(np.split(total, n))
    if op == "all_to_all":
        chunks = [np.split(x, n) for x in ins]
        return [np.concatenate([chunks[s][r] for s in range(n)]) for r in range(n)]
    raise AssertionError(op)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", [o for o in OPS if o != "barrier"])
@pytest.mark.parametrize("nbytes", [4, 64, 4096])
def test_closed_forms_match_the_op(op, n, nbytes):
    if op == "sendrecv" and n < 2:
        pytest.skip("ping-pong needs 2 ranks")
    lay = layout(op, nbytes, n)
    if lay is None:
        assert op in ("all_gather", "reduce_scatter", "all_to_all") and nbytes // 4 < n
        return
    bufs = [fill(op, lay, r, n) for r in range(n)]
    ref = _reference(op, [b[0].copy() for b in bufs], [b[1] for b in bufs], n)
    for r in range(n):
        want = expected(op, lay, r, n)
        if ref[r] is None:
            assert want is None or op == "reduce"
            continue
        assert want is not None
        np.testing.assert_array_equal(want, ref[r])
        # and the check catches a wrong buffer
        bad = want.copy()
        bad[-1] += 1
        assert cases.check(bad, want, op) is not None
        assert cases.check(want.copy(), want, op) is None


def test_sizes_and_layout():
    assert cases.sizes_between(4, 64 << 20) == [4**k for k in range(1, 14)]
    assert cases.sizes_between(1000, 5000) == [1024, 4096]
    assert cases.parse_size("64M") == 64 << 20 and cases.parse_size("1K") == 1024 and cases.parse_size("4") == 4
    with pytest.raises(ValueError):
        cases.parse_size("lots")
    assert layout("all_gather", 64, 4) == cases.Layout(4, 16, 4)
    assert layout("reduce_scatter", 64, 4) == cases.Layout(16, 4, 4)
    assert layout("all_gather", 4, 2) is None
    assert layout("all_gather", 48, 3).nbytes == 48 and layout("all_gather", 64, 3).nbytes == 60
    assert cases.busbw_factor("all_reduce", 4) == 1.5 and cases.busbw_factor("all_gather", 4) == 0.75
    assert cases.busbw_factor("broadcast", 4) == 1.0


def test_plan_is_the_same_everywhere_and_respects_iters():
    p = cases.plan(OPS, [4, 1 << 20], 2, None)
    assert [c.op for c in p].count("barrier") == 1
    assert all(c.auto for c in p)
    q = cases.plan(OPS, [4], 2, 3)
    assert all(c.iters == 3 and not c.auto and c.warmup >= 1 for c in q)


def test_auto_iterations_give_every_size_a_stable_median():
    """Auto mode times at least MIN_LARGE_ITERS iterations at every size up to 64 MiB, more for smaller ones,
    with a warm-up before each case."""
    counts = []
    for nbytes in cases.sizes_between(4, 64 << 20):
        warm, timed = cases.auto_iters("all_reduce", nbytes)
        assert warm >= 1 and timed >= cases.MIN_LARGE_ITERS, (nbytes, warm, timed)
        counts.append(timed)
    assert counts == sorted(counts, reverse=True)  # never more samples for a larger (slower) message
    assert cases.auto_iters("barrier", 0)[1] >= 200


def test_systems_take_turns_in_every_position_and_after_every_other():
    """Over a cycle of op groups each system runs in every position and right after every other system (a fixed
    order had procgroup always run right after Open MPI; a rotation would keep that)."""
    systems = ["procgroup", "gloo", "mpi"]
    stream = [s for step in range(6) for s in cli.run_order(systems, step)]
    assert all(sorted(cli.run_order(systems, step)) == sorted(systems) for step in range(6))
    for pos in range(3):
        assert sorted(cli.run_order(systems, step)[pos] for step in range(6)) == sorted(systems * 2)
    for s in systems:
        before = {stream[i - 1] for i in range(1, len(stream)) if stream[i] == s}
        assert before >= set(systems) - {s}, (s, before)
    assert cli.run_order(["procgroup"], 5) == ["procgroup"]
    assert [cli.run_order(["procgroup", "mpi"], k)[0] for k in range(4)] == ["procgroup", "mpi"] * 2


def test_ratios_and_targets():
    res = {
        "procgroup": [
            {"op": "all_reduce", "bytes": 4, "median_s": 1e-5},
            {"op": "all_reduce", "bytes": 64 << 20, "median_s": 0.05},
        ],
        "gloo": [{"op": "all_reduce", "bytes": 4, "median_s": 2e-4}],
        "mpi": [{"op": "all_reduce", "bytes": 64 << 20, "median_s": 0.05}],
    }
    by = report.rows_by_op(res)
    assert by["all_reduce"][0]["ratio_gloo"] == pytest.approx(0.05)
    assert by["all_reduce"][1]["ratio_mpi"] == pytest.approx(1.0)
    v = {
        t["target"]: t["status"]
        for t in report.evaluate_targets(by, 4, {"nproc": 4, "procgroup": {"median_s": 0.5}}, None)
    }
    assert v["small all_reduce <= 0.1x gloo"] == "met"
    assert v["64 MiB all_reduce <= 0.8x Open MPI"] == "missed"
    assert report.evaluate_targets(report.rows_by_op({"procgroup": res["procgroup"]}), 4, None, None) == []
    assert "barrier <= 0.05x gloo (N=4)" not in v  # barrier was not measured at all
    assert "64 MiB broadcast <= 1.0x Open MPI (N=2)" not in v
    assert any(k.startswith("startup") and s == "met" for k, s in v.items())
    text = report.console_tables(by, ["procgroup", "gloo", "mpi"], 4)
    assert "ratio gloo" in text and "0.050" in text


def test_mpi_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert "mpi4py is not installed" in cli.mpi_unavailable()
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    assert "mpirun is not on PATH" in cli.mpi_unavailable()


def test_rounds_combine_to_medians_and_keep_per_round_ratios():
    recs = {
        "procgroup": [
            {
                "op": "barrier",
                "bytes": 0,
                "median_s": m,
                "p90_s": m,
                "mean_s": m,
                "min_s": m,
                "max_s": m,
                "iters": 10,
                "round": k,
            }
            for k, m in enumerate([1e-4, 3e-4, 2e-4])
        ],
        "gloo": [
            {
                "op": "barrier",
                "bytes": 0,
                "median_s": m,
                "p90_s": m,
                "mean_s": m,
                "min_s": m,
                "max_s": m,
                "iters": 10,
                "round": k,
            }
            for k, m in enumerate([1e-3, 1e-3, 4e-3])
        ],
    }
    combined = {s: report.combine_rounds(r) for s, r in recs.items()}
    assert combined["procgroup"][0]["median_s"] == pytest.approx(2e-4)
    assert combined["procgroup"][0]["iters"] == 30 and combined["procgroup"][0]["min_s"] == pytest.approx(1e-4)
    by = report.rows_by_op(combined)
    report.add_round_ratios(by, recs, ["procgroup", "gloo"])
    row = by["barrier"][0]
    assert row["ratio_gloo"] == pytest.approx(0.2)
    assert row["ratio_gloo_rounds"] == pytest.approx([0.1, 0.3, 0.05])
