"""The compiled bookkeeping of planned calls (procgroup.groupcore, issue 14): the same state, errors and
records as ``ProcessGroup._run_plan_py``, which the compiled ``run_plan`` hands every uncommon case.

Ranks are threads over the in-memory transport.  Each test that compares the two paths runs the same calls
on a world per path and checks every field a planned call touches.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
import zlib

import numpy as np
import pytest

import procgroup as dist
from procgroup import groupcore
from procgroup.errors import CollectiveMismatchError, DistTimeoutError, GroupBrokenError, PeerFailureError
from procgroup.flight import as_record
from procgroup.plans import Plan
from procgroup.process_group import SLOW, ProcessGroup, abort_world
from procgroup.tags import fingerprint

from ..conftest import run_ranks, thread_world

pytestmark = pytest.mark.timeout(120)
compiled = pytest.mark.skipif(not groupcore.COMPILED, reason="the _groupcore extension was not built")


def calls(g: ProcessGroup, r: int) -> None:
    """A mix of planned calls (each shape twice: the second is planned), on rank ``r`` of ``g``."""
    for _ in range(2):
        x = np.full(5, r + 1, np.float32)
        dist.all_reduce(x, group=g)
        assert np.array_equal(x, [3] * 5)
        b = np.full(3, r, np.int64)
        dist.broadcast(b, 1, group=g)
        assert np.array_equal(b, [1] * 3)
        dist.barrier(group=g)
        y = np.full(4, r + 2, np.float64)
        dist.reduce(y, 0, op=dist.ReduceOp.MAX, group=g)
        if r == 0:
            assert np.array_equal(y, [3] * 4)
        out = np.zeros(4, np.int32)
        dist.all_gather_into_tensor(out, np.full(2, r, np.int32), group=g)
        assert np.array_equal(out, [0, 0, 1, 1])


def state(g: ProcessGroup) -> dict:
    """Every field a planned call reads or writes (flight entries as (seq, op, state))."""
    fl = [as_record(e) for e in g.flight]
    return {
        "seq": g.seq,
        "chain": g._chain,
        "window": list(g.chain),
        "flight": [(f.seq, f.op, f.state) for f in fl],
        "last": g.last_completed,
        "inflight": g.inflight,
        "busy": g._busy,
        "owner": g._owner,
        "comm_busy": g._comm_busy,
        "tag": g._comm.tag if g._comm is not None else None,
    }


@compiled
@pytest.mark.parametrize("data", [b"", b"\x01", b"ab", bytes(range(256)) * 3])
@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, 123456789])
def test_crc32_is_zlibs(data, value):
    assert groupcore.crc32(data, value) == zlib.crc32(data, value)


@compiled
def test_the_python_twins_have_the_compiled_types_fields():
    """Without the extension, PyGroupCore/PyPlanCore stand in: they must hold the same fields as the C types."""
    import procgroup._groupcore as c

    def members(t):
        return {k for k, v in vars(t).items() if type(v).__name__ == "member_descriptor"}

    assert members(c.GroupCore) == set(groupcore.PyGroupCore.__slots__)
    assert members(c.PlanCore) == set(groupcore.PyPlanCore.__slots__)


def test_both_paths_leave_the_same_state():
    """The same calls on a compiled world and a Python one: seq, chain, window, flight, tag, token alike."""
    worlds = {fast: thread_world(2) for fast in (True, False)}
    for pgs in worlds.values():
        for g in pgs:
            g._fast = pgs is worlds[True]

    def body(r):
        for pgs in worlds.values():
            pgs[r].set_home_thread()
            calls(pgs[r], r)
        return state(worlds[True][r]), state(worlds[False][r])

    for c, p in run_ranks(2, body):
        assert c == p
        assert c["seq"] == 10 and c["last"] == 9 and c["inflight"] is None and c["busy"] == [True]
        assert c["flight"][-1][2] == "completed"
        assert c["owner"] == 0 and not c["comm_busy"]


@compiled
def test_the_compiled_path_takes_the_planned_calls():
    """Planned calls go through GroupCore.run_plan without _run_plan_py (counted), and _fast=False hands
    every one to it."""
    pgs = thread_world(2)
    seen = [[], []]

    def body(r):
        g = pgs[r]
        py = g._run_plan_py

        def counting(plan, a=None, b=None):
            seen[r].append(plan.op)
            return py(plan, a, b)

        g._run_plan_py = counting  # type: ignore[method-assign]
        calls(g, r)
        n = len(seen[r])
        g._fast = False
        calls(g, r)
        return n, len(seen[r]) - n

    for n, m in run_ranks(2, body):
        assert n == 0  # the first call of each shape takes run(): no plan yet
        assert m == 10


@pytest.mark.parametrize("fast", [True, False])
def test_an_error_of_the_call_gets_its_context_and_breaks_the_group(fast):
    """plan.fn raising a procgroup error: the op's context, the flight entry failed, the token back, the group
    broken; later calls refused at once."""
    pgs = thread_world(2)

    def body(r):
        g = pgs[r]
        g._fast = fast
        calls(g, r)
        plan = Plan(g, "all_reduce", ("all_reduce", "injected"), _raise(PeerFailureError("peer 1 died (injected)")))
        seq = g.seq
        with pytest.raises(PeerFailureError) as e:
            g.run_plan(plan)
        msg = str(e.value)
        assert f"all_reduce (seq {seq})" in msg and f"rank {r}" in msg and "peer 1 died (injected)" in msg
        assert isinstance(e.value.__cause__, PeerFailureError)
        last = as_record(g.flight[-1])
        assert (last.seq, last.state) == (seq, "failed") and last.end is not None
        assert g.inflight is None and g._busy == [True] and g._owner == 0 and g.seq == seq + 1
        with pytest.raises(GroupBrokenError, match="broken since"):
            dist.barrier(group=g)
        assert g.seq == seq + 1
        return msg

    run_ranks(2, body)


@pytest.mark.parametrize("fast", [True, False])
def test_another_error_of_the_call_passes_through_and_the_group_goes_on(fast):
    """A non-procgroup error (a user's reducer, a bug) is raised as it is, with its traceback; the entry is
    failed, the token back; the group is not broken (its members stay in step only if all failed alike)."""
    pgs = thread_world(1)
    g = pgs[0]
    g._fast = fast
    g.set_home_thread()

    def boom(c, a, b):
        raise ValueError("boom (injected)")

    plan = Plan(g, "barrier", ("barrier", "injected"), boom)
    with pytest.raises(ValueError, match="boom") as e:
        g.run_plan(plan)
    assert any(tb.name == "boom" for tb in e.traceback)
    last = as_record(g.flight[-1])
    assert last.state == "failed" and g.inflight is None and g._busy == [True]
    ok = Plan(g, "barrier", ("barrier",), lambda c, a, b: None)
    assert g.run_plan(ok) is None
    assert as_record(g.flight[-1]).state == "completed" and g.last_completed == g.seq - 1


@pytest.mark.parametrize("fast", [True, False])
def test_the_uncommon_cases_take_the_python_path(fast):
    """Another thread than the home one: SLOW before a seq is taken; a halted group: its error; a deadline
    that expires inside the call: DistTimeoutError with the elapsed time."""
    pgs = thread_world(1, timeout=0.2)
    g = pgs[0]
    g._fast = fast
    g.set_home_thread()
    plan = Plan(g, "barrier", ("barrier",), lambda c, a, b: None)
    out = []
    t = threading.Thread(target=lambda: out.append(g.run_plan(plan)))
    t.start()
    t.join(10)
    assert out == [SLOW] and g.seq == 0

    def late(c, a, b):
        raise DistTimeoutError(f"waited {c.deadline.elapsed():.1f}s (injected)")

    with pytest.raises(DistTimeoutError, match=r"barrier \(seq 0\)"):
        g.run_plan(Plan(g, "barrier", ("barrier", "late"), late))
    with pytest.raises(GroupBrokenError):
        g.run_plan(plan)
    assert g.seq == 1


@pytest.mark.parametrize("fast", [True, False])
def test_what_the_watchdog_learned_reaches_a_call_that_would_not_wait(fast):
    """abort_world (the watchdog's finding): the next call of every group of the world raises it at once, with
    its context, even a call that completes without the transport (a broadcast root's, a size-1 step); every
    later call, of any group of that world: GroupBrokenError naming it.  A group of another world goes on."""
    pgs = thread_world(1)
    g, other = pgs[0], thread_world(1)[0]
    g._fast = other._fast = fast
    g.set_home_thread()
    other.set_home_thread()
    sub = ProcessGroup(g.world, [0], 1, "sub")
    sub.set_home_thread()
    ran = []
    plan = Plan(g, "broadcast", ("broadcast", "float32", 4, "root=0"), lambda c, a, b: ran.append(1))
    assert g.run_plan(plan) is None and ran == [1]
    abort_world(g.world, CollectiveMismatchError("collective mismatch in group WORLD at seq 0 (injected)"))
    seq = g.seq
    first = r"broadcast .*on rank 0 \[refused before it started\]: .* at seq 0 \(injected\)"
    with pytest.raises(CollectiveMismatchError, match=first):
        g.run_plan(plan)
    with pytest.raises(GroupBrokenError, match="broken since.*CollectiveMismatchError.*injected"):
        g.run_plan(plan)
    with pytest.raises(GroupBrokenError):
        dist.barrier(group=g)
    with pytest.raises(GroupBrokenError, match="broken since broadcast in group WORLD.*injected"):
        dist.barrier(group=sub)  # the default group's failure broke its world
    assert ran == [1] and g.seq == seq  # the refused calls ran nothing and took no sequence number
    assert other.run_plan(Plan(other, "barrier", ("barrier",), lambda c, a, b: ran.append(2))) is None
    assert ran == [1, 2]


@pytest.mark.parametrize("fast", [True, False])
def test_the_call_sees_its_tag_and_deadline(fast):
    """fn gets the group's Comm with this call's tag and a deadline one group timeout from its start."""
    from procgroup.tags import collective_tag, fingerprint

    pgs = thread_world(1, timeout=7.0)
    g = pgs[0]
    g._fast = fast
    g.set_home_thread()
    seen = []
    plan = Plan(g, "barrier", ("barrier", "x"), lambda c, a, b: seen.append((c.tag, c.deadline.at - c.deadline.start)))
    dist.barrier(group=g)  # seq 0, through run(): makes the group's Comm
    for _ in range(3):
        g.run_plan(plan)
    fp = fingerprint(("barrier", "x"))
    want = [collective_tag(g.gid, s, fp) << 16 for s in (1, 2, 3)]
    assert [t for t, _ in seen] == want
    assert all(abs(d - 7.0) < 1e-6 for _, d in seen)


@pytest.mark.parametrize("fast", [True, False])
def test_a_direct_plan_gets_the_check_word_a_comm_would_give(fast):
    """A plan with ``direct`` set gets (a, check word, deadline), the check word being Comm.check_word() of the
    call's Comm: a direct and a Comm plan of the same signature see the same words for the same seq."""
    pgs = thread_world(1, timeout=5.0)
    g = pgs[0]
    g._fast = fast
    g.set_home_thread()
    dist.barrier(group=g)  # through run(): makes the group's Comm
    seen = []
    via_comm = Plan(g, "barrier", ("barrier", "x"), lambda c, a, b: seen.append(("comm", a, c.check_word())))
    direct = Plan(g, "barrier", ("barrier", "x"), lambda a, cw, dl: seen.append(("direct", a, cw, dl.at - dl.start)))
    direct.direct = True
    marker = object()
    for p in (via_comm, direct, via_comm, direct):
        g.run_plan(p, marker)
    assert [s[0] for s in seen] == ["comm", "direct", "comm", "direct"] and all(s[1] is marker for s in seen)
    fp = fingerprint(("barrier", "x"))
    assert [s[2] for s in seen] == [((seq << 16) | fp) & 0xFFFFFFFF for seq in (1, 2, 3, 4)]
    assert all(abs(s[3] - 5.0) < 1e-6 for s in seen if s[0] == "direct")
    assert as_record(g.flight[-1]).state == "completed" and g.seq == 5


def test_a_group_is_freed_once_dropped():
    """The compiled base takes part in garbage collection: a group (its plans refer back to it) goes away."""
    pgs = thread_world(1)
    g = pgs[0]
    g.set_home_thread()
    calls_ = [np.ones(2, np.float32) for _ in range(3)]
    for x in calls_:
        dist.all_reduce(x, group=g)
    ref = weakref.ref(g)
    g.close()
    del g, pgs
    gc.collect()
    assert ref() is None


def test_native_off_selects_the_python_path(monkeypatch):
    """PROCGROUP_NATIVE=0 reaches the groups through World.native (the cpu backend sets it from the config)."""
    from procgroup.config import shm_options

    monkeypatch.setenv("PROCGROUP_NATIVE", "0")
    assert shm_options(os.environ).native is False
    pgs = thread_world(1)
    assert pgs[0]._fast is True  # World's default
    pgs[0].world.native = False
    assert ProcessGroup(pgs[0].world, [0], 3, "sub")._fast is False


def _raise(e: BaseException):
    def fn(c, a, b):
        raise e

    return fn
