"""Workers of tests/integration/test_p2p_fast_procs.py: ``python p2p_fast_worker.py NAME [args]``.

They exercise the blocking small-message fast path of send/recv (``ShmTransport.send_fast``/``recv_fast``)
mixed with everything that must not be overtaken by it: isend/irecv posted before or after, batches,
any-source receives, messages above the fast path's size and rendezvous messages, on the same (peer, tag).
Each rank prints JSON lines; a failed check raises (non-zero exit, traceback on stderr).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Tuple

import numpy as np

import procgroup as dist

#: element counts (int64, 3 of them the header) straddling the fast path's 64 KiB and the 1 MiB rendezvous
EXTRA = [0, 0, 0, 1, 5, 8189, 8190, 140000]
ANY_TAG = 7
BURST, BIG = 5, 140000
#: order_stress sends blocking only below this (a blocking rendezvous send waits for the receiver: no cycles)
BLOCKING_MAX = 1 << 20


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _size(s: int, d: int, k: int) -> int:
    return 3 + EXTRA[(s * 7 + d * 3 + k) % len(EXTRA)] if k % 4 == 3 else 3


def _msg(s: int, d: int, k: int) -> np.ndarray:
    a = np.full(_size(s, d, k), s * 1000 + k, np.int64)
    a[:3] = (s, k, k % 2)
    return a


def _counters() -> Tuple[int, int]:
    t = dist.group.WORLD.world.transport
    return getattr(t, "fast_sends", -1), getattr(t, "fast_recvs", -1)


def order_stress(rounds: str = "300") -> None:
    """Every rank sends round k to every other rank (tag k % 2; blocking, isend or a batch, chosen at random)
    and receives round k from every other rank (blocking recv, or an irecv waited up to three rounds later);
    every fifth round also carries an any-source message (tag 7).  Each receive must get exactly its round's
    message (non-overtaking per (peer, tag)), and the any-source ones arrive in order per sender."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    rng = random.Random(1000 + r)
    others = [p for p in range(ws) if p != r]
    keep: List[Any] = []  # isend Works (and their buffers) until the end
    lagging: List[Tuple[int, Any, np.ndarray, Tuple[int, int]]] = []  # (wait at round, work, buf, (src, k))
    any_got: Dict[int, List[int]] = {p: [] for p in others}
    any_pending: List[Tuple[Any, np.ndarray]] = []
    n = int(rounds)
    for k in range(n):
        burst = k % 40 == 1  # five 1.1 MB isends of the round's tag ahead of its message (fill a ring: CMA off)
        if not burst and rng.random() < 0.3:  # post some receives of this round before anything is sent
            for s in others:
                buf = np.zeros(_size(s, r, k), np.int64)
                lagging.append((k + rng.randrange(4), dist.irecv(buf, src=s, tag=k % 2), buf, (s, k)))
            pre = True
        else:
            pre = False
        for d in others:
            if burst:
                for j in range(BURST):
                    big = np.full(BIG, j, np.int64)
                    big[:3] = (r, k, k % 2)
                    keep.append((dist.isend(big, dst=d, tag=k % 2), big))
            m = _msg(r, d, k)
            how = rng.random()
            if how < 0.5 and m.nbytes < BLOCKING_MAX:
                dist.send(m, dst=d, tag=k % 2)
            elif how < 0.8:
                keep.append((dist.isend(m, dst=d, tag=k % 2), m))
            else:
                keep.append((dist.batch_isend_irecv([dist.P2POp(dist.isend, m, d, tag=k % 2)]), m))
            if k % 5 == 0:
                dist.send(np.array([r, k], np.int64), dst=d, tag=ANY_TAG)
        if not pre:
            for s in others:
                for j in range(BURST if burst else 0):
                    big = np.zeros(BIG, np.int64)
                    dist.recv(big, src=s, tag=k % 2)
                    check(tuple(big[:4]) == (s, k, k % 2, j), f"burst {j} of round {k} from {s}: {big[:4]}")
                buf = np.zeros(_size(s, r, k), np.int64)
                if rng.random() < 0.6:
                    got = dist.recv(buf, src=s, tag=k % 2)
                    check(got == s, f"recv returned {got}, not {s}")
                    check(bool((buf == _msg(s, r, k)).all()), f"round {k} from {s}: got header {buf[:3]}")
                else:
                    lagging.append((k + rng.randrange(4), dist.irecv(buf, src=s, tag=k % 2), buf, (s, k)))
        if k % 5 == 0:
            for _ in others:
                a = np.zeros(2, np.int64)
                if rng.random() < 0.5:
                    src = dist.recv(a, tag=ANY_TAG)
                    check(src == a[0], f"any-source recv returned {src} for a message of {a[0]}")
                    any_got[int(a[0])].append(int(a[1]))
                else:
                    any_pending.append((dist.irecv(a, tag=ANY_TAG), a))
        due = [x for x in lagging if x[0] <= k]
        lagging = [x for x in lagging if x[0] > k]
        for _, w, buf, (s, kk) in due:
            w.wait()
            check(bool((buf == _msg(s, r, kk)).all()), f"irecv of round {kk} from {s}: got header {buf[:3]}")
        for w, a in any_pending:
            w.wait()
            any_got[int(a[0])].append(int(a[1]))
        any_pending = []
    for _, w, buf, (s, kk) in lagging:
        w.wait()
        check(bool((buf == _msg(s, r, kk)).all()), f"irecv of round {kk} from {s}: got header {buf[:3]}")
    for w, _m in keep:
        for x in w if isinstance(w, list) else [w]:
            x.wait()
    want = list(range(0, n, 5))
    for p, ks in any_got.items():
        check(ks == want, f"any-source messages of rank {p} out of order or missing: {ks}")
    dist.barrier()
    fs, fr = _counters()
    print(json.dumps({"rank": r, "fast_sends": fs, "fast_recvs": fr}), flush=True)
    dist.destroy_process_group()


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]  # fmt: skip


