"""Small deterministic failure scenarios: ``python scenarios.py NAME``, env:// identity from the test.

Each prints ``RESULT <rank> <key>=<value> ...`` lines that the test parses.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import procgroup as dist


def _detected(r: int, e: BaseException, t0: float) -> None:
    msg = str(e).replace("\n", " | ")
    print(
        f"RESULT {r} after={time.monotonic() - t0:.3f} peer={getattr(e, 'peer', None)} "
        f"type={type(e).__name__} msg={msg}",
        flush=True,
    )


def store_host_dies() -> None:
    """Rank 0 (the store's host) dies; rank 2 waits on rank 0, rank 1 waits only on rank 2 (a subgroup collective).

    Rank 2 sees rank 0 die and leaves; rank 1 then sees rank 2 leave.  Every survivor should name rank 0.
    """
    dist.init_process_group(timeout=10)
    r = dist.get_rank()
    pair = dist.new_group([1, 2])
    dist.barrier()
    t0 = time.monotonic()
    if r == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if r == 2:
            dist.recv(np.zeros(4), src=0)
        else:
            dist.all_reduce(np.ones(4), group=pair)
    except dist.ProcGroupError as e:
        _detected(r, e, t0)
        sys.exit(7)


def p2p_chain() -> None:
    """Rank 3 dies; rank 2 waits in recv from 3, rank 1 in recv from 2, rank 0 in recv from 1 (point-to-point only).

    Rank 0 hosts the store, which stays up: every survivor should name rank 3, the rank that died.
    """
    dist.init_process_group(timeout=10)
    r = dist.get_rank()
    dist.barrier()
    t0 = time.monotonic()
    if r == 3:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.recv(np.zeros(4), src=r + 1)
    except dist.ProcGroupError as e:
        _detected(r, e, t0)
        sys.exit(7)


def host_exit_after_failure() -> None:
    """Rank 1 dies; rank 0 (store host) gets the PeerFailureError, then times destroy_process_group().

    Nobody else is connected to rank 0's store any more, so leaving should not take seconds.
    """
    dist.init_process_group(timeout=10)
    r = dist.get_rank()
    dist.barrier()
    t0 = time.monotonic()
    if r == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(np.ones(4))
    except dist.PeerFailureError as e:
        _detected(r, e, t0)
    t1 = time.monotonic()
    dist.destroy_process_group()
    print(f"RESULT {r} destroy={time.monotonic() - t1:.3f}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
