"""The shared-memory all_to_all (issue 14 item 1) with real processes on one host.

Closed-form results for all_to_all_single (equal splits, planned and not; uneven and zero splits) and the
list form, blocking and async, several dtypes, sizes 0, 1, odd, inline in the arena, above it, above one
big slot (several rounds) and above the streams' limit (messages), in the world and in a subgroup; a peer
killed while the others wait in an all_to_all (in the arena exchange, and between big-slot rounds) fails
them fast, naming it; a mismatched call (another op, another dtype) never completes and is named; a count
mismatch fails on every rank; a blocked rank sleeps; nothing is left in /dev/shm.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .harness import report
from .test_bigarena_procs import PRELUDE, _run

pytestmark = pytest.mark.timeout(180)

A2A = (
    """
import os
if os.environ.get("CMA_OFF_RANK") == os.environ["RANK"]:
    os.environ["PROCGROUP_SHM_CMA"] = "0"  # this rank cannot read the others: every rank takes the messages
"""
    + PRELUDE
    + """
from procgroup.algorithms import alltoall_shm as S
from procgroup.algorithms import select
from procgroup.transport import _cma
used = []
real_rounds, real_msgs, real_direct = S._rounds, S._messages, S._direct_reads
S._rounds = lambda *a: used.append("rounds") or real_rounds(*a)
S._messages = lambda *a: used.append("messages") or real_msgs(*a)

def direct(*a):
    ok = real_direct(*a)
    used.append("direct" if ok else "declined")
    return ok

S._direct_reads = direct
real_offered = S._offered_reads

def offered(*a):  # the one-copy reads the headers offered (no exchange of addresses): direct reads too
    ok = real_offered(*a)
    if ok:
        used.append("direct")
    return ok

S._offered_reads = offered
real_shm = S.alltoall_shm
select.alltoall_shm = lambda *a: used.append("shm") or real_shm(*a)

def piece(dt, src, dst, k, salt):
    v = (src * 1000 + dst * 37 + salt * 7 + np.arange(k)) % 251
    return ((v % 3) == 0) if dt == np.bool_ else v.astype(dt)

