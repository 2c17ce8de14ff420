"""One job's timings of a list of calls, for whole-job A/Bs (passes 21 and 22), through procgroup or Open MPI.

    procgroup run --standalone --nproc-per-node 4 jobs.py OPS   # PG_PATCH='all_to_all=0': select.BIG_LIMIT
    mpirun --allow-run-as-root -n 4 --oversubscribe --mca btl vader,self python jobs.py --mpi OPS

OPS: comma-separated op:bytes, bytes per rank's buffer (a2a: the whole send buffer; ag: the input; rs: the input;
bc / ar / rd: the buffer), e.g. a2a:1M,ag:64K.  300 calls each after 30 and a barrier; prints one line
``RES op:size median_of_slowest_rank_us ...`` (per call, the slowest rank's time, median over calls) and the
others' CPU load seen in /proc/stat over the job (``LOAD``: busy share of both CPUs minus this job's own CPU).
"""

import os
import sys
import time

import numpy as np

MPI_MODE = "--mpi" in sys.argv
OPS = [a for a in sys.argv[1:] if not a.startswith("--")][0].split(",")
IT = int(os.environ.get("PG_IT", "300"))


def size(s):
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


def cpu_total():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


if MPI_MODE:
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    r, p = c.rank, c.size
    barrier = c.Barrier

    def gather(x):
        return c.gather(x, 0)
else:
    import procgroup as dist
    from procgroup.algorithms import select

    # "collective=bytes;..." into select's tables: PG_PATCH BIG_LIMIT, PG_PATCH_PAIR BIG_LIMIT_PAIR, PG_ONECOPY
    # ONECOPY_MIN, PG_ONECOPY_MIN_PAIR ONECOPY_MIN_PAIR (pass 22), PG_BIG_MIN_PAIR BIG_MIN_PAIR (pass 23)
    tables = {
        "PG_PATCH": select.BIG_LIMIT,
        "PG_PATCH_PAIR": select.BIG_LIMIT_PAIR,
        "PG_ONECOPY": select.ONECOPY_MIN,
        "PG_ONECOPY_MIN_PAIR": select.ONECOPY_MIN_PAIR,
        "PG_BIG_MIN_PAIR": select.BIG_MIN_PAIR,
    }
    for env, table in tables.items():
        for kv in filter(None, os.environ.get(env, "").split(";")):
            k, v = kv.split("=")
            table[k] = size(v)
    if os.environ.get("PG_ONECOPY_PAIR"):  # let a group of two take algorithms.onecopy's reads (select._onecopy)
        select._onecopy = lambda comm, coll, nb: comm.arena is not None and nb > select.ONECOPY_MIN[coll]
    if os.environ.get("PG_NO_ARENA"):  # no call fits the arena's slots (select.fits, the plans' _arena_fits; pass 22)
        import procgroup.plans as _plans

        select.fits = lambda comm, n: False
        _plans._arena_fits = lambda g, n: False
    if os.environ.get("PG_SPLIT"):  # limits.PAIR_SPLIT_MIN (select.PAIR_SPLIT_MIN before pass 23)
        from procgroup.algorithms import limits

        limits.PAIR_SPLIT_MIN = size(os.environ["PG_SPLIT"])
    for kv in filter(None, os.environ.get("PG_FORCE", "").split(";")):  # "coll=algorithm": select.FORCE (pass 24)
        k, v = kv.split("=")
        select.FORCE[k] = v
    if os.environ.get("PG_SMALL_BIG"):  # pass 24 experiment: these collectives take the big slots below the slot
        import procgroup.plans as _plans
        from procgroup.algorithms import limits as _lim

        small = os.environ["PG_SMALL_BIG"].split(",")
        real_bsf, real_fits = _lim.big_slots_for, select.fits

        def bsf(a, coll, nb, floor=True):
            if coll in small and a is not None and a.big is not None and 0 < nb <= a.max_bytes:
                return a.big
            return real_bsf(a, coll, nb, floor)

        select.big_slots_for = _plans.big_slots_for = bsf
        _plans._arena_fits = lambda g, n: False
        select.fits = lambda comm, n: False
    dist.init_process_group("gloo")
    r, p = dist.get_rank(), dist.get_world_size()
    barrier = dist.barrier

    def gather(x):
        out = [None] * p
        dist.all_gather_object(out, x)
        return out if r == 0 else None


def make(op, n):
    f = n // 4
    if op == "a2a":
        a, b = np.ones(f, np.float32), np.empty(f, np.float32)
        return (lambda: c.Alltoall(a, b)) if MPI_MODE else (lambda: dist.all_to_all_single(b, a))
    if op == "ag":
        a, b = np.ones(f, np.float32), np.empty(f * p, np.float32)
        return (lambda: c.Allgather(a, b)) if MPI_MODE else (lambda: dist.all_gather_into_tensor(b, a))
    if op == "rs":
        a, b = np.ones(f, np.float32), np.empty(f // p, np.float32)
        return (lambda: c.Reduce_scatter_block(a, b)) if MPI_MODE else (lambda: dist.reduce_scatter_tensor(b, a))
    if op == "bc":
        a = np.ones(f, np.float32)
        return (lambda: c.Bcast(a, 0)) if MPI_MODE else (lambda: dist.broadcast(a, 0))
    if op == "ar":
        a, b = np.ones(f, np.float32), np.empty(f, np.float32)
        if MPI_MODE:
            return lambda: c.Allreduce(a, b)
        return lambda: (np.copyto(b, a), dist.all_reduce(b))
    if op == "rd":
        a, b = np.ones(f, np.float32), np.empty(f, np.float32)
        return (lambda: c.Reduce(a, b, root=0)) if MPI_MODE else (lambda: dist.reduce(a, 0))
    raise SystemExit(f"unknown op {op}")


res = []
l0, cpu0 = cpu_total(), time.process_time()
t_0 = time.perf_counter()
for spec in OPS:
    op, s = spec.split(":")
    fn = make(op, size(s))
    for _ in range(30):
        fn()
    barrier()
    ts = np.empty(IT)
    prof = None
    if os.environ.get("PG_PROFILE") and r == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    for i in range(IT):
        fn()
        t2 = time.perf_counter()
        ts[i] = t2 - t
        t = t2
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ.get("PG_PROFILE_N", "14")))
    res.append(ts)
l1, cpu1 = cpu_total(), time.process_time()
mine = gather(cpu1 - cpu0)
if r == 0:
    busy = (l1[0] - l0[0]) / max(1, l1[1] - l0[1])  # share of both CPUs busy
    wall = time.perf_counter() - t_0
    load = busy - sum(mine) / (wall * os.cpu_count())
allt = gather([x.tolist() for x in res])
if r == 0:
    cells = []
    for k, spec in enumerate(OPS):
        T = np.array([allt[q][k] for q in range(p)])
        cells.append(f"{spec} {np.median(T.max(0)) * 1e6:.0f}")
    print("RES " + " ".join(cells) + f" LOAD {load * 100:.0f}%", flush=True)
if not MPI_MODE:
    dist.destroy_process_group()
