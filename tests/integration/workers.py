"""Worker programs for the multi-process tests: ``python workers.py NAME [args]``.

Every check compares with a closed form or a numpy reference computed from
all ranks' (deterministic) contributions; a failure raises, so the process
exits non-zero with the traceback and the harness shows it.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import procgroup as dist

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64"]
SIZES = [0, 1, 7, 1000]


def contrib(r: int, n: int, dtype: str) -> np.ndarray:
    return ((r + 1) * (np.arange(n) % 5 + 1)).astype(dtype)


def ref(op: str, ws: int, n: int, dtype: str) -> np.ndarray:
    parts = [contrib(r, n, dtype) for r in range(ws)]
    acc = parts[0].copy()
    uf = {"SUM": np.add, "MAX": np.maximum, "MIN": np.minimum, "PRODUCT": np.multiply, "BXOR": np.bitwise_xor}[op]
    for p in parts[1:]:
        uf(acc, p, out=acc)
    return acc


def ops_for(dtype: str):
    ops = ["SUM"]
    if not dtype.startswith("complex"):
        ops += ["MAX", "MIN"]
    if dtype.startswith(("int", "uint")):
        ops += ["BXOR"]
    return ops


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def hello() -> None:
    dist.init_process_group()
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} backend={dist.get_backend()}")
    dist.barrier()
    dist.destroy_process_group()


def collectives() -> None:
    """Every collective x every root x dtypes x sizes, against numpy references."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    count = 0
    for dtype in DTYPES:
        for n in SIZES:
            for op in ops_for(dtype):
                x = contrib(r, n, dtype)
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                check(np.array_equal(x, ref(op, ws, n, dtype)), f"all_reduce {op} {dtype} n={n}")
                count += 1
            # reduce_scatter_tensor (SUM): block r of the sum of every rank's ws*n input
            inp = contrib(r, ws * n, dtype)
            out = np.zeros(n, dtype)
            dist.reduce_scatter_tensor(out, inp)
            check(
                np.array_equal(out, ref("SUM", ws, ws * n, dtype)[r * n : (r + 1) * n]), f"reduce_scatter {dtype} n={n}"
            )
            # all_gather_into_tensor
            big = np.zeros(ws * n, dtype)
            dist.all_gather_into_tensor(big, contrib(r, n, dtype))
            check(
                np.array_equal(big, np.concatenate([contrib(q, n, dtype) for q in range(ws)])),
                f"all_gather {dtype} n={n}",
            )
            # all_to_all_single: rank r's block j is (r*ws + j + 1) * ones
            a2a_in = np.concatenate([np.full(n, r * ws + j + 1, dtype) for j in range(ws)]) if n else np.zeros(0, dtype)
            a2a_out = np.zeros(ws * n, dtype)
            dist.all_to_all_single(a2a_out, a2a_in)
            expect = np.concatenate([np.full(n, q * ws + r + 1, dtype) for q in range(ws)]) if n else np.zeros(0, dtype)
            check(np.array_equal(a2a_out, expect), f"all_to_all_single {dtype} n={n}")
            for root in range(ws):
                b = contrib(r, n, dtype) if r == root else np.zeros(n, dtype)
                dist.broadcast(b, src=root)
                check(np.array_equal(b, contrib(root, n, dtype)), f"broadcast root={root} {dtype} n={n}")
                x = contrib(r, n, dtype)
                dist.reduce(x, dst=root)
                check(
                    np.array_equal(x, ref("SUM", ws, n, dtype) if r == root else contrib(r, n, dtype)),
                    f"reduce root={root} {dtype} n={n}",
                )
                gl = [np.zeros(n, dtype) for _ in range(ws)] if r == root else None
                dist.gather(contrib(r, n, dtype), gl, dst=root)
                if r == root:
                    check(
                        all(np.array_equal(gl[q], contrib(q, n, dtype)) for q in range(ws)),
                        f"gather root={root} {dtype} n={n}",
                    )
                s = np.zeros(n, dtype)
                dist.scatter(s, [contrib(q, n, dtype) for q in range(ws)] if r == root else None, src=root)
                check(np.array_equal(s, contrib(r, n, dtype)), f"scatter root={root} {dtype} n={n}")
                count += 4
    dist.barrier()
    print(f"rank {r}: {count} checks passed")
    dist.destroy_process_group()