def check(g):
    gr, gp = dist.get_rank(g), dist.get_world_size(g)
    salt = 0
    # equal splits: 0, 1, odd, inline, just above the arena, several big rounds, above the streams' limit
    for k in (0, 1, 7, 1001, 4097, 40_000, 300_001, 600_001):
        for dt in (np.float32, np.int64, np.float16, np.bool_, np.complex64, np.int8):
            if k > 50_000 and dt not in (np.float32, np.int8):
                continue
            salt += 1
            inp = np.concatenate([piece(dt, gr, j, k, salt) for j in range(gp)])
            want = np.concatenate([piece(dt, i, gr, k, salt) for i in range(gp)])
            for rep in range(2):  # the second call of a shape runs its plan
                out = np.zeros(gp * k, dt)
                dist.all_to_all_single(out, inp, group=g)
                assert out.tobytes() == want.tobytes(), (k, dt, rep)
    # uneven splits with zero pieces, 2-D rows, and the list form; async
    for base in (0, 3, 900, 30_000):
        salt += 1
        C = [[0 if (i + j) % 3 == 0 else base * (1 + i) + 5 * j + 1 for j in range(gp)] for i in range(gp)]
        inp = np.concatenate([piece(np.int32, gr, j, 2 * C[gr][j], salt) for j in range(gp)]).reshape(-1, 2)
        want = np.concatenate([piece(np.int32, i, gr, 2 * C[i][gr], salt) for i in range(gp)])
        out = np.full((sum(C[i][gr] for i in range(gp)), 2), -1, np.int32)
        w = dist.all_to_all_single(out, inp, [C[i][gr] for i in range(gp)], C[gr], group=g, async_op=base == 900)
        if w is not None:
            w.wait()
        assert np.array_equal(out.reshape(-1), want), base
        for rep in range(3):  # the second and third calls of a shape run its plan (in place: no scratch copies)
            outs = [np.full(C[i][gr], -1, np.float64) for i in range(gp)]
            ins = [piece(np.float64, gr, j, C[gr][j], salt) for j in range(gp)]
            w = dist.all_to_all(outs, ins, group=g, async_op=base == 3 and rep == 0)
            if w is not None:
                w.wait()
            for i in range(gp):
                assert np.array_equal(outs[i], piece(np.float64, i, gr, C[i][gr], salt)), (base, i, rep)
    # the list form at every route of the compiled call (inline, one big slot, several rounds, messages), 2-D
    # pieces, planned from the second call on
    for k in (0, 1, 513, 4095, 4096, 4097, 16_000, 16_500, 200_000, 600_001):
        salt += 1
        for rep in range(2):
            ins = [piece(np.int8, gr, j, k + j, salt) for j in range(gp)]
            outs = [np.full(k + gr, 7, np.int8) for i in range(gp)]
            if k % 2 == 0 and k:
                ins = [x[: (len(x) // 2) * 2].reshape(-1, 2) for x in ins]
                ins = [np.ascontiguousarray(x) for x in ins]
                outs = [x[: (len(x) // 2) * 2].reshape(-1, 2).copy() for x in outs]
            dist.all_to_all(outs, ins, group=g)
            for i in range(gp):
                got = outs[i].reshape(-1)
                want = piece(np.int8, i, gr, k + gr, salt)[: got.size]
                assert got.tobytes() == want.tobytes(), (k, i, rep)

sub = dist.new_group(list(range(p - 1))) if p > 2 else None
check(None)
if sub is not None and r < p - 1:
    check(sub)
assert {"shm", "rounds"} <= set(used), sorted(set(used))
from procgroup.state import default_group

if getattr(getattr(default_group().arena(), "_nat", None), "rd_calls", 0):  # read inside the compiled call
    used.append("direct")
# above the streams' limit: read straight from the senders where every rank can, else messages on every rank
can = _cma.AVAILABLE and not os.environ.get("CMA_OFF_RANK") and os.environ.get("PROCGROUP_SHM_CMA") != "0"
assert ("direct" in used) == can and ("messages" in used) != can, sorted(set(used))
print(f"rank {r} ok", flush=True)
dist.destroy_process_group()
"""
)

KILLED = (
    PRELUDE
    + """
where = os.environ["WHERE"]
n = 4 if where == "arena" else 100_000  # 800 kB streams: 13 rounds of 64 KiB
a, o = np.ones(p * n, np.float32), np.empty(p * n, np.float32)
dist.all_to_all_single(o, a)
if r == 1:
    if where == "arena":
        time.sleep(0.5)
        os._exit(7)  # the others wait in the exchange of the next all_to_all
    big = pg.arena().big
    real_sync = big.sync
    def sync(dl, seen=[]):
        seen.append(1)
        if len(seen) == 2:
            os._exit(7)  # between the big-slot rounds of an all_to_all
        real_sync(dl)
    big.sync = sync
t0 = time.monotonic()
try:
    dist.all_to_all_single(o, a)
except Exception as e:
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(3)
print("no error", flush=True)
"""
)

MISMATCH = (
    PRELUDE
    + """
kind, n = os.environ["KIND"], int(os.environ["N"])
a = np.ones(p * n, np.float32)
o = np.full(p * n, -1, np.float32)
dist.all_to_all_single(o, a)
o[:] = -1
t0 = time.monotonic()
try:
    if r == 0:
        dist.all_to_all_single(o, a)
    elif kind == "op":
        dist.all_reduce(a)
    else:
        dist.all_to_all_single(np.zeros(p * n, np.int32), np.ones(p * n, np.int32))
except Exception as e:
    if r == 0:
        assert (o[n:] == -1).all(), "data of a mismatched call landed"  # rank 1's piece
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    sys.exit(3)
print("no error", flush=True)
"""
)

COUNTS = (
    PRELUDE
    + """
n = 100_000  # beyond the arena: every rank reads every header and raises
a = np.ones(2 * n, np.int8)
rc = [n - 1, n] if r == 1 else [n, n]
t0 = time.monotonic()
try:
    dist.all_to_all_single(np.zeros(sum(rc), np.int8), a, rc, [n, n])
except Exception as e:
    print(f"rank {r} {type(e).__name__} after {time.monotonic() - t0:.2f}s: {e}", flush=True)
    dist.all_to_all_single(np.zeros(2 * n, np.int8), a)  # the group still works
    sys.exit(3)
print("no error", flush=True)
dist.destroy_process_group()
"""
)

SLEEPER = (
    PRELUDE
    + """
a, o = np.ones(1 << 18, np.float32), np.empty(1 << 18, np.float32)
dist.all_to_all_single(o, a)
if r == 0:
    time.sleep(2.0)
t0, c0 = time.monotonic(), time.process_time()
dist.all_to_all_single(o, a)
print(f"rank {r} waited {time.monotonic() - t0:.2f}s cpu {time.process_time() - c0:.3f}s", flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.parametrize("n,cma_off", [(2, ""), (3, ""), (4, ""), (3, "1")])
def test_all_to_all_closed_form_through_shared_memory(tmp_path: Path, n: int, cma_off: str) -> None:
    """``cma_off``: that rank cannot read the others' memory (PROCGROUP_SHM_CMA=0 there)."""
    res = _run(tmp_path, A2A, n, env={"CMA_OFF_RANK": cma_off} if cma_off else None, timeout=150)
    assert all(r.returncode == 0 for r in res), report(res)
    assert all(f"rank {r.rank} ok" in r.stdout for r in res), report(res)


@pytest.mark.parametrize("where", ["arena", "rounds"])
def test_a_peer_killed_in_an_all_to_all_fails_the_others_fast_naming_it(tmp_path: Path, where: str) -> None:
    t0 = time.monotonic()
    res = _run(tmp_path, KILLED, 3, env={"PROCGROUP_TIMEOUT": "60", "WHERE": where})
    took = time.monotonic() - t0
    assert res[1].returncode == 7, report(res)
    for r in (res[0], res[2]):
        assert r.returncode == 3 and "rank 1" in r.stdout, report(res)
    assert took < 30, (took, report(res))


@pytest.mark.parametrize("kind,n", [("op", 100), ("dtype", 100), ("op", 100_000), ("dtype", 100_000)])
def test_a_mismatched_call_never_completes_and_is_named(tmp_path: Path, kind: str, n: int) -> None:
    res = _run(tmp_path, MISMATCH, 2, env={"PROCGROUP_TIMEOUT": "6", "KIND": kind, "N": str(n)})
    text = report(res)
    assert all(r.returncode == 3 for r in res), text
    assert "all_to_all" in text and ("all_reduce" in text or "int32" in text), text


def test_a_count_mismatch_fails_on_every_rank(tmp_path: Path) -> None:
    res = _run(tmp_path, COUNTS, 2, env={"PROCGROUP_TIMEOUT": "20"})
    text = report(res)
    assert all(r.returncode == 3 for r in res), text
    assert all("counts disagree" in r.stdout for r in res), text


def test_a_rank_blocked_in_all_to_all_sleeps(tmp_path: Path) -> None:
    res = _run(tmp_path, SLEEPER, 2)
    assert all(r.returncode == 0 for r in res), report(res)
    line = res[1].stdout.strip().splitlines()[-1]
    waited, cpu = float(line.split()[3][:-1]), float(line.split()[5][:-1])
    assert waited > 1.5, line
    assert cpu < 0.1 * waited, line  # well under 10% of a core while blocked
