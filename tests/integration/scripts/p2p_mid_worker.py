"""Workers of tests/integration/test_p2p_mid_procs.py: ``python p2p_mid_worker.py NAME [args]``.

They exercise the streamed mid-size blocking send/recv of the shm transport (``ShmTransport.send_fast``/
``recv_fast`` above FAST_MAX: the compiled put writes a record in pieces, the compiled stream copies it as it
arrives, and a stall mid-record hands the rest to the general path).  Each rank prints JSON lines; a failed
check raises (non-zero exit, traceback on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List

import numpy as np
import p2p_fast_worker as fw

import procgroup as dist
from procgroup.transport.shm import p2pfast
from procgroup.transport.shm.ring import RNDV_MIN

FAST_MAX = p2pfast.FAST_MAX
STREAM_CHUNK = getattr(p2pfast, "STREAM_CHUNK", 64 << 10)  # (getattr: these tests also run against older code)

check = fw.check
DTYPES = fw.DTYPES


def _counters() -> Dict[str, int]:
    t = dist.group.WORLD.world.transport
    return {k: getattr(t, k, -1) for k in ("fast_sends", "fast_recvs", "fast_handoffs")}


def _sizes(item: int) -> List[int]:
    """Element counts around every threshold of the mid-size path, in bytes: FAST_MAX, the stream's pieces,
    1 MiB (the old rendezvous size), 3 MiB, the largest record a 4 MiB ring takes at once, RNDV_MIN (each +- 1
    element)."""
    out = []
    for b in (
        FAST_MAX,
        STREAM_CHUNK + 1,
        2 * STREAM_CHUNK,
        3 * STREAM_CHUNK + 5,
        1 << 20,
        3 << 20,
        (4 << 20) - 32,
        RNDV_MIN,
    ):
        out += [b // item + d for d in (-1, 0, 1)]
    return sorted(set(x for x in out if x > 0))


def dtypes_mid() -> None:
    """Ranks 0 and 1 ping-pong every dtype at sizes around each threshold of the mid-size path (rank 1 echoes
    what it got plus one); the messages add up to several ring sizes, so records wrap the ring.  Other ranks
    send rank 0 a mid-size message by any-source meanwhile.  Reports the counters' steps over the messages
    above FAST_MAX and the number of those messages."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    mid = {k: 0 for k in _counters()}
    count = 0
    for dt in DTYPES:
        item = np.dtype(dt).itemsize
        for n in _sizes(item):
            c0 = _counters()
            if r == 0:
                x = (np.arange(n) % 3).astype(dt)
                dist.send(x, dst=1, tag=n % 5)
                y = np.zeros(n, dt)
                check(dist.recv(y, src=1, tag=n % 5) == 1, "echo source")
                want = x + 1 if dt != "bool" else np.ones(n, dt)
                check(bool((y == want).all()), f"{dt}[{n}] echo")
                for _ in range(ws - 2):
                    z = np.zeros(20000, dt)
                    src = dist.recv(z, tag=100)
                    check(bool((z == np.full(20000, src % 2, dt)).all()), f"{dt} any-source from {src}")
            elif r == 1:
                y = np.zeros(n, dt)
                check(dist.recv(y, src=0, tag=n % 5) == 0, "source")
                check(bool((y == (np.arange(n) % 3).astype(dt)).all()), f"{dt}[{n}] payload")
                dist.send(y + 1 if dt != "bool" else np.ones(n, dt), dst=0, tag=n % 5)
            else:
                dist.send(np.full(20000, r % 2, dt), dst=0, tag=100)
            if n * item > FAST_MAX and r < 2:
                c = _counters()
                count += 1
                for k in c:
                    mid[k] += c[k] - c0[k]
    dist.barrier()
    print(json.dumps({"rank": r, "mid_messages": count, **mid}), flush=True)
    dist.destroy_process_group()


