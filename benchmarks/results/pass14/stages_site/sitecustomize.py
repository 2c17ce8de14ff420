"""Per-stage times of the multi-host all_reduce in every rank, without changing the algorithm (pass 14).

Put this folder first on the ranks' ``PYTHONPATH`` (``../../pass11/mh_loop.sh ../../pass11/loop.py SZ=65536
PYTHONPATH=$PWD/stages_site:$PWD/../../../src``).  It wraps the stage choices of the hierarchical and multi-leader
all_reduces (``allreduce._stages``: fold, the stage between hosts, spread, and multileader's host split) and the
public ``all_reduce``, and at exit prints per rank ``STAGES rank name wall/u<user>/s<sys>``: the median wall time
of the last 300 calls in microseconds and the mean user and system CPU of the calling thread (RUSAGE_THREAD:
tick-sampled, so only means over many calls mean anything).  Unlike ``loop.py``'s ``STAGES=1`` it keeps
``host_split``, so multileader's host stages stay in the big slots.
"""

import atexit
import os
import resource
import statistics
import time

T: dict = {}


def _ru() -> tuple:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime


def _timed(key, f):
    if f is None:
        return None

    def g(*a, **k):
        t0, (u0, s0) = time.perf_counter(), _ru()
        try:
            return f(*a, **k)
        finally:
            u1, s1 = _ru()
            T.setdefault(key, []).append((time.perf_counter() - t0, u1 - u0, s1 - s0))

    return g


def _report() -> None:
    parts = []
    for k, v in T.items():
        v = v[-300:]
        wall = statistics.median(x[0] for x in v) * 1e6
        user, sys_ = (statistics.mean(x[i] for x in v) * 1e6 for i in (1, 2))
        parts.append(f"{k} {wall:.0f}/u{user:.0f}/s{sys_:.0f}")
    print("STAGES", os.environ.get("RANK"), " ".join(parts), flush=True)


try:
    import procgroup
    import procgroup.algorithms.select  # noqa: F401 - installs the stage choices first
    from procgroup import collectives
    from procgroup.algorithms import allreduce as AR

    st = AR._stages
    AR._stages = AR.StageChoices(
        all_reduce_flat=lambda p, nb, ne: _timed("inter", st.all_reduce_flat(p, nb, ne)),
        reduce=st.reduce,
        broadcast=st.broadcast,
        host_reduce=lambda c, nb: _timed("fold", st.host_reduce(c, nb)),
        host_broadcast=lambda c, nb: _timed("spread", st.host_broadcast(c, nb)),
        host_split=lambda c, nb: _timed("split", st.host_split(c, nb)),
    )
    procgroup.all_reduce = collectives.all_reduce = _timed("call", collectives.all_reduce)
    atexit.register(_report)
except Exception:  # noqa: BLE001 - a measuring aid: say why, never stop the rank
    import traceback

    traceback.print_exc()