def dtypes_sizes() -> None:
    """Ranks 0 and 1 ping-pong every dtype at sizes 0, 1, odd and around the fast path's 64 KiB (in bytes);
    rank 1 echoes what it got plus one; the other ranks exchange with rank 0 meanwhile by any-source."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    for dt in DTYPES:
        item = np.dtype(dt).itemsize
        around = [(65536 // item) + d for d in (-1, 0, 1)]
        for n in [0, 1, 7, 1001] + around:
            if r == 0:
                x = (np.arange(n) % 2).astype(dt)
                dist.send(x, dst=1, tag=n % 5)
                y = np.zeros(n, dt)
                check(dist.recv(y, src=1, tag=n % 5) == 1, "echo source")
                check(bool((y == (x + 1 if dt != "bool" else np.ones(n, dt))).all()), f"{dt}[{n}] echo")
                for _ in range(ws - 2):
                    z = np.zeros(3, dt)
                    src = dist.recv(z, tag=100 + DTYPES.index(dt))
                    check(bool((z == np.full(3, src % 2, dt)).all()), f"{dt} any-source from {src}: {z}")
            elif r == 1:
                y = np.zeros(n, dt)
                check(dist.recv(y, src=0, tag=n % 5) == 0, "source")
                check(bool((y == (np.arange(n) % 2).astype(dt)).all()), f"{dt}[{n}] payload")
                dist.send(y + 1 if dt != "bool" else np.ones(n, dt), dst=0, tag=n % 5)
            else:
                dist.send(np.full(3, r % 2, dt), dst=0, tag=100 + DTYPES.index(dt))
    try:
        import torch  # noqa: F401 - optional: CPU tensors (bfloat16 too) through the same path
    except ImportError:
        torch = None
    if torch is not None and ws >= 2 and r < 2:
        for tdt in (torch.bfloat16, torch.float32, torch.int64):
            t = torch.arange(9).to(tdt) if r == 0 else torch.zeros(9, dtype=tdt)
            if r == 0:
                dist.send(t, dst=1)
            else:
                dist.recv(t, src=0)
                check(bool((t == torch.arange(9).to(tdt)).all()), f"torch {tdt}: {t}")
    dist.barrier()
    fs, fr = _counters()
    print(json.dumps({"rank": r, "fast_sends": fs, "fast_recvs": fr}), flush=True)
    dist.destroy_process_group()


def edges() -> None:
    """0-d and non-contiguous arrays, read-only receive buffers, bad tags, a subgroup with a non-member rank
    and group_dst/group_src: what the blocking fast path must hand to the general path or refuse alike."""
    dist.init_process_group()
    r = dist.get_rank()
    g = dist.new_group([0, 1])
    res: Dict[str, Any] = {"rank": r}
    if r == 0:
        dist.send(np.array(2.5, np.float64), dst=1)
        dist.send(np.arange(10, dtype=np.int32)[::2], dst=1, tag=3)
        dist.send(np.arange(6, dtype=np.int16).reshape(2, 3), group_dst=1, group=g)
        dist.send(np.arange(24, dtype=np.float32).reshape(2, 3, 4), dst=1, tag=4)  # C-contiguous n-d: the array itself
        dist.send(np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)), dst=1, tag=5)
    elif r == 1:
        z = np.zeros((), np.float64)
        check(dist.recv(z, src=0) == 0 and float(z) == 2.5, f"0-d: {z}")
        nc = np.zeros(10, np.int32)
        dist.recv(nc[::2], src=0, tag=3)
        check(nc.tolist() == [0, 0, 2, 0, 4, 0, 6, 0, 8, 0], f"non-contiguous receive: {nc}")
        m = np.zeros((2, 3), np.int16)
        check(dist.recv(m, group_src=0, group=g) == 0 and m.ravel().tolist() == list(range(6)), f"group_src: {m}")
        nd = np.zeros((4, 6), np.float32)
        check(dist.recv(nd, src=0, tag=4) == 0 and nd.ravel().tolist() == list(range(24)), f"n-d: {nd}")
        fo = np.asfortranarray(np.zeros((3, 4), np.int64))  # not C-contiguous: the general path
        check(dist.recv(fo, src=0, tag=5) == 0 and (fo == np.arange(12).reshape(3, 4)).all(), f"fortran: {fo}")
        ro = np.zeros(2)
        ro.flags.writeable = False
        res["ro"] = _err(lambda: dist.recv(ro, src=0))
    if r == 0:  # a forked child may not use the parent's group (its rings and matching state are the parent's)
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                dist.send(np.zeros(1), dst=1)
            except Exception as e:  # noqa: BLE001 - the child reports by exit code
                code = 0 if "fork" in str(e) else 4
            os._exit(code)
        res["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if r < 2:
        peer = 1 - r
        res["neg_send"] = _err(lambda: dist.send(np.zeros(1), dst=peer, tag=-1))
        res["big_recv"] = _err(lambda: dist.recv(np.zeros(1), src=peer, tag=1 << 40))
        res["self"] = _err(lambda: dist.send(np.zeros(1), dst=r))
    else:
        res["nonmember"] = [dist.send(np.zeros(1), dst=0, group=g), dist.recv(np.zeros(1), src=0, group=g)]
    dist.barrier()
    print(json.dumps(res), flush=True)
    dist.destroy_process_group()


def _err(fn: Any) -> Dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"err": type(e).__name__, "msg": str(e), "s": round(time.monotonic() - t0, 3)}
    return {"err": None, "msg": "", "s": round(time.monotonic() - t0, 3)}


def errors() -> None:
    """Blocking sends that rank 1 receives wrongly: another dtype, another byte count, a larger message, and
    (in a 2-second subgroup) another tag.  Rank 1 prints what each raised."""
    dist.init_process_group()
    r = dist.get_rank()
    g = dist.new_group([0, 1], timeout=2)
    if r == 0:
        dist.send(np.ones(4, np.float32), dst=1, tag=11)
        dist.send(np.ones(3, np.float32), dst=1, tag=12)
        dist.send(np.ones(5, np.float32), dst=1, tag=13)
        dist.send(np.ones(4, np.float32), dst=1, tag=20, group=g)
    elif r == 1:
        out = np.zeros(4, np.int32)
        print(json.dumps({"case": "dtype", **_err(lambda: dist.recv(out, src=0, tag=11))}), flush=True)
        right = np.zeros(4, np.float32)
        dist.recv(right, src=0, tag=11)  # the mismatched message is still there, in order
        check(bool((right == 1).all()), f"the float32 message after the mismatch: {right}")
        print(json.dumps({"case": "count", **_err(lambda: dist.recv(np.zeros(4, np.float32), src=0, tag=12))}))
        print(json.dumps({"case": "larger", **_err(lambda: dist.recv(np.zeros(4, np.float32), src=0, tag=13))}))
        print(json.dumps({"case": "tag", **_err(lambda: dist.recv(np.zeros(4, np.float32), 0, g, tag=21))}))
        print(json.dumps({"case": "broken", **_err(lambda: dist.recv(np.zeros(4, np.float32), 0, g, tag=20))}))
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def killed_peer() -> None:
    """Rank 1 dies (SIGKILL) after 2 s; every other rank is blocked in a recv from it and reports the error,
    the time to it and the CPU time it used meanwhile."""
    dist.init_process_group()
    r = dist.get_rank()
    x = np.zeros(1, np.int64)
    for _ in range(50):  # warm: the fast path is in use between the ranks
        if r == 1:
            for p in range(dist.get_world_size()):
                if p != 1:
                    dist.send(x, dst=p)
        else:
            dist.recv(x, src=1)
    dist.barrier()
    if r == 1:
        time.sleep(2.0)
        os.kill(os.getpid(), signal.SIGKILL)
    c0, t0 = time.process_time(), time.monotonic()
    res = _err(lambda: dist.recv(x, src=1))
    res.update(rank=r, cpu=round(time.process_time() - c0, 3), s=round(time.monotonic() - t0, 3))
    print(json.dumps(res), flush=True)
    os._exit(0)  # the world lost a member: leave without the collective shutdown


def sleeper_wakeup(rounds: str = "300") -> None:
    """Ranks 0 and 1 ping-pong ``rounds`` blocking messages with the spin off (PROCGROUP_SHM_SPIN_US=0): a
    receive finds its message there or sleeps on its doorbell at once, and the send that follows must wake it
    (the doorbell write, a fence, the sleep flag).  Before each send the sender waits at random: not at all or
    up to 0.3 ms (the race with a receiver just going to sleep), or 4-12 ms (the receiver is asleep).  Each rank
    reports its receives' latencies (from the sender's clock reading in the message: one CLOCK_MONOTONIC on
    the host).  A missed wake-up is only noticed at the blocking receive's next dtype probe (2, 6, 14 ms...
    after it began): a long wait then costs milliseconds instead of a wake-up's ~0.1 ms."""
    dist.init_process_group()
    r = dist.get_rank()
    rng = random.Random(1234 + r)
    lat: Dict[bool, List[float]] = {False: [], True: []}
    msg = np.zeros(3, np.float64)
    peer = 1 - r
    for i in range(int(rounds)):
        for turn in (0, 1):
            if turn == r:
                u = rng.random()
                d = 0.0 if u < 0.375 else rng.uniform(0, 3e-4) if u < 0.75 else rng.uniform(4e-3, 12e-3)
                if d:
                    time.sleep(d)
                msg[:] = (time.monotonic(), i, d > 1e-3)
                dist.send(msg, dst=peer)
            else:
                dist.recv(msg, src=peer)
                lat[bool(msg[2])].append(time.monotonic() - float(msg[0]))
                check(msg[1] == i, f"round {i}: got round {msg[1]}")
    fs, fr = _counters()
    out: Dict[str, Any] = {"rank": r, "fast_sends": fs, "fast_recvs": fr}
    for long, xs in lat.items():
        xs.sort()
        k = "long" if long else "short"
        out.update({f"n_{k}": len(xs), f"median_{k}_ms": xs[len(xs) // 2] * 1e3, f"max_{k}_ms": xs[-1] * 1e3})
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
