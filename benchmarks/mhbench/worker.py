"""The worker side (``--worker procgroup|mpi``): runs the cases in every rank and records what it saw."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence


def _worker(ns: argparse.Namespace) -> int:
    """One rank of one system: run the all_reduce cases; rank 0 appends JSON lines to ns.out."""
    import resource

    import numpy as np

    from procgroup.bench._common import versions
    from procgroup.bench.cases import Case, layout, run_cases

    sizes = [int(s) for s in ns.sizes.split(",")]
    info: dict = {}
    stages: Optional[_StageTimes] = None
    if ns.worker == "procgroup":
        import procgroup as dist
        from procgroup.bench.cases import TorchStyleAdapter

        dist.init_process_group(timeout=ns.timeout)
        a = TorchStyleAdapter("procgroup", dist)
        if ns.pg_force:
            _apply_force(ns.pg_force)
        info = _procgroup_info(dist, a, sizes if ns.op == "all_reduce" else [])
        if ns.pg_stage_times:
            stages = _StageTimes()
        finish = dist.destroy_process_group
    else:
        import mpi4py
        from mpi4py import MPI

        from procgroup.bench.mpi_worker import MPIAdapter

        a = MPIAdapter(MPI)
        names = MPI.COMM_WORLD.gather(MPI.Get_processor_name(), root=0)
        info = {
            "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00"),
            "rank_hosts": names,
        }
        finish = None
    try:
        cases = [Case(ns.op, s, layout(ns.op, s, a.size), ns.warmup, ns.iters, False) for s in sizes]
        f = open(ns.out, "a", encoding="utf-8") if a.rank == 0 else None
        try:
            if f is not None:
                f.write(
                    json.dumps(
                        {
                            "kind": "header",
                            "system": a.name,
                            "world_size": a.size,
                            "pid": os.getpid(),
                            **versions(),
                            **info,
                        }
                    )
                    + "\n"
                )
                f.flush()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            for rec in run_cases(a, cases):
                rec.update(kind="case", system=a.name)
                assert f is not None
                f.write(json.dumps(rec) + "\n")
                f.flush()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            # CPU time of every rank (all threads) over the cases: less sensitive to other users' load than wall time
            calls = sum(1 + c.warmup + c.iters for c in cases)
            m = a.gather_rows(np.array([ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime, calls], np.float64))
            if f is not None and m is not None:
                f.write(
                    json.dumps(
                        {
                            "kind": "cpu",
                            "calls_per_rank": int(calls),
                            "user_s_by_rank": [round(x, 4) for x in m[:, 0]],
                            "sys_s_by_rank": [round(x, 4) for x in m[:, 1]],
                            "cpu_ms_per_call_all_ranks": round(1e3 * float(m[:, :2].sum()) / calls, 3),
                        }
                    )
                    + "\n"
                )
            if ns.pg_ab_variants:
                ab = _ab(dist, a, sizes, json.loads(ns.pg_ab_variants), ns.iters, ns.warmup)
                if f is not None:
                    f.write(json.dumps({"kind": "ab", "ab": ab}) + "\n")
                    f.flush()
            if stages is not None:
                m = a.gather_rows(stages.row())
                if f is not None:
                    f.write(json.dumps({"kind": "stages", **stages.report(m)}) + "\n")
            if f is not None:
                f.write(json.dumps({"kind": "end", "system": a.name}) + "\n")
        finally:
            if f is not None:
                f.close()
    except BaseException:
        if ns.worker == "mpi":
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)  # do not leave the peers hanging in a collective
        raise
    finally:
        if finish is not None:
            finish()
    return 0


def _apply_force(spec: str) -> None:
    """``COLL=ALG,...`` into select.FORCE; an upper-case name sets that integer threshold of select instead."""
    from procgroup.algorithms import select

    for kv in spec.split(","):
        k, v = kv.split("=", 1)
        if k.isupper() and isinstance(getattr(select, k, None), int):  # a threshold, e.g. MULTILEADER_MIN=0
            setattr(select, k, int(v))
        else:
            select.FORCE[k] = v


def _ab(dist, a, sizes: Sequence[int], variants: Dict[str, str], iters: int, warmup: int) -> dict:  # type: ignore[no-untyped-def]
    """--pg-ab: the default and every variant in one run, alternating per iteration (order reversed every other
    one), each call after a barrier; per call the slowest rank's time and the CPU time of all ranks (all threads).

    Load that drifts over seconds biases separate runs; here every variant sees the same load.  Each variant's
    result is checked against the closed form first.  Rank 0 returns {size: {variant: stats}}.
    """
    import time

    import numpy as np

    from procgroup.algorithms import select

    specs = [("default", "")] + list(variants.items())
    force0 = dict(select.FORCE)
    keys = {kv.split("=", 1)[0] for _, spec in specs for kv in spec.split(",") if spec}
    ints0 = {k: getattr(select, k) for k in keys if k.isupper() and isinstance(getattr(select, k, None), int)}

    def use(spec: str) -> None:
        select.FORCE.clear()
        select.FORCE.update(force0)
        for k, v in ints0.items():
            setattr(select, k, v)
        if spec:
            _apply_force(spec)

    n, out = a.size, {}
    try:
        for s in sizes:
            buf = np.zeros(max(1, s // 4), np.float32)
            for name, spec in specs:
                use(spec)
                buf[:] = a.rank + 1
                dist.all_reduce(buf)
                if not (buf == n * (n + 1) // 2).all():
                    raise AssertionError(f"--pg-ab {name}: wrong all_reduce result, {s} bytes, rank {a.rank}")
                buf[:] = 0
                for _ in range(warmup):
                    dist.all_reduce(buf)
            m = np.zeros((2, len(specs), iters))
            for i in range(iters):
                for j in range(len(specs)) if i % 2 == 0 else reversed(range(len(specs))):
                    use(specs[j][1])
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    dist.all_reduce(buf)
                    m[0, j, i], m[1, j, i] = time.perf_counter() - t0, time.process_time() - c0
            g = a.gather_rows(m.ravel())
            if g is not None:
                g = g.reshape(g.shape[0], 2, len(specs), iters)
                t, cpu = g[:, 0].max(axis=0), g[:, 1].sum(axis=0)  # (variants, iters)
                out[str(s)] = {
                    name: {
                        "median_ms": round(1e3 * float(np.median(t[j])), 4),
                        "ratio_vs_default": round(float(np.median(t[j] / t[0])), 3),
                        "cpu_ms_per_call_all_ranks": round(1e3 * float(cpu[j].mean()), 3),
                        "spec": spec,
                    }
                    for j, (name, spec) in enumerate(specs)
                }
    finally:
        use("")
    return out


class _StageTimes:
    """--pg-stage-times: wrap procgroup's ``select.choose_*`` so that every algorithm they return is timed.

    allreduce_hierarchical asks choose_reduce / choose_all_reduce_flat / choose_broadcast for its
    three stages, so this splits its time into intra-host reduce, inter-host all_reduce (leaders
    only) and intra-host broadcast.  Times include the check, warm-up and timed calls of all sizes.
    """

    NAMES = ("choose_all_reduce", "choose_reduce", "choose_all_reduce_flat", "choose_broadcast")

    def __init__(self) -> None:
        import time as _t

        from procgroup.algorithms import select
        from procgroup.algorithms.reduction import reduce_binomial

        self.acc = {k: [0.0, 0] for k in self.NAMES}
        self.inside = False  # within a timed all_reduce: only its stages are timed
        self.algo: Dict[str, str] = {}
        for k in self.NAMES:
            orig = getattr(select, k)

            def chooser(*args, _orig=orig, _k=k, **kw):  # type: ignore[no-untyped-def]
                f = _orig(*args, **kw)
                self.algo[_k] = getattr(f, "__name__", str(f))
                if f is reduce_binomial:  # allreduce_hierarchical tests `f is reduce_binomial`: keep it intact
                    return f

                top = _k == "choose_all_reduce"
                if not top and not self.inside:
                    return f  # e.g. the harness's own broadcasts: not a stage of an all_reduce

                def timed(*a2, **kw2):  # type: ignore[no-untyped-def]
                    t0 = _t.perf_counter()
                    if top:
                        self.inside = True
                    try:
                        return f(*a2, **kw2)
                    finally:
                        if top:
                            self.inside = False
                        acc = self.acc[_k]
                        acc[0] += _t.perf_counter() - t0
                        acc[1] += 1

                timed.__name__ = getattr(f, "__name__", "timed")
                return timed

            setattr(select, k, chooser)

    def row(self):  # type: ignore[no-untyped-def]
        import numpy as np

        return np.array([v for k in self.NAMES for v in self.acc[k]], dtype=np.float64)

    def report(self, m) -> dict:  # type: ignore[no-untyped-def]
        if m is None:
            return {}
        out = {}
        for i, k in enumerate(self.NAMES):
            out[k] = {
                "algorithm_rank0": self.algo.get(k),
                "mean_ms_per_call_by_rank": [
                    round(1e3 * m[r, 2 * i] / m[r, 2 * i + 1], 3) if m[r, 2 * i + 1] else None
                    for r in range(m.shape[0])
                ],
                "calls_by_rank": [int(m[r, 2 * i + 1]) for r in range(m.shape[0])],
            }
        return {"stage_times": out}


def _procgroup_info(dist, a, sizes: Sequence[int]) -> dict:  # type: ignore[no-untyped-def]
    """Where every rank is, which transport reaches each of its peers, which algorithm runs (best effort)."""
    import numpy as np

    info: dict = {"procgroup": dist.__version__, "transport_mode": os.environ.get("PROCGROUP_TRANSPORT", "auto")}
    kinds = {"shm": 0, "tcp": 1, "router": 2}
    row = np.zeros(a.size, dtype=np.float64) - 1  # per peer: 0 shm, 1 tcp, 3 other; -1 self/unknown
    try:
        world = dist.group.WORLD.world
        t = world.transport
        per_peer = getattr(t, "_per_peer", None)
        for peer in range(a.size):
            if peer == a.rank:
                continue
            sub = per_peer.get(peer) if per_peer is not None else t
            row[peer] = kinds.get(getattr(sub, "kind", ""), 3)
        info["rank_hosts"] = list(world.hostnames)
        info["transport"] = getattr(t, "kind", type(t).__name__)
    except Exception as e:  # noqa: BLE001 - informational only
        info["transport_error"] = f"{type(e).__name__}: {e}"
    m = a.gather_rows(row)
    if m is not None:
        names = {0: "shm", 1: "tcp", 3: "other"}
        info["peer_transports"] = [
            {names[int(v)]: [p for p in range(a.size) if m[r, p] == v] for v in sorted(set(m[r].tolist()) - {-1.0})}
            for r in range(a.size)
        ]
    try:
        if sizes:
            info["algorithm"] = _probe_algorithm(dist, sizes)
    except Exception as e:  # noqa: BLE001 - informational only
        info["algorithm_error"] = f"{type(e).__name__}: {e}"
    return info


def _probe_algorithm(dist, sizes: Sequence[int]) -> dict:  # type: ignore[no-untyped-def]
    """Which algorithms procgroup's selection picks: one untimed all_reduce per size with every
    ``select.choose_*`` wrapped to note its answer (the hierarchical algorithm asks again for its
    stages), then the originals restored before anything is timed."""
    import numpy as np

    from procgroup.algorithms import select

    orig = {k: getattr(select, k) for k in dir(select) if k.startswith("choose_") and callable(getattr(select, k))}
    calls: List[str] = []

    def wrap(name, f):  # type: ignore[no-untyped-def]
        def chooser(*args, **kw):  # type: ignore[no-untyped-def]
            r = f(*args, **kw)
            calls.append(
                f"{name}({', '.join(str(x) for x in args[1:] if isinstance(x, int))}) -> {getattr(r, '__name__', r)}"
            )
            return r

        return chooser

    out = {}
    try:
        for k, f in orig.items():
            setattr(select, k, wrap(k, f))
        for s in sizes:
            calls.clear()
            dist.all_reduce(np.ones(max(1, s // 4), dtype=np.float32))
            out[str(s)] = list(calls)
    finally:
        for k, f in orig.items():
            setattr(select, k, f)
    if getattr(select, "FORCE", None):
        out["FORCE"] = dict(select.FORCE)
    return out
