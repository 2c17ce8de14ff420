"""all_reduce and reduce_scatter by one-copy reads (``algorithms.onecopy``, pass 24) with real processes on one host.

A group without big slots (``PROCGROUP_SHM_BIG_SLOT=0``) reads them above the arena's slot instead of sending
messages: through the public API, each call twice (the second from a plan), several sizes, dtypes and ops with
closed-form values; the compiled call where it was built (``Slots.rd_calls`` counts it) and the pure-Python protocol
(``PROCGROUP_NATIVE=0``); a rank that cannot read the others (``PROCGROUP_SHM_CMA=0`` there) sends every rank to the
messages, with the same results.  Nothing is left in /dev/shm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from procgroup.transport import _cma

from .harness import report
from .test_bigarena_procs import _run

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not _cma.AVAILABLE, reason="no process_vm_readv here"),
]

SCRIPT = """
import os
if os.environ.get("CMA_OFF_RANK") == os.environ["RANK"]:
    os.environ["PROCGROUP_SHM_CMA"] = "0"
import numpy as np, procgroup as dist
from procgroup.algorithms import select
from procgroup.state import default_group
dist.init_process_group("cpu")
r, p = dist.get_rank(), dist.get_world_size()
a = default_group().arena()
assert a is not None and a.big is None, "big slots present"
nat = getattr(a, "_nat", None)
seen = []
for name in ("allreduce_onecopy", "reduce_scatter_onecopy"):
    real = getattr(select, name)
    setattr(select, name, (lambda real: lambda *x: seen.append(bool(real(*x))) or seen[-1])(real))
reads0 = nat.rd_calls if nat is not None else 0
def closed(base, op):  # the reduction over ranks of base + rank
    if op == dist.ReduceOp.MAX:
        return base + p - 1
    if op == dist.ReduceOp.AVG:
        return base + (p - 1) / 2
    return p * base + p * (p - 1) // 2
k = 0
for n in (8193 * 8, 100_003, 1 << 20):  # bytes of the buffer: above the arena's slot
    for dt, op in ((np.float32, dist.ReduceOp.SUM), (np.int64, dist.ReduceOp.MAX), (np.float16, dist.ReduceOp.SUM),
                   (np.float64, dist.ReduceOp.AVG)):
        m = n // np.dtype(dt).itemsize
        for _ in range(2):  # cold, then from the plan
            k += 1
            base = (np.arange(m) * 3 + k) % 11
            x = (base + r).astype(dt)
            dist.all_reduce(x, op=op)
            assert x.tobytes() == closed(base, op).astype(dt).tobytes(), ("all_reduce", n, dt, op)
            blk = max(1, m // p)
            send = ((np.arange(p * blk) * 5 + k) % 13 + r).astype(dt)
            out = np.zeros(blk, dt)
            dist.reduce_scatter_tensor(out, send, op=op)
            mine = ((np.arange(p * blk) * 5 + k) % 13)[r * blk : (r + 1) * blk]
            assert out.tobytes() == closed(mine, op).astype(dt).tobytes(), ("reduce_scatter", n, dt, op)
off = bool(os.environ.get("CMA_OFF_RANK"))
assert seen and all(s is (not off) for s in seen), seen
reads = (nat.rd_calls if nat is not None else 0) - reads0
assert (reads > 0) == (nat is not None and not off), (reads, nat, off)
print(f"rank {r} ok {len(seen)} reads={not off} compiled={reads}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    "n,native,cma_off", [(2, "1", ""), (4, "1", ""), (3, "0", ""), (2, "1", "1"), (3, "1", "0")], ids=str
)
def test_a_group_without_big_slots_reduces_by_reads(tmp_path: Path, n: int, native: str, cma_off: str) -> None:
    env = {"PROCGROUP_SHM_BIG_SLOT": "0", "PROCGROUP_NATIVE": native}
    if cma_off:
        env["CMA_OFF_RANK"] = cma_off
    res = _run(tmp_path, SCRIPT, n, env=env, timeout=150)
    assert all(r.returncode == 0 and f"rank {r.rank} ok" in r.stdout for r in res), report(res)
