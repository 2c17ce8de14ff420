"""The Python cost of a small collective above the arena exchange, in one process (no peers, no noise
from their scheduling): a group of 2 ranks whose arena's exchange returns at once.

    PYTHONPATH=src python benchmarks/overhead_cpu.py

Prints per-call microseconds (CPU time of this thread, best of 7 runs of 20000 calls: robust to other
load) of each public op at 4 B, and of the layers below dist.all_reduce.  What a real call costs on top
is the exchange itself (the shm arena).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from _cputime import print_layers  # benchmarks/_cputime.py (this script's directory is on sys.path)

import procgroup as dist
from procgroup import algorithms as alg
from procgroup.ops import ReduceOp, reducer
from procgroup.process_group import ProcessGroup, World
from procgroup.transport.base import Arena, Request, Status


class _InstantArena(Arena):
    def __init__(self) -> None:
        self.members = [0, 1]
        self.index = 0
        self.max_bytes = 32 * 1024
        self._slot = memoryview(bytearray(self.max_bytes))

    def exchange(self, data: Optional[Any], check: int, deadline: Any) -> Sequence[memoryview]:
        if data is not None and data.nbytes:
            self._slot[: data.nbytes] = data
        return [self._slot, self._slot]


class _Done(Request):
    def __init__(self, st: Status) -> None:
        self.st = st

    def test(self) -> bool:
        return True

    def wait(self, deadline: Any = None) -> Status:
        return self.st


class _Transport:
    def __init__(self) -> None:
        self.a = _InstantArena()

    def isend(self, peer: int, tag: int, buf: Any) -> Request:
        return _Done(Status(peer, buf.nbytes))

    def irecv(self, peer: int, tag: int, out: Any) -> Request:
        return _Done(Status(1, out.nbytes))

    def arena(self, key: int, members: Sequence[int]) -> Arena:
        return self.a


def main() -> None:
    world = World(rank=0, size=2, transport=_Transport(), hosts=["h", "h"])  # type: ignore[arg-type]
    g = ProcessGroup(world, [0, 1], 1, "bench")
    x = np.zeros(1, np.float32)
    y = np.ones(2, np.float32)
    kern = reducer(ReduceOp.SUM, x.dtype)
    layers = [
        ("arena.exchange (stub)", lambda: g.arena().exchange(memoryview(x).cast("B"), 7, None)),
        (
            "ProcessGroup.run(alg)",
            lambda: g.run(
                "all_reduce", lambda c: alg.all_reduce(c, x, kern), signature=("all_reduce", "float32", 1, "SUM")
            ),
        ),
        ("dist.all_reduce", lambda: dist.all_reduce(x, group=g)),
        ("dist.broadcast", lambda: dist.broadcast(x, 0, group=g)),
        ("dist.reduce", lambda: dist.reduce(x, 0, group=g)),
        ("dist.barrier", lambda: dist.barrier(group=g)),
        ("dist.all_gather_into_tensor", lambda: dist.all_gather_into_tensor(y, x, group=g)),
        ("dist.send (stub transport)", lambda: dist.send(x, 1, group=g)),
        ("dist.recv (stub transport)", lambda: dist.recv(x, 1, group=g)),
    ]
    print_layers(layers)


if __name__ == "__main__":
    main()
