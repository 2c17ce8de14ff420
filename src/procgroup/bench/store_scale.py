"""How fast one :class:`~procgroup.store.StoreServer` completes a rendezvous of many clients.

``python -m procgroup.bench.store_scale --clients 4096`` (also
``procgroup bench --store-clients 4096`` and ``benchmarks/store_scale.py``).

One StoreServer runs in this process (its own thread, as in the launcher).
The clients are real :class:`~procgroup.store.TCPStore` connections (TCP +
HMAC handshake each), opened by ``--procs`` worker processes with
``--threads`` threads each, so that no single client process is the
bottleneck.  Every client does what a rank does at rendezvous:

1. connect and authenticate,
2. ``set("rank/<i>", ...)`` its own key,
3. ``add("count", 1)``; the client that brings the count to N checks that
   all N keys are there (``num_keys``) and sets ``done``,
4. ``wait(["done"])``, then reads ``done``.

All connections stay open until every client has passed step 4 (as the
ranks of a job keep theirs).  The reported total is from the moment all
worker processes are released (after they started and imported) until the
last client has returned from its wait; connecting and closing are inside,
process start-up is not.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import secrets
import sys
import threading
import time
from typing import Any, Optional, Sequence

__all__ = ["run_store_scale", "main"]

RESERVE_FDS = 64


def raise_nofile(need: int) -> tuple[int, int]:
    """Raise the soft open-files limit to at least ``need`` (up to the hard limit); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft, hard


def _client_proc(port: int, secret: str, lo: int, hi: int, total: int, threads: int, go, results) -> None:
    from procgroup.store import TCPStore

    raise_nofile(hi - lo + RESERVE_FDS)
    idx = list(range(lo, hi))
    chunks = [idx[t::threads] for t in range(threads)]
    stores: list[list] = [[] for _ in range(threads)]
    errors: list[str] = []
    t1 = [0.0] * threads
    t2 = [0.0] * threads

    def body(t: int) -> None:
        try:
            for i in chunks[t]:
                s = TCPStore("127.0.0.1", port, secret=secret, timeout=120)
                stores[t].append(s)
                s.set(f"rank/{i}", str(i))
                if s.add("count", 1) == total:
                    n = s.num_keys()
                    if n != total + 1:
                        errors.append(f"the last client saw {n} keys, expected {total + 1}")
                    s.set("done", str(total))
            t1[t] = time.monotonic()
            for s in stores[t]:
                s.wait(["done"])
                if s.get("done") != str(total).encode():
                    errors.append("done holds the wrong value")
            t2[t] = time.monotonic()
        except Exception as e:  # noqa: BLE001 - reported to the parent
            errors.append(f"{type(e).__name__}: {e}")

    go.wait()
    ths = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    n_open = sum(len(s) for s in stores)
    for lst in stores:
        for s in lst:
            s.close()
    results.put({"pid": os.getpid(), "clients": n_open, "phase1_end": max(t1), "end": max(t2), "errors": errors[:5]})


def run_store_scale(clients: int = 4096, procs: Optional[int] = None, threads: int = 4, timeout: float = 120.0) -> dict:
    """Run the rendezvous once; returns {"clients", "total_s", "set_add_s", "ok", ...}."""
    from procgroup.store import StoreServer

    procs = procs or max(2, min(8, 2 * (os.cpu_count() or 1)))
    procs = max(1, min(procs, clients))
    threads = max(1, min(threads, math.ceil(clients / procs)))
    soft, hard = raise_nofile(clients + RESERVE_FDS)
    if soft != resource.RLIM_INFINITY and soft < clients + RESERVE_FDS:
        return {
            "clients": clients,
            "ok": False,
            "total_s": None,
            "error": f"the open-files limit is {soft} (hard {hard}); {clients} clients need about "
            f"{clients + RESERVE_FDS}: raise it (ulimit -n) or use fewer clients",
        }
    from ._load import BackgroundMeter

    ctx = mp.get_context("spawn")
    go = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    secret = secrets.token_hex(16)
    server = StoreServer("127.0.0.1", 0, secret=secret, backlog=max(4096, clients))
    port = server.start()
    bounds = [clients * p // procs for p in range(procs + 1)]
    ps = [
        ctx.Process(
            target=_client_proc,
            args=(port, secret, bounds[p], bounds[p + 1], clients, threads, go, results),
            daemon=True,
        )
        for p in range(procs)
    ]
    try:
        for p in ps:
            p.start()
        go.wait(timeout=60)  # every worker has started and imported procgroup
        meter = BackgroundMeter()
        t0 = time.monotonic()
        got: list[dict[str, Any]] = []
        deadline = t0 + timeout
        while len(got) < procs:
            try:
                got.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except Exception:  # queue.Empty
                break
        t_collected = time.monotonic()
    finally:
        for p in ps:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(1)
        server.close()
    background = meter.fraction()  # after the joins: the clients' CPU time is counted as ours
    errors = [e for g in got for e in g["errors"]]
    if len(got) < procs:
        errors.append(f"{procs - len(got)} client process(es) did not finish within {timeout:.0f}s")
    opened = sum(g["clients"] for g in got)
    ok = not errors and opened == clients
    return {
        "clients": clients,
        "procs": procs,
        "threads_per_proc": threads,
        "ok": ok,
        "total_s": (max(g["end"] for g in got) - t0) if got and ok else None,
        "set_add_s": (max(g["phase1_end"] for g in got) - t0) if got and ok else None,
        "collected_s": t_collected - t0,
        "opened": opened,
        "nofile_soft": soft,
        "background_cpu": background,
        "errors": errors[:10],
    }


def format_result(r: dict) -> str:
    if not r.get("ok"):
        return (
            f"store rendezvous of {r['clients']} clients FAILED: {'; '.join(r.get('errors') or [r.get('error', '?')])}"
        )
    return (
        f"store rendezvous: {r['clients']} TCPStore clients ({r['procs']} processes x {r['threads_per_proc']} threads) "
        f"against one StoreServer: all set+add done in {r['set_add_s']:.3f} s, all released from wait(done) in "
        f"{r['total_s']:.3f} s"
        + (f"  [other users' CPU load {100 * r['background_cpu']:.0f}%]" if r.get("background_cpu") is not None else "")
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="store_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4096, help="simulated clients (TCPStore connections), default 4096")
    p.add_argument("--procs", type=int, default=None, help="client processes (default 2 x CPUs, 2..8)")
    p.add_argument("--threads", type=int, default=4, help="threads per client process (default 4)")
    p.add_argument("--repeat", type=int, default=1, help="rendezvous runs; the median is reported")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the result(s) here")
    ns = p.parse_args(argv)
    if ns.clients < 1:
        p.error("--clients must be >= 1")
    runs = []
    for _ in range(max(1, ns.repeat)):
        r = run_store_scale(ns.clients, ns.procs, ns.threads, ns.timeout)
        print(format_result(r), flush=True)
        runs.append(r)
    ok = all(r["ok"] for r in runs)
    if ns.repeat > 1 and ok:
        ts = sorted(r["total_s"] for r in runs)
        print(f"median over {len(ts)} runs: {ts[len(ts) // 2]:.3f} s", flush=True)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump({"store_scale": runs}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
