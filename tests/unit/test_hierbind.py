"""The all_reduces of a group spanning hosts bound once per call shape (``algorithms.hierbind``), ranks as threads.

Each rank's Comm carries its host's shared slots (as a group spanning hosts does).  Every (dtype, op, count) of
the hierarchical and the multi-leader sizes is all-reduced twice on one parent Comm (the tag and deadline set per
call, as a plan's group Comm is), the results exact and bitwise equal on every rank; in the mixed runs a third of
the ranks (rotating, leaders among them) take the bound path and the others select's algorithm in the same calls
(same steps, check words and messages).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

from procgroup.algorithms import allreduce as AR
from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms import bigarena as BA
from procgroup.algorithms import hierbind as HB
from procgroup.algorithms import select
from procgroup.deadline import Deadline
from procgroup.ops import ReduceOp, finalize

from .test_algorithms import DTYPES, OPS, check_reduced, contrib, kernel, run_ranks, storage, valid

LAYOUTS = [
    ["a", "a", "b", "b", "c", "c"],
    ["a", "b", "c", "a", "b", "c"],  # interleaved
    ["a", "a", "b", "b", "b"],  # uneven: hierarchical only
    ["x", "x", "x", "y", "y", "y"],
]
_BINDERS = {AR.allreduce_hierarchical: HB.bind_hierarchical, AR.allreduce_multileader: HB.bind_multileader}


def _cases() -> List[Any]:
    cases = [(dt, ReduceOp.SUM, n) for dt in DTYPES for n in (1, 7, 4089, 8177, 20_001)]
    cases += [(dt, op, 8177) for dt in DTYPES for op in OPS if op is not ReduceOp.SUM and valid(op, dt)]
    m = select.MULTILEADER_MIN // 4
    cases += [("float32", ReduceOp.SUM, m), ("float64", ReduceOp.MAX, m // 2 * 3), ("int32", ReduceOp.SUM, m + 6)]
    cases += [("float32", ReduceOp.SUM, m + 1), ("int64", ReduceOp.PRODUCT, 3 * m)]  # odd: multileader unbound
    return cases


def _run(hosts: List[str], mix: bool) -> Dict[str, int]:
    p = len(hosts)
    cases = _cases()
    out: Dict[Any, bytes] = {}
    bound = {"hierarchical": 0, "multileader": 0}
    lock = threading.Lock()

    def body(r: int, make: Callable[..., Any]) -> None:
        comm = make(1)  # one parent Comm for every call, as a plan's group Comm
        for k, (dt, op, n) in enumerate(cases):
            st, kern = storage(dt), kernel(op, dt)
            nb = n * st.itemsize
            algo = select.choose_all_reduce(comm, nb, n)
            binder = _BINDERS.get(algo)
            fn = binder(comm, nb, n, st, kern) if binder is not None else None
            if fn is not None and r == 0:
                with lock:
                    bound[algo.__name__.split("_")[-1]] += 1
            for rep in range(2):
                buf = contrib(dt, op, r, n)
                comm.tag = (2 * k + rep + 1) << 20
                comm.deadline = Deadline.after(20)
                if fn is not None and not (mix and (r + k + rep) % 3):  # mixed: which leaders bind rotates
                    fn(comm, buf)
                else:
                    select.all_reduce(comm, buf, kern)
                finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
                check_reduced(dt, op, p, buf, f"case {k} call {rep} {dt} {op.name} n={n} rank {r}/{p}")
                out[(r, k, rep)] = buf.tobytes()

    run_ranks(p, body, hosts=hosts, host_arenas=True, timeout=60)
    for k in range(len(cases)):
        for rep in range(2):
            assert len({out[(r, k, rep)] for r in range(p)}) == 1, f"case {k} call {rep}: ranks disagree bitwise"
    return bound


@pytest.mark.parametrize("mix", [False, True], ids=["bound", "mixed"])
@pytest.mark.parametrize("hosts", LAYOUTS, ids=["-".join(h) for h in LAYOUTS])
def test_bound_all_reduces_match_the_algorithms(hosts: List[str], mix: bool) -> None:
    bound = _run(hosts, mix)
    assert bound["hierarchical"] > 0, "nothing was bound: the test would test nothing"
    uniform = AR.uniform_layout(AR.host_layout(hosts, len(hosts)))
    assert (bound["multileader"] > 0) == uniform, bound


@pytest.mark.parametrize("hosts", [LAYOUTS[0], LAYOUTS[3]], ids=["-".join(LAYOUTS[0]), "-".join(LAYOUTS[3])])
def test_multileader_pieces_bound_and_unbound_meet(hosts: List[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers above ``select.MULTILEADER_CHUNK`` (lowered, with MULTILEADER_WHOLE: many pieces, odd last ones) run
    piece by piece, bound or not, the ranks of both kinds in the same calls: exact and bitwise equal everywhere."""
    monkeypatch.setattr(select, "MULTILEADER_CHUNK", 96 << 10)
    monkeypatch.setattr(select, "MULTILEADER_WHOLE", 96 << 10)
    seen: List[int] = []
    real = AR.allreduce_multileader

    def counted(comm: Any, buf: np.ndarray, *a: Any) -> None:
        seen.append(buf.shape[0])
        real(comm, buf, *a)

    monkeypatch.setattr(AR, "allreduce_multileader", counted)
    bound = _run(hosts, True)
    assert bound["multileader"] > 0, bound
    assert any(n * 4 <= 96 << 10 for n in seen), "no piece ran through the algorithm"


