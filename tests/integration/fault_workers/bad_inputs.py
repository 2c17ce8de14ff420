"""Bad-input workers: ``python bad_inputs.py NAME [args]``, env:// identity set by the test.

Every scenario reports with one line per outcome::

    RESULT <rank> type=<exception type or OK> after=<seconds> msg=<message, one line>

and exits 0 (the test judges the lines).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import procgroup as dist


def report(r, e: BaseException, t0: float) -> None:
    msg = str(e).replace("\n", " | ")
    print(f"RESULT {r} type={type(e).__name__} after={time.monotonic() - t0:.3f} msg={msg}", flush=True)


def ok(r, t0: float, what: str = "") -> None:
    print(f"RESULT {r} type=OK after={time.monotonic() - t0:.3f} msg={what}", flush=True)


def mismatch(kind: str) -> None:
    """Ranks 0 and 1 make one call, the last rank a different one (dtype / element count / shape)."""
    dist.init_process_group(timeout=30)
    r, ws = dist.get_rank(), dist.get_world_size()
    odd = r == ws - 1
    dist.barrier()
    t0 = time.monotonic()
    try:
        if kind == "dtype":
            dist.all_reduce(np.ones(4, np.float64 if odd else np.float32))
        elif kind == "count":
            dist.all_reduce(np.ones(8 if odd else 4, np.int64))
        elif kind == "shape":
            inp = np.ones((3, 2) if odd else (2, 2), np.float32)
            dist.all_gather_into_tensor(np.zeros((ws,) + inp.shape, np.float32), inp)
        else:
            raise SystemExit(f"unknown kind {kind}")
        ok(r, t0)
    except dist.ProcGroupError as e:
        report(r, e, t0)


def init_only() -> None:
    """Init (deadline from TEST_INIT_TIMEOUT); report the error or OK, then leave."""
    t0 = time.monotonic()
    try:
        dist.init_process_group(timeout=float(os.environ.get("TEST_INIT_TIMEOUT", "20")))
    except dist.ProcGroupError as e:
        report(os.environ.get("RANK"), e, t0)
        return
    ok(dist.get_rank(), t0, "joined")
    dist.destroy_process_group()


def _wait_file(path: str, timeout: float = 60.0) -> None:
    t = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t > timeout:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(0.02)


def garbage() -> None:
    """A job that the test feeds garbage while it runs (see test_bad_inputs.test_garbage_*).

    Rank 2's TCP transport listener is only open while the group forms, so rank 1 holds back its dial to
    rank 2 until the test has sent its garbage there (``$GO_DIR/dial``).  Then the group forms, runs a
    collective, and waits (``$GO_DIR/run``) while the test sends garbage to the store port; then it runs
    collectives and store-backed calls again.
    """
    from procgroup.transport import tcp

    go = os.environ["GO_DIR"]
    rank = int(os.environ["RANK"])
    orig_listen, orig_dial = tcp.TcpTransport._listen, tcp.TcpTransport._dial

    def listen(self, advertise):  # noqa: ANN001
        ls = orig_listen(self, advertise)
        print(f"LISTEN {self.rank} {ls.getsockname()[1]}", flush=True)
        return ls

    def dial(self, store, prefix, peer):  # noqa: ANN001
        if self.rank == 1 and peer == 2:
            _wait_file(os.path.join(go, "dial"))
        return orig_dial(self, store, prefix, peer)

    tcp.TcpTransport._listen, tcp.TcpTransport._dial = listen, dial
    t0 = time.monotonic()
    dist.init_process_group(timeout=60)
    ws = dist.get_world_size()
    x = np.full(1000, rank + 1.0)
    dist.all_reduce(x)
    assert x[0] == ws * (ws + 1) / 2
    print(f"FORMED {rank}", flush=True)
    _wait_file(os.path.join(go, "run"))
    try:
        for _ in range(5):
            y = np.full(1 << 16, float(rank))
            dist.all_reduce(y)
            assert y[-1] == ws * (ws - 1) / 2
        sub = dist.new_group([0, 2])  # goes through the store
        objs = [None] * ws
        dist.all_gather_object(objs, {"rank": rank})
        assert [o["rank"] for o in objs] == list(range(ws))
        if rank in (0, 2):
            z = np.ones(3)
            dist.all_reduce(z, group=sub)
            assert z[0] == 2
        dist.barrier()
        ok(rank, t0, "collectives after garbage")
    except dist.ProcGroupError as e:
        report(rank, e, t0)
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
