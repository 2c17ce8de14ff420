"""Workers of tests/integration/test_p2p_core_procs.py: ``python p2p_core_worker.py NAME [args]``.

The compiled shm fast path of blocking send/recv (``_p2pwait.Core``, issue 14) against what it must keep:
threads sharing the transport lock (several groups at once, a progress thread), message order per (peer, tag)
with queued isends/irecvs and unexpected messages of the same and other tags, collectives in between, the
counters, and ranks blocked in send/recv asleep.  Each rank prints one JSON line; a failed check raises.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

import numpy as np

import procgroup as dist
from procgroup.errors import BrokenError

#: payload sizes in bytes: 0, 1, odd, at the fast path's 64 KiB and just above (streamed), ~1 MiB
SIZES = [0, 1, 7, 4, 1001, 65536, 65537, 65535, 1 << 20]
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]  # fmt: skip


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _payload(dt: str, nbytes: int, seed: int) -> np.ndarray:
    """A closed-form array of about ``nbytes`` bytes: (i + seed) % 7 (True where odd for bool)."""
    item = np.dtype(dt).itemsize
    n = nbytes // item
    v = (np.arange(n) + seed) % 7
    return (v % 2).astype(dt) if dt == "bool" else v.astype(dt)


def _transport() -> Any:
    return dist.group.WORLD.world.transport


def _state(t: Any) -> Dict[str, Any]:
    return {
        "core": getattr(t, "_core", None) is not None,
        "c_send": type(getattr(t, "send_fast", None)).__name__,
        "fast_sends": getattr(t, "fast_sends", -1),
        "fast_recvs": getattr(t, "fast_recvs", -1),
        "fast_handoffs": getattr(t, "fast_handoffs", -1),
        "sent": t.sent_bytes(),
    }


def _warm(x: np.ndarray, r: int) -> None:
    """20 ping-pongs of ``x`` between ranks 0 and 1: the fast path is in use afterwards."""
    for _k in range(20):
        if r == 0:
            dist.send(x, dst=1)
            dist.recv(x, src=1)
        else:
            dist.recv(x, src=0)
            dist.send(x, dst=0)


def threads(rounds: str = "150") -> None:
    """Ranks 0 and 1 run three threads, each on a group of its own over ranks 0 and 1: two ping-pong blocking
    messages of every dtype and size (one thread starts on each rank, so both directions run at once); the third
    posts isends/irecvs and waits.  The main thread meanwhile all-reduces on the world.  Every message is
    checked against its closed form; the transport lock is shared by all of them."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([0, 1]) for _ in range(3)]
    n = int(rounds)
    errors: List[str] = []
    sent = [0]
    lock = threading.Lock()

    def pingpong(g: Any, first: int, salt: int) -> None:
        try:
            peer = 1 - r
            for k in range(n):
                dt = DTYPES[(k + salt) % len(DTYPES)]
                nb = SIZES[(k * 5 + salt) % len(SIZES)]
                for turn in (first, 1 - first):
                    if turn == r:
                        x = _payload(dt, nb, k + salt)
                        dist.send(x, dst=peer, group=g, tag=k % 3)
                        with lock:
                            sent[0] += x.nbytes
                    else:
                        y = np.zeros_like(_payload(dt, nb, 0))
                        check(dist.recv(y, src=peer, group=g, tag=k % 3) == peer, "source")
                        check(bool((y == _payload(dt, nb, k + salt)).all()), f"thread {salt}: {dt}[{nb}] round {k}")
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"{salt}: {type(e).__name__}: {e}")

    def async_ops(g: Any) -> None:
        try:
            peer = 1 - r
            for k in range(n):
                x = _payload("int32", 4 * (k % 9), k)
                y = np.zeros_like(x)
                ws_ = [dist.irecv(y, src=peer, group=g, tag=k % 2), dist.isend(x, dst=peer, group=g, tag=k % 2)]
                for w in ws_:
                    w.wait()
                check(bool((y == x).all()), f"async round {k}")
        except BaseException as e:  # noqa: BLE001
            errors.append(f"async: {type(e).__name__}: {e}")

    if r < 2:
        ths = [
            threading.Thread(target=pingpong, args=(groups[0], 0, 0)),
            threading.Thread(target=pingpong, args=(groups[1], 1, 1)),
            threading.Thread(target=async_ops, args=(groups[2],)),
        ]
        for th in ths:
            th.start()
    for k in range(n // 3):
        a = np.full(3, r + k, np.int64)
        dist.all_reduce(a)
        check(bool((a == ws * k + ws * (ws - 1) // 2).all()), f"all_reduce {k}: {a}")
    if r < 2:
        for th in ths:
            th.join()
    check(not errors, f"thread errors: {errors}")
    dist.barrier()
    print(json.dumps({"rank": r, "p2p_bytes": sent[0], **_state(_transport())}), flush=True)
    dist.destroy_process_group()


def mixed(rounds: str = "200") -> None:
    """Ranks 0 and 1 (the others all-reduce along) exchange, each round: rank 0 sends blocking on tag A, isends
    on tag B, sends blocking on tag A again and on tag B; rank 1 receives B first (so A's two messages wait as
    unexpected ones, or in the ring), then A, A and B, some through a posted irecv; a broadcast follows.
    Order per (peer, tag) and every value are checked; then the roles swap."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    n = int(rounds)
    keep: List[Any] = []
    for k in range(n):
        src, dst = (0, 1) if k % 2 == 0 else (1, 0)
        a_tag, b_tag = k % 4, 4 + k % 3
        sizes = [SIZES[(k + j) % len(SIZES)] for j in range(4)]
        dts = [DTYPES[(k + 3 * j) % len(DTYPES)] for j in range(4)]
        msgs = [_payload(dts[j], sizes[j], 10 * k + j) for j in range(4)]
        if r == src:
            dist.send(msgs[0], dst=dst, tag=a_tag)
            keep.append((dist.isend(msgs[1], dst=dst, tag=b_tag), msgs[1]))
            dist.send(msgs[2], dst=dst, tag=a_tag)
            dist.send(msgs[3], dst=dst, tag=b_tag)
        elif r == dst:
            outs = [np.zeros_like(m) for m in msgs]
            if k % 3 == 0:  # a receive posted before the blocking ones of the same tag
                w = dist.irecv(outs[1], src=src, tag=b_tag)
                dist.recv(outs[0], src=src, tag=a_tag)
                w.wait()
            else:
                dist.recv(outs[1], src=src, tag=b_tag)
                dist.recv(outs[0], src=src, tag=a_tag)
            dist.recv(outs[2], src=src, tag=a_tag)
            dist.recv(outs[3], src=src, tag=b_tag)
            for j in range(4):
                check(bool((outs[j] == msgs[j]).all()), f"round {k} message {j} ({dts[j]}[{sizes[j]}]): out of order")
        b = np.full(5, k if r == k % ws else -1, np.int64)
        dist.broadcast(b, src=k % ws)
        check(bool((b == k).all()), f"broadcast {k}: {b}")
    for w, _m in keep:
        w.wait()
    dist.barrier()
    print(json.dumps({"rank": r, **_state(_transport())}), flush=True)
    dist.destroy_process_group()


def asleep() -> None:
    """Rank 0 blocks 2 s in a 4-byte recv from rank 1; rank 1 then blocks 2 s in a send of three rings' worth
    to rank 0 (run with PROCGROUP_SHM_CMA=0: it streams into the ring, then hands the rest to the general wait)
    while rank 0 sleeps.  Each reports the CPU time its blocked call used."""
    dist.init_process_group()
    r = dist.get_rank()
    x = np.zeros(1, np.float32)
    big = _payload("float64", 3 * _transport()._out[1 - r].cap, 3)
    _warm(x, r)
    dist.barrier()
    out: Dict[str, Any] = {"rank": r}
    if r == 0:
        c0, t0 = time.process_time(), time.monotonic()
        dist.recv(x, src=1)
        out.update(recv_cpu=time.process_time() - c0, recv_s=time.monotonic() - t0)
        check(float(x[0]) == 42.0, f"the late message: {x}")
        time.sleep(2.0)
        y = np.zeros_like(big)
        dist.recv(y, src=1, tag=1)
        check(bool((y == big).all()), "the large message")
    elif r == 1:
        time.sleep(2.0)
        dist.send(np.full(1, 42.0, np.float32), dst=0)
        c0, t0 = time.process_time(), time.monotonic()
        dist.send(big, dst=0, tag=1)
        out.update(send_cpu=time.process_time() - c0, send_s=time.monotonic() - t0)
    dist.barrier()
    print(json.dumps({**out, **_state(_transport())}), flush=True)
    dist.destroy_process_group()


def aborted() -> None:
    """Rank 0 blocks in a recv from rank 1, which never sends; after 1 s a thread of rank 0 aborts the
    transport (as the watchdog does when a peer gives up).  Rank 0 reports what its recv raised and when."""
    dist.init_process_group()
    r = dist.get_rank()
    x = np.zeros(1, np.int64)
    _warm(x, r)
    dist.barrier()
    t = _transport()
    if r == 0:
        threading.Timer(1.0, lambda: t.abort(BrokenError("test abort of rank 0's transport"))).start()
        c0, t0 = time.process_time(), time.monotonic()
        res: Dict[str, Any] = {"err": None, "msg": ""}
        try:
            dist.recv(x, src=1)
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"err": type(e).__name__, "msg": str(e)}
        res.update(rank=r, s=time.monotonic() - t0, cpu=time.process_time() - c0, **_state(t))
        print(json.dumps(res), flush=True)
    else:
        time.sleep(3.0)
        print(json.dumps({"rank": r}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the world is aborted: leave without the collective shutdown


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