def order_mid(rounds: str = "200") -> None:
    """p2p_fast_worker.order_stress with mid-size messages: every fourth round's message is 0-8 MiB (around
    FAST_MAX, the stream's pieces, the ring's size and the rendezvous size; blocking sends below the ring's
    size), mixed at random with isend, batches, irecv posted earlier and any-source receives on the same
    (peer, tag)."""
    per = max(1, RNDV_MIN // 8)
    fw.EXTRA = [0, 1, 8189, 8190, 9000, 20000, 65536, 100000, per - 4, 524284, per + 1, 300000]
    fw.BLOCKING_MAX = (4 << 20) - 64  # blocking sends stream through the (4 MiB) ring, never by rendezvous
    fw.order_stress(rounds)


def _report_and_leave(res: Dict[str, Any], r: int, c0: float, t0: float, mode: str) -> None:
    """Print ``res`` with this rank, the CPU and wall seconds since ``c0``/``t0`` and the counters, then leave:
    at once after a ``kill`` (the world lost a member: no collective shutdown), else through a barrier."""
    res.update(rank=r, cpu=round(time.process_time() - c0, 3), s=round(time.monotonic() - t0, 3), **_counters())
    print(json.dumps(res), flush=True)
    if mode == "kill":
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


def stalled_sender(mode: str) -> None:
    """Rank 1 starts a message twice the ring's size (isend; CMA off) and stops progressing: ``sleep`` waits
    0.4 s before it waits on the send, ``kill`` stops itself (SIGSTOP) and rank 0 SIGKILLs it 1 s later.  Rank
    0's blocking recv streams the first ring-full, sees the head stop and hands the rest to the general path:
    ``sleep`` must then complete with the right bytes; ``kill`` must raise PeerFailureError naming rank 1.
    Rank 0 reports the outcome, the counters and its CPU time meanwhile."""
    dist.init_process_group()
    r = dist.get_rank()
    t = dist.group.WORLD.world.transport
    n = 2 * t._in[1 - r].cap // 8 if r == 0 else 2 * t._out[1 - r].cap // 8
    pid = np.zeros(1, np.int64)
    if r == 1:
        pid[0] = os.getpid()
        dist.send(pid, dst=0)
        dist.barrier()
        w = dist.isend(np.arange(n, dtype=np.int64), dst=0, tag=3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.4)
        w.wait()
        dist.barrier()
        dist.destroy_process_group()
        return
    dist.recv(pid, src=1)
    dist.barrier()
    time.sleep(0.1)  # the sender has filled the ring (and stopped) by now
    if mode == "kill":
        threading.Timer(1.0, os.kill, (int(pid[0]), signal.SIGKILL)).start()
    y = np.zeros(n, np.int64)
    c0, t0 = time.process_time(), time.monotonic()
    res: Dict[str, Any] = {"err": None, "msg": ""}
    try:
        dist.recv(y, src=1, tag=3)
        res["ok"] = bool((y == np.arange(n, dtype=np.int64)).all())
    except Exception as e:  # noqa: BLE001 - reported to the test
        res.update(err=type(e).__name__, msg=str(e))
    _report_and_leave(res, r, c0, t0, mode)


def stalled_receiver(mode: str) -> None:
    """Rank 1 blocking-sends rank 0 a message ~twice the ring's size while rank 0 does not receive yet:
    ``sleep``: rank 0 receives 0.4 s later (the send's stream stalls once the ring is full and hands the rest
    to the general path, which completes once rank 0 receives); ``kill``: rank 0 SIGKILLs itself after 1 s,
    and the send must raise PeerFailureError naming rank 0.  Rank 1 reports the outcome, the counters and its
    CPU time meanwhile."""
    dist.init_process_group()
    r = dist.get_rank()
    t = dist.group.WORLD.world.transport
    cap = t._in[1 - r].cap if r == 0 else t._out[1 - r].cap
    n = min(2 * cap, RNDV_MIN) // 8 - 512  # (below the rendezvous size)
    dist.barrier()
    if r == 0:
        time.sleep(1.0 if mode == "kill" else 0.4)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        y = np.zeros(n, np.int64)
        dist.recv(y, src=1, tag=5)
        check(bool((y == np.arange(n, dtype=np.int64)).all()), "payload")
        dist.barrier()
        dist.destroy_process_group()
        return
    c0, t0 = time.process_time(), time.monotonic()
    res: Dict[str, Any] = {"err": None, "msg": ""}
    try:
        dist.send(np.arange(n, dtype=np.int64), dst=0, tag=5)
    except Exception as e:  # noqa: BLE001 - reported to the test
        res.update(err=type(e).__name__, msg=str(e))
    _report_and_leave(res, r, c0, t0, mode)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
