"""One-copy broadcasts and all_gathers (``algorithms.onecopy``, issue 14) with real processes on one host.

Above the big slots' limits and the one-copy minimum (lowered here to 64 KiB so that the test stays small), a
broadcast among three or more ranks is read by every rank straight out of the root's buffer, and an all_gather's
parts out of every rank's ``sendbuf``: closed-form values for every root and several dtypes, between other
collectives; a rank that cannot read the others (``PROCGROUP_SHM_CMA=0`` there) sends every rank to the message
algorithm, with the same results.  A group of two splits a broadcast above its big slots' limit between its two
processes (``bcast_pair``: the root writes half into the other rank's buffer with process_vm_writev while that
rank reads the rest): the default limits, 6-17 MiB, every root and dtype, plans warm and cold.
Nothing is left in /dev/shm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from procgroup.transport import _cma

from .harness import report
from .test_bigarena_procs import PRELUDE, _run

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here"),
]

BCAST = (
    """
import os
if os.environ.get("CMA_OFF_RANK") == os.environ["RANK"]:
    os.environ["PROCGROUP_SHM_CMA"] = "0"
"""
    + PRELUDE
    + """
from procgroup.algorithms import select
select.BIG_LIMIT["broadcast"] = select.BIG_LIMIT["all_gather"] = 1 << 16
select.ONECOPY_MIN["broadcast"] = select.ONECOPY_MIN["all_gather"] = 1 << 16
seen = []
real_b, real_g = select.bcast_direct, select.allgather_direct
select.bcast_direct = lambda *a: seen.append(real_b(*a)) or seen[-1]
select.allgather_direct = lambda *a: seen.append(real_g(*a)) or seen[-1]
k = 0
for n in (1 << 16, 100_003, 1 << 20):
    for root in range(p):
        for dt in (np.float32, np.int8, np.float64):
            k += 1
            want = ((np.arange(n) * (root + 5) + k) % 97).astype(dt)
            buf = want.copy() if r == root else np.full(n, 3, dt)
            dist.broadcast(buf, src=root)
            assert buf.tobytes() == want.tobytes(), (n, root, dt)
        x = np.full(1000, r, np.int64)
        dist.all_reduce(x)
        assert x[0] == p * (p - 1) // 2
    for dt in (np.float32, np.int8):
        k += 1
        out = np.zeros(p * n, dt)
        dist.all_gather_into_tensor(out, ((np.arange(n) + r * 7 + k) % 89).astype(dt))
        want = np.concatenate([((np.arange(n) + q * 7 + k) % 89).astype(dt) for q in range(p)])
        assert out.tobytes() == want.tobytes(), (n, dt)
off = bool(os.environ.get("CMA_OFF_RANK"))
assert seen and all(s is (not off) for s in seen), seen
print(f"rank {r} ok {len(seen)} one-copy={not off}", flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.parametrize("n,cma_off", [(3, ""), (4, ""), (3, "2")])
def test_broadcasts_and_all_gathers_above_the_limit_read_directly(tmp_path: Path, n: int, cma_off: str) -> None:
    res = _run(tmp_path, BCAST, n, env={"CMA_OFF_RANK": cma_off} if cma_off else None, timeout=150)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


#: a pair's broadcasts of ``sizes`` bytes (each root twice in a row: the second call runs from a plan) of every dtype
#: in ``dtypes``, closed-form values, nothing written past the buffer; an all_reduce after each size
PAIR_BCASTS = """
k = 0
for n in sizes:
    for root in (0, 1, 1, 0):
        for dt in dtypes:
            k += 1
            m = n // np.dtype(dt).itemsize
            want = ((np.arange(m) * (root + 3) + k) % 251).astype(dt)
            buf = want.copy() if r == root else np.full(m + 1, 9, dt)
            dist.broadcast(buf[:m], src=root)
            assert buf[:m].tobytes() == want.tobytes(), (n, root, dt)
            assert r == root or buf[m] == 9, "a byte past the buffer was written"
    x = np.full(1000, r, np.int64)
    dist.all_reduce(x)
    assert x[0] == 1
"""

PAIR = (
    """
import os
if os.environ.get("CMA_OFF_RANK") == os.environ["RANK"]:
    os.environ["PROCGROUP_SHM_CMA"] = "0"
"""
    + PRELUDE
    + """
from procgroup.algorithms import select
seen = []
real = select.bcast_pair
select.bcast_pair = lambda *a: seen.append(real(*a)) or seen[-1]
assert p == 2
sizes = ((6 << 20) + 4096, (12 << 20) + 5, 17 << 20)  # bytes: just above the limit, an odd tail, larger
dtypes = (np.uint8, np.float32, np.complex128)
"""
    + PAIR_BCASTS
    + """
off = bool(os.environ.get("CMA_OFF_RANK"))
assert seen and all(s is (not off) for s in seen), seen
print(f"rank {r} ok {len(seen)} split={not off}", flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.parametrize("cma_off", ["", "1"])
def test_a_pairs_broadcast_above_the_limit_is_split_between_them(tmp_path: Path, cma_off: str) -> None:
    res = _run(tmp_path, PAIR, 2, env={"CMA_OFF_RANK": cma_off} if cma_off else None, timeout=150)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)


PAIR_READS = (
    PRELUDE
    + """
from procgroup.algorithms import limits, select
assert p == 2
a = pg.arena()
cold = []  # select's own reads: a shape's first call (its plan's bound read takes the others)
real = select.bcast_direct
select.bcast_direct = lambda *x: cold.append(1) or real(*x)
reads = lambda: a._nat.rd_calls if getattr(a, "_nat", None) is not None else 0
before = reads()
sizes = (40_000, 100_003, limits.BIG_MIN_PAIR["broadcast"])  # bytes: above the arena's slot, up to the floor
dtypes = (np.uint8, np.float32)
"""
    + PAIR_BCASTS
    + """
got = reads() - before
native = getattr(a, "_nat", None) is not None
# the compiled reads count the calls where this rank read (it was not the root): two of every four, all of them
assert got == (len(sizes) * 2 * 2 if native else 0), (got, native)
calls = len(sizes) * 4 * 2
assert len(cold) == (calls // 2 if native else calls), (len(cold), native)  # Python: select's reads every time
print(f"rank {r} ok reads={got} native={native} select={len(cold)}", flush=True)
dist.destroy_process_group()
"""
)


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_pairs_broadcast_below_the_big_slots_floor_is_read_warm_and_cold(tmp_path: Path, native: str) -> None:
    """Pass 23: a group of two reads its broadcast from the arena's slot up to ``BIG_MIN_PAIR`` out of the root's
    buffer, the default limits, through the public API: the first call of a shape through ``select``, the second
    from its plan's bound compiled read (``plans.broadcast``); every call on the compiled path reads."""
    res = _run(tmp_path, PAIR_READS, 2, env={"PROCGROUP_NATIVE": native}, timeout=120)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)