def big(mib: str = "64") -> None:
    """Large messages: all_reduce, broadcast, all_gather of `mib` MiB float32."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    n = int(mib) * (1 << 20) // 4
    x = np.full(n, r + 1, np.float32)
    x[::4097] = r  # some structure
    dist.all_reduce(x)
    check(float(x[1]) == ws * (ws + 1) / 2 and float(x[0]) == ws * (ws - 1) / 2, "big all_reduce")
    b = np.arange(n, dtype=np.float32) if r == 0 else np.zeros(n, np.float32)
    dist.broadcast(b, src=0)
    check(b[-1] == n - 1 and b[12345] == 12345, "big broadcast")
    g = np.zeros(n, np.float32)
    part = n // ws
    dist.all_gather_into_tensor(g[: part * ws], np.full(part, r, np.float32))
    check(all(g[q * part] == q and g[(q + 1) * part - 1] == q for q in range(ws)), "big all_gather")
    print(f"rank {r}: big ok")
    dist.destroy_process_group()


def p2p() -> None:
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    if r == 0:
        got = np.zeros(3, np.int64)
        seen = set()
        for _ in range(ws - 1):
            src = dist.recv(got)  # any source
            check(np.all(got == src * 11), f"any-source payload from {src}")
            seen.add(src)
        check(seen == set(range(1, ws)), f"senders {seen}")
    else:
        dist.send(np.full(3, r * 11, np.int64), dst=0)
    objs = [None]
    if r == 0:
        objs = [{"arr": np.arange(1 << 16), "who": "zero"}]
    dist.broadcast_object_list(objs, src=0)
    check(objs[0]["who"] == "zero" and objs[0]["arr"][-1] == (1 << 16) - 1, "broadcast_object_list")
    dist.destroy_process_group()


def idle_wait(seconds: str = "2") -> None:
    """Rank 0 sleeps, the others block in a collective: they report their CPU time while waiting."""
    dist.init_process_group()
    r = dist.get_rank()
    dist.barrier()
    if r == 0:
        time.sleep(float(seconds))
    c0, t0 = time.process_time(), time.monotonic()
    x = np.ones(4)
    dist.all_reduce(x)
    c1, t1 = time.process_time(), time.monotonic()
    print(f"rank {r}: waited {t1 - t0:.2f}s cpu {c1 - c0:.3f}s")
    dist.destroy_process_group()


def init_only() -> None:
    """Init and report; used for error tests (missing ranks, mismatches)."""
    timeout = float(os.environ.get("TEST_INIT_TIMEOUT", "30"))
    dist.init_process_group(timeout=timeout)
    print(f"rank {dist.get_rank()} joined")
    dist.destroy_process_group()


def mismatch(kind: str = "op", warm: str = "0") -> None:
    """Rank 0 and rank 1 call different collectives at the same point; both must raise, showing both calls.

    ``warm`` "1": first make both ranks call both sides' collectives a few times, so that every call of the
    mismatch runs from a warm plan (procgroup.plans)."""
    dist.init_process_group(timeout=30)
    r = dist.get_rank()
    dist.barrier()
    x = np.ones(4, np.float32)
    if warm == "1":
        for _ in range(3):
            dist.all_reduce(np.ones(4, np.float32))
            dist.all_reduce(np.ones(4, np.float64))
            dist.all_reduce(np.ones(8, np.float32))
            dist.broadcast(np.ones(4, np.float32), src=0)
            dist.broadcast(np.ones(4, np.float32), src=1)
            dist.barrier()
        check(len(dist.group.WORLD.plans) == 6, f"plans not warm: {dist.group.WORLD.plans}")
    t0 = time.monotonic()
    try:
        if kind == "op":
            dist.all_reduce(x) if r == 0 else dist.broadcast(x, src=0)
        elif kind == "dtype":
            dist.all_reduce(x if r == 0 else np.ones(4, np.float64))
        elif kind == "shape":
            dist.all_reduce(x if r == 0 else np.ones(8, np.float32))
        elif kind == "root":
            # both ranks think they are the root: neither waits, so the mismatch is found from the published
            # call histories and raised by the next call, within a couple of seconds (the window is 25 s)
            dist.broadcast(x, src=r)
            while time.monotonic() - t0 < 25:
                dist.barrier()
                time.sleep(0.05)
        elif kind == "roots":
            # the same, but every later call is a root's broadcast too, which never waits for the other rank: the
            # watchdog's finding must reach a call that completes without asking the transport (abort_world)
            while time.monotonic() - t0 < 25:
                dist.broadcast(x, src=r)
                time.sleep(0.01)
    except dist.CollectiveMismatchError as e:
        print(f"rank {r}: mismatch after {time.monotonic() - t0:.1f}s: {e}")
        sys.exit(3)
    print(f"rank {r}: no error")


def set_last(store, key: str) -> None:
    """Set ``key`` on a rank other than 0 as its last store call: rank 0, which hosts the store, may exit as soon
    as it reads the key, before the reply reaches this rank; the store gone then is the end waited for."""
    from procgroup.errors import BrokenError

    try:
        store.set(key, b"1")
    except BrokenError:
        pass


def timeout_rollcall() -> None:
    """Rank 1 never joins the second all_reduce: rank 0's deadline error shows the roll call.

    Rank 1 stays alive (so that rank 0 times out rather than seeing a dead peer) until rank 0 has its error, then
    exits (it slept 8 s before, 4.5 s past rank 0's 3 s deadline); rank 0 leaves last (it hosts the store)."""
    dist.init_process_group(timeout=30)
    r = dist.get_rank()
    store = dist.group.WORLD.world.store
    x = np.ones(4)
    dist.all_reduce(x)
    if r == 0:
        try:
            dist.all_reduce(x, timeout=3)
        except dist.DistTimeoutError as e:
            print(f"rank 0: timeout: {e}", flush=True)
            store.set("test/rollcall/reported", b"1")
            store.wait(["test/rollcall/seen"], timeout=30)
            sys.exit(4)
    else:
        store.wait(["test/rollcall/reported"], timeout=30)
        set_last(store, "test/rollcall/seen")


def monitored() -> None:
    """Rank 2 is late: the others' monitored_barrier names it.

    Rank 2 stays away until ranks 0 and 1 have their errors, then exits (it slept 6 s before, 4 s past their
    2 s deadline); rank 0 leaves last (it hosts the store)."""
    dist.init_process_group(timeout=30)
    r = dist.get_rank()
    store = dist.group.WORLD.world.store
    if r == 2:
        store.wait(["test/monitored/0", "test/monitored/1"], timeout=30)
        set_last(store, "test/monitored/seen")
        return
    try:
        dist.monitored_barrier(timeout=2, wait_all_ranks=True)
    except dist.DistTimeoutError as e:
        print(f"rank {r}: {e}", flush=True)
        if r == 0:
            store.set("test/monitored/0", b"1")
            store.wait(["test/monitored/1", "test/monitored/seen"], timeout=30)
        else:
            set_last(store, "test/monitored/1")
        sys.exit(5)


def stuck_for_dump(go: str = "") -> None:
    """Rank 0 blocks in an all_reduce that rank 1 joins only once the file ``go`` exists (after 5 s without
    one); the test sends SIGUSR1 meanwhile and makes ``go`` once it has read rank 0's dump."""
    dist.init_process_group(timeout=30)
    r = dist.get_rank()
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    print(f"rank {r}: ready pid {os.getpid()}", flush=True)
    if r == 1:
        stop = time.monotonic() + (30 if go else 5)
        while not (go and os.path.exists(go)) and time.monotonic() < stop:
            time.sleep(0.02)
    dist.all_reduce(x)
    print(f"rank {r}: done", flush=True)


def kill_loop(victim: str = "2", after: str = "10") -> None:
    """All ranks loop over collectives; the victim SIGKILLs itself after `after` iterations.

    Every survivor must raise naming the victim within 5 s; prints 'survivor R: <secs> <error>'.
    """
    import signal as _signal

    dist.init_process_group(timeout=60)
    r, ws = dist.get_rank(), dist.get_world_size()
    v, n = int(victim), int(after)
    x = np.ones(1 << 12, np.float32)
    i = 0
    t_last = time.monotonic()
    try:
        while True:
            if r == v and i == n:
                os.kill(os.getpid(), _signal.SIGKILL)
            op = i % 3
            t_last = time.monotonic()
            if op == 0:
                dist.all_reduce(x)
            elif op == 1:
                dist.broadcast(x, src=i % ws)
            else:
                dist.all_gather_into_tensor(np.zeros(ws * 16, np.float32), np.ones(16, np.float32))
            i += 1
    except dist.ProcGroupError as e:
        print(f"survivor {r}: {time.monotonic() - t_last:.2f}s {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


def subgroups() -> None:
    """new_group, new_subgroups (per host and by size), split_group by colour/key and by rank lists."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    g01 = dist.new_group([0, 1])
    x = np.array([r + 1], np.int64)
    dist.all_reduce(x, group=g01)
    check(x[0] == (3 if r < 2 else r + 1), f"new_group all_reduce {x}")
    mine, allg = dist.new_subgroups()  # one host: one group of everyone
    check(dist.get_process_group_ranks(mine) == list(range(ws)) and len(allg) == 1, "new_subgroups per host")
    pair, pairs = dist.new_subgroups(group_size=2)
    y = np.array([r], np.int64)
    dist.all_reduce(y, group=pair)
    check(y[0] == (r // 2) * 4 + 1, f"pair all_reduce {y}")
    # MPI-style split: colour = parity, key = -rank (reverse order inside each colour)
    half = dist.split_group(color=r % 2, key=-r)
    ranks = dist.get_process_group_ranks(half)
    check(ranks == sorted([q for q in range(ws) if q % 2 == r % 2], reverse=True), f"split by colour {ranks}")
    z = np.array([r], np.int64)
    dist.all_reduce(z, group=half)
    check(z[0] == sum(q for q in range(ws) if q % 2 == r % 2), f"colour all_reduce {z}")
    check(dist.get_rank(half) == ranks.index(r), "group rank follows key order")
    blocks = dist.split_group(split_ranks=[[0, 1], [2, 3]])
    w = np.array([1], np.int64)
    dist.all_reduce(w, group=blocks)
    check(w[0] == 2, f"split_ranks all_reduce {w}")
    objs = [None, None]
    dist.all_gather_object(objs, r, group=blocks)
    check(objs == [r - r % 2, r - r % 2 + 1], f"all_gather_object in a subgroup {objs}")
    check((g01 is dist.GroupMember.NON_GROUP_MEMBER) == (r >= 2), f"non-members get NON_GROUP_MEMBER: {g01!r}")
    dist.destroy_process_group(g01)  # every rank runs the same cleanup; a non-member's is a no-op
    print(f"rank {r}: subgroups ok")
    dist.destroy_process_group()


def noncontig() -> None:
    """Every collective that writes a user tensor, into strided numpy views and transposed torch tensors."""
    dist.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    libs = ["numpy"]
    try:
        import torch

        libs.append("torch")
    except ImportError:
        torch = None
    for lib in libs:

        def z(k: int, fill: float = 0.0, lib: str = lib):  # a strided 1-D view of k elements; its base's gaps hold -1
            if lib == "numpy":
                base = np.full(2 * k, -1.0)
                v = base[::2]
            else:
                base = torch.full((2 * k,), -1.0, dtype=torch.float64)
                v = base[::2]
            v[...] = fill
            assert not (v.flags.c_contiguous if lib == "numpy" else v.is_contiguous())
            return base, v

        def t(a, lib: str = lib):  # a contiguous input of the same library
            return np.asarray(a, np.float64) if lib == "numpy" else torch.tensor(np.asarray(a, np.float64))

        def eq(v, want, what, lib: str = lib):
            got = np.asarray(v if lib == "numpy" else v.numpy())
            check(np.array_equal(got, np.asarray(want, np.float64)), f"{lib} {what}: got {got}, want {want}")

        def gaps(base, what, lib: str = lib):
            b = np.asarray(base if lib == "numpy" else base.numpy())
            check(np.all(b[1::2] == -1.0), f"{lib} {what}: the gaps between the view's elements changed: {b}")

        for async_op in (False, True):

            def done(w, async_op: bool = async_op):
                if async_op:
                    if w is not None:
                        while not w.is_completed():
                            time.sleep(0.001)
                        w.wait()

            tag = f"{'async' if async_op else 'blocking'}"
            # all_reduce on a transposed 2-D view
            if lib == "numpy":
                m = np.full((3, 2), float(r + 1)).T
            else:
                m = torch.full((3, 2), float(r + 1), dtype=torch.float64).t()
            done(dist.all_reduce(m, async_op=async_op))
            eq(m, np.full((2, 3), n * (n + 1) / 2), f"all_reduce {tag}")
            b, v = z(3, r + 1)
            done(dist.all_reduce(v, async_op=async_op))
            eq(v, [n * (n + 1) / 2] * 3, f"all_reduce strided {tag}")
            gaps(b, "all_reduce")
            b, v = z(4, 100 * r)
            if r == 0:
                v[...] = t([1, 2, 3, 4])
            done(dist.broadcast(v, src=0, async_op=async_op))
            eq(v, [1, 2, 3, 4], f"broadcast {tag}")
            gaps(b, "broadcast")
            b, v = z(3, r + 1)
            done(dist.reduce(v, dst=0, async_op=async_op))
            if r == 0:
                eq(v, [n * (n + 1) / 2] * 3, f"reduce {tag}")
            gaps(b, "reduce")
            pairs = [z(3) for _ in range(n)]
            done(dist.all_gather([v for _, v in pairs], t([r + 1] * 3), async_op=async_op))
            for i, (b, v) in enumerate(pairs):
                eq(v, [i + 1] * 3, f"all_gather[{i}] {tag}")
                gaps(b, "all_gather")
            b, v = z(3 * n)
            done(dist.all_gather_into_tensor(v, t([r + 1] * 3), async_op=async_op))
            eq(v, np.repeat(np.arange(1, n + 1), 3), f"all_gather_into_tensor {tag}")
            gaps(b, "all_gather_into_tensor")
            pairs = [z(3) for _ in range(n)] if r == 0 else []
            done(dist.gather(t([r + 1] * 3), [v for _, v in pairs] if r == 0 else None, dst=0, async_op=async_op))
            for i, (b, v) in enumerate(pairs):
                eq(v, [i + 1] * 3, f"gather[{i}] {tag}")
                gaps(b, "gather")
            b, v = z(3)
            sl = [t([i + 1] * 3) for i in range(n)] if r == 0 else None
            done(dist.scatter(v, sl, src=0, async_op=async_op))
            eq(v, [r + 1] * 3, f"scatter {tag}")
            gaps(b, "scatter")
            b, v = z(3)
            done(dist.reduce_scatter(v, [t([r + i] * 3) for i in range(n)], async_op=async_op))
            eq(v, [n * r + n * (n - 1) / 2] * 3, f"reduce_scatter {tag}")
            gaps(b, "reduce_scatter")
            b, v = z(3)
            done(dist.reduce_scatter_tensor(v, t(np.repeat([r + i for i in range(n)], 3)), async_op=async_op))
            eq(v, [n * r + n * (n - 1) / 2] * 3, f"reduce_scatter_tensor {tag}")
            gaps(b, "reduce_scatter_tensor")
            pairs = [z(3) for _ in range(n)]
            done(dist.all_to_all([v for _, v in pairs], [t([10 * r + j] * 3) for j in range(n)], async_op=async_op))
            for i, (b, v) in enumerate(pairs):
                eq(v, [10 * i + r] * 3, f"all_to_all[{i}] {tag}")
                gaps(b, "all_to_all")
            b, v = z(3 * n)
            done(dist.all_to_all_single(v, t(np.repeat([10 * r + j for j in range(n)], 3)), async_op=async_op))
            eq(v, np.repeat([10 * i + r for i in range(n)], 3), f"all_to_all_single {tag}")
            gaps(b, "all_to_all_single")
            b, v = z(4)
            if r == 0:
                for peer in range(1, n):
                    dist.send(t([peer, 2, 3, 4]), dst=peer)
            elif async_op:
                done(dist.irecv(v, src=0))
            else:
                dist.recv(v, src=0)
            if r > 0:
                eq(v, [r, 2, 3, 4], f"recv {tag}")
            gaps(b, "recv")
    dist.barrier()
    print(f"rank {r}: noncontig ok ({', '.join(libs)})")
    dist.destroy_process_group()


def gid_cycles(cycles: str = "1000", start: str = "0") -> None:
    """Issue 11 item 4: new_group/destroy_process_group ``cycles`` times with a long-lived subgroup alive; then
    all_reduce on the world and on the long-lived group.

    ``start`` > 0: rank 0 first moves the store's fresh-id counter to ``start``, as if that many groups had been
    made before, so that the cycles run at the id limit (GID_LIMIT - 4: the long-lived group and the first two
    cycles take the last three fresh ids, as two cycles' groups can be alive at once: rank 0 may make the next
    before rank 1 destroyed the last; every later cycle needs a reused id, so the old code, without reuse,
    failed on the third cycle as it did at 16,384 without the head start).  After ``cycles // 10`` warm-up
    cycles the open file descriptors, the groups on record and the store's keys are counted: the end of the run
    must find at most a few more (a leak of one per cycle would add ``cycles - cycles // 10``), so a per-cycle
    leak shows without running the tens of thousands of cycles that would exhaust a resource."""
    from procgroup.state import _state

    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    n, warm = int(cycles), int(cycles) // 10
    if int(start) and r == 0:
        store = dist.group.WORLD.world.store
        store.add("gid_counter", int(start) - int(store.add("gid_counter", 0)))
    dist.barrier()  # no rank makes a group before the counter is in place

    def counts() -> tuple:
        dist.barrier()  # every rank finished the cycles before (the last one through cleans the keys up)
        st = dist.group.WORLD.world.store
        return len(os.listdir("/proc/self/fd")), len(_state.groups), st.num_keys() if r == 0 else 0

    keep = dist.new_group(list(range(ws)))
    t0 = time.monotonic()
    gids = set()
    for i in range(n):
        if i == warm:
            before = counts()
        g = dist.new_group(list(range(ws)))
        gids.add(g.gid)
        if i % 100 == 0 or i == n - 1:  # now and then, a collective on the reused id: it must agree on every rank
            y = np.array([r + i], np.int64)
            dist.all_reduce(y, group=g)
            check(y[0] == sum(q + i for q in range(ws)), f"cycle {i} gid {g.gid} gen {getattr(g, 'gen', 0)}: {y}")
        dist.destroy_process_group(g)
    dt = time.monotonic() - t0
    after = counts()
    grew = [a - b for a, b in zip(after, before)]  # a few store keys come and go (free-list entries, barriers)
    check(max(grew) <= 5, f"(fds, groups, store keys) grew from {before} after {warm} cycles to {after} after {n}")
    check(len(gids) <= 2 and keep.gid not in gids, f"ids {sorted(gids)} (long-lived {keep.gid}): not reused")
    for grp in (None, keep):
        x = np.array([r + 1], np.int64)
        dist.all_reduce(x, group=grp)
        check(x[0] == ws * (ws + 1) // 2, f"all_reduce after the cycles {x}")
    print(f"rank {r}: gid_cycles ok {n} cycles from id {keep.gid} in {dt:.2f}s ({n / dt:.0f}/s) {before} {after}")
    dist.destroy_process_group()


def gid_reuse_clean() -> None:
    """A reused id starts neither broken nor with its last incarnation's messages."""
    dist.init_process_group()
    r = dist.get_rank()
    g = dist.new_group([0, 1])
    gid = g.gid
    store = g.world.store
    store.set(f"wd/broken/{gid}", b"old incarnation broke")  # as a deadline error of the old incarnation would
    x = np.array([1], np.int64)
    dist.all_reduce(x, group=g)
    dist.barrier()
    dist.destroy_process_group(g)
    dist.barrier()
    h = dist.new_group([0, 1])
    check(h.gid == gid and h.gen == 1, f"id {gid} not reused: got {h.gid} gen {h.gen}")
    y = np.array([1], np.int64)
    dist.all_reduce(y, group=h)
    dist.all_reduce(y, group=h)
    check(y[0] == 4, f"reused id inherited a stale message or state: {y}")
    print(f"rank {r}: gid_reuse_clean ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
