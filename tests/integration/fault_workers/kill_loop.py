"""Fault-injection worker, run under ``procgroup run``: a loop of checked collectives; one rank dies by SIGKILL.

    python kill_loop.py SEED

Every rank draws the same plan from ``SEED``: the victim rank, the mode and the
moment.  Modes:

* ``between``: the victim SIGKILLs itself before collective number ``at``;
* ``timer``: a thread of the victim SIGKILLs the process ``delay`` seconds into
  the loop, usually while it is inside a collective (mid-message).

Lines (the launcher prefixes each with ``[rank] ``)::

    PID <rank> <pid>                         at start
    PLAN victim=<v> mode=<m> at=<i> delay=<d>
    KILL <rank> <wall time>                  the victim, just before the signal
    DETECTED <rank> <wall time> <secs in op> peer=<e.peer> <ExcType>: <message>
    LATE-SIGTERM <rank>                      SIGTERM from the launcher arrived before the error

A survivor catches the error, prints DETECTED and re-raises it (so the
launcher's bootstrap records it, as it would for a real program).  SIGTERM
from the launcher is deferred for up to ``GRACE`` seconds so that the
survivors get to observe (and report) the failure themselves; the test runs
the launcher with a longer --term-timeout.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

import numpy as np

import procgroup as dist

GRACE = 6.0
_term_at = []


def _on_term(signum, frame):  # noqa: ANN001
    _term_at.append(time.monotonic())
    sys.stdout.write(f"LATE-SIGTERM {os.environ.get('RANK')}\n")
    sys.stdout.flush()


def plan(seed: int, ws: int):
    rng = random.Random(seed)
    victim = rng.randrange(ws)
    mode = rng.choice(["between", "timer"])
    at = rng.randint(1, 60)
    delay = rng.uniform(0.05, 1.5)
    return victim, mode, at, delay


def main() -> None:
    seed = int(sys.argv[1])
    signal.signal(signal.SIGTERM, _on_term)
    dist.init_process_group(timeout=60)
    r, ws = dist.get_rank(), dist.get_world_size()
    print(f"PID {r} {os.getpid()}", flush=True)
    victim, mode, at, delay = plan(seed, ws)
    if r == 0:
        print(f"PLAN victim={victim} mode={mode} at={at} delay={delay:.3f}", flush=True)
    dist.barrier()

    def die() -> None:
        print(f"KILL {r} {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if r == victim and mode == "timer":
        threading.Timer(delay, die).start()
    rng = random.Random(seed * 7919 + 1)  # the same op sequence on every rank
    i = 0
    t_op = time.monotonic()
    try:
        while True:
            if r == victim and mode == "between" and i == at:
                die()
            if _term_at and time.monotonic() - _term_at[0] > GRACE:
                print(f"NO-ERROR {r}: still running {GRACE}s after SIGTERM", flush=True)
                sys.exit(9)
            op = rng.randrange(7)
            n = rng.choice([1, 100, 4096, 1 << 16])
            t_op = time.monotonic()
            if op == 0:
                x = np.full(n, r + 1, np.float32)
                dist.all_reduce(x)
                assert x[0] == ws * (ws + 1) / 2
            elif op == 1:
                root = rng.randrange(ws)
                x = np.full(n, root if r == root else -1, np.int64)
                dist.broadcast(x, src=root)
                assert x[-1] == root
            elif op == 2:
                out = np.zeros(ws * n, np.int32)
                dist.all_gather_into_tensor(out, np.full(n, r, np.int32))
                assert out[-1] == ws - 1
            elif op == 3:
                out = np.zeros(n, np.float64)
                dist.reduce_scatter_tensor(out, np.ones(ws * n, np.float64))
                assert out[0] == ws
            elif op == 4:
                outs = [np.zeros(n, np.int16) for _ in range(ws)]
                dist.all_to_all(outs, [np.full(n, r, np.int16) for _ in range(ws)])
                assert outs[-1][0] == ws - 1
            elif op == 5:
                dist.barrier()
            else:  # a ring of send/recv
                got = np.zeros(n, np.uint8)
                reqs = [dist.isend(np.full(n, r, np.uint8), (r + 1) % ws), dist.irecv(got, (r - 1) % ws)]
                for w in reqs:
                    w.wait()
                assert got[0] == (r - 1) % ws
            i += 1
    except dist.ProcGroupError as e:
        msg = str(e).replace("\n", " | ")
        peer = getattr(e, "peer", None)
        print(
            f"DETECTED {r} {time.time():.6f} {time.monotonic() - t_op:.3f} peer={peer} {type(e).__name__}: {msg}",
            flush=True,
        )
        raise


if __name__ == "__main__":
    main()
