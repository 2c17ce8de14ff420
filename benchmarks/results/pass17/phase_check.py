"""Closed-form check of the multi-host all_reduce, with what each bound phase did (pass 17).

Every rank all_reduces, for 4 KiB to 4 MiB and four dtypes, 30 calls each of ``(i % 97) + rank + call`` (some
ranks sleeping up to 3 ms first, at random, so that ranks come in late), compares every result with the closed form
``w * (i % 97) + w (w - 1) / 2 + w * call``, and prints how many results were wrong and what the bound phases between
hosts (``TcpPhases.start``) did: ``whole`` (every message arrived whole), ``handback`` (a connection handed back to
its decoder, the receive waited for as irecv's), ``none`` (not claimed: the messages went as usual).  Run it as
``../pass11/mh_loop.sh`` runs ``loop.py``, from ``../pass13``: ``bash ../pass11/mh_loop.sh ../pass17/phase_check.py``
(every rank's line is in ``/tmp/mhl.*.log``).
"""

import collections
import random
import time

import numpy as np

import procgroup as dist
from procgroup.transport import _tcp_phase

SEEN: collections.Counter = collections.Counter()
_start = _tcp_phase.TcpPhases.start


def _counted(self, *a, **k):  # type: ignore[no-untyped-def]
    got = _start(self, *a, **k)
    SEEN["none" if got is None else ("whole" if not got[1] else "handback")] += 1
    return got


_tcp_phase.TcpPhases.start = _counted  # type: ignore[method-assign]

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
rng = random.Random(7 * r + 1)
bad = 0
for size in (4096, 65536, 262144, 1 << 20, 4 << 20):
    for dt in (np.float32, np.int64, np.float64, np.int32):
        n = size // np.dtype(dt).itemsize
        base = (np.arange(n) % 97).astype(dt)
        for call in range(30):
            buf = base + (r + call)
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.003)
            dist.all_reduce(buf)
            bad += not np.array_equal(buf, base * w + w * (w - 1) // 2 + w * call)
print(f"rank {r}: wrong results {bad}, phases {dict(SEEN)}", flush=True)
dist.barrier()
dist.destroy_process_group()