def test_multileader_pieces_cover_the_buffer_in_equal_blocks() -> None:
    assert AR.multileader_pieces(1 << 20, 2, 4, 1 << 20) == [
        (0, 1 << 18),
        (1 << 18, 2 << 18),
        (2 << 18, 3 << 18),
        (3 << 18, 1 << 20),
    ]
    assert AR.multileader_pieces(1000, 2, 4, 0) == [(0, 1000)]  # 0: whole
    assert AR.multileader_pieces(1000, 2, 4, 4000) == [(0, 1000)]  # fits
    mib = 1 << 20
    assert AR.multileader_pieces(mib // 4, 2, 4, 768 << 10, mib) == [(0, mib // 4)]  # whole up to ``whole`` bytes
    assert [b - a for a, b in AR.multileader_pieces(mib // 4 + 2, 2, 4, 768 << 10, mib)] == [131074, 131072]
    assert len(AR.multileader_pieces(mib, 2, 4, 768 << 10, mib)) == 6  # 4 MiB: six pieces of 683 KiB
    for n, per, isz, chunk in [(393216, 3, 8, 1 << 20), (262145, 2, 4, 1 << 20), (1000003, 3, 4, 1 << 20),
                               (7, 2, 4, 8), (16 << 20, 2, 4, 1 << 20), (99_991, 4, 2, 10_000)]:  # fmt: skip
        ps = AR.multileader_pieces(n, per, isz, chunk)
        sizes = [b - a for a, b in ps]
        assert ps[0][0] == 0 and ps[-1][1] == n and all(x[1] == y[0] for x, y in zip(ps, ps[1:])), ps
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0], sizes  # equal, the last no longer
        assert all(s % per == 0 for s in sizes[:-1]), sizes  # whole blocks: equal per member
        assert max(sizes) * isz <= chunk or max(sizes) <= per, (n, per, isz, chunk, sizes)


def test_nothing_is_bound_without_host_slots_or_hosts() -> None:
    """A Comm without its host's shared slots, or one host only: None (the plan runs the algorithm)."""
    got: List[Any] = []

    def body(r: int, make: Callable[..., Any]) -> None:
        c = make(1)
        got.append(HB.bind_hierarchical(c, 40_000, 10_000, np.dtype("float32"), kernel(ReduceOp.SUM, "float32")))

    run_ranks(4, body, hosts=["a", "a", "b", "b"])
    run_ranks(4, body, hosts=["a"] * 4, host_arenas=True)
    run_ranks(3, body, hosts=["a", "b", "c"], host_arenas=True)  # one rank a host: no host stage
    assert got == [None] * 11


def test_tunables_change_with_every_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan compares select.tunables() per call: each threshold the binding depends on changes it."""
    base = select.tunables()
    assert select.tunables() == base
    for mod, name in [
        (select, "MULTILEADER_MIN"),
        (select, "MULTILEADER_CHUNK"),
        (select, "MULTILEADER_WHOLE"),
        (select, "INTER_DIRECT_SMALL"),
        (select, "HOST_SLOTS_MAX"),
        (select, "HOST_SLOTS_BCAST_MAX"),
        (select, "HOST_SPLIT_MAX"),
        (BA, "DIRECT_MAX"),
        (BA, "REDUCE_DIRECT_READS"),
        (BA, "STEP_MAX"),
        (A2A, "STEP_MAX"),
    ]:
        with monkeypatch.context() as m:
            m.setattr(mod, name, getattr(mod, name) + 8)
            assert select.tunables() != base, name
    with monkeypatch.context() as m:
        m.setitem(select.BIG_LIMIT, "reduce", 1)
        assert select.tunables() != base
    with monkeypatch.context() as m:
        m.setattr(select, "HIERARCHICAL", False)
        assert select.tunables() != base
    old = AR._stages
    try:
        AR.install_stage_choices(AR.StageChoices(old.all_reduce_flat, old.reduce, old.broadcast))
        assert select.tunables() != base
    finally:
        AR.install_stage_choices(old)
    assert select.tunables() == base
