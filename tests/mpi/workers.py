"""Worker programs of the mpi backend's tests: ``mpirun -np N python -m tests.mpi.workers NAME [args]``.

The cpu backend's reference workers (``tests/integration/workers.py``: every collective x every root x
dtypes x sizes 0, 1, 7, 1000 against closed forms, 64 MiB, any-source p2p, objects, subgroups) run here
unchanged, with ``init_process_group()`` defaulting to backend="mpi".  The extra cases cover what MPI lacks
(AVG, bfloat16, float16, bool, NaN under MIN/MAX), compared with the cpu backend's own reduction kernels.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import procgroup as dist
from procgroup.ops import ReduceOp, bfloat16_to_float32, float32_to_bfloat16, reducer

from ..integration import workers as ref

_init = dist.init_process_group


def _init_mpi(backend=None, *args, **kwargs):
    """init_process_group with backend="mpi" unless another one is named."""
    return _init("mpi" if backend is None else backend, *args, **kwargs)


dist.init_process_group = _init_mpi  # the reference workers call dist.init_process_group()


def _expected(op: ReduceOp, parts: list, dtype) -> np.ndarray:
    """What the cpu backend computes: its kernel applied rank by rank, AVG divided once."""
    acc = parts[0].copy()
    k = reducer(op, dtype)
    for p in parts[1:]:
        k(acc, p)
    if op is ReduceOp.AVG:
        if dtype == "bfloat16":
            acc = float32_to_bfloat16(bfloat16_to_float32(acc) / np.float32(len(parts)))
        else:
            acc = (acc / len(parts)).astype(acc.dtype)
    return acc


def _contrib(r: int, n: int, dtype):
    base = (r + 1) * (np.arange(n) % 5 + 1)
    if dtype == "bfloat16":
        return float32_to_bfloat16(base.astype(np.float32))
    if dtype == "bool":
        return (base + r) % 3 == 0
    return base.astype(dtype)


def _tensor(a: np.ndarray, dtype):
    """A copy of ``a``; for bfloat16 a torch bfloat16 tensor holding the bits (procgroup sees "bfloat16")."""
    if dtype != "bfloat16":
        return a.copy()
    import torch

    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)


def _bits(x, dtype) -> np.ndarray:
    return x.view(__import__("torch").int16).numpy().view(np.uint16) if dtype == "bfloat16" else x


def extras() -> None:
    """AVG, PRODUCT, bool, float16, bfloat16 and NaN under MIN/MAX, in the world and in a subgroup."""
    dist.init_process_group()
    r, ws = dist.get_rank(), dist.get_world_size()
    count = 0
    cases = [
        ("float32", ReduceOp.AVG),
        ("float64", ReduceOp.AVG),
        ("float16", ReduceOp.AVG),
        ("float16", ReduceOp.SUM),
        ("bfloat16", ReduceOp.SUM),
        ("bfloat16", ReduceOp.AVG),
        ("bfloat16", ReduceOp.MAX),
        ("int32", ReduceOp.PRODUCT),
        ("int64", ReduceOp.BAND),
        ("uint8", ReduceOp.BOR),
        ("bool", ReduceOp.SUM),
        ("bool", ReduceOp.MIN),
        ("complex64", ReduceOp.AVG),
        ("float32", ReduceOp.MAX),
    ]
    groups = [None]
    if ws > 2:
        groups.append(dist.new_group(list(range(1, ws))))
    for grp in groups:
        members = list(range(ws)) if grp is None else list(range(1, ws))
        if r not in members:
            continue
        for dtype, op in cases:
            for n in (0, 1, 7, 1000):
                parts = [_contrib(q, n, dtype) for q in members]
                if dtype == "float32" and op is ReduceOp.MAX and n:
                    parts[-1][0] = np.nan  # numpy (and the cpu backend) propagate NaN
                x = _tensor(parts[members.index(r)], dtype)
                dist.all_reduce(x, op=op, group=grp)
                want = _expected(op, parts, dtype)
                got = _bits(x, dtype)
                ref.check(
                    np.array_equal(got, want, equal_nan=True), f"all_reduce {op.name} {dtype} n={n}: {got} != {want}"
                )
                if dtype not in ("bfloat16", "bool"):
                    y = parts[members.index(r)].copy()
                    dist.reduce(y, dst=members[-1], op=op, group=grp)
                    if r == members[-1]:
                        ref.check(np.array_equal(y, want, equal_nan=True), f"reduce {op.name} {dtype} n={n}")
                    out = np.zeros(n, parts[0].dtype)
                    inp = [_contrib(q, n * len(members), dtype) for q in members]
                    want_rs = _expected(op, inp, dtype)
                    dist.reduce_scatter_tensor(out, inp[members.index(r)].copy(), op=op, group=grp)
                    i = members.index(r)
                    ref.check(
                        np.array_equal(out, want_rs[i * n : (i + 1) * n], equal_nan=True),
                        f"reduce_scatter {op.name} {dtype} n={n}",
                    )
                count += 1
    # torch-style p2p in a subgroup and with tags beyond MPI's tag space (the transport's path)
    if ws >= 2:
        for tag in (0, 5, (1 << 39) + 3):
            if r == 0:
                dist.send(np.full(4, tag % 1000, np.int64), dst=1, tag=tag)
            elif r == 1:
                z = np.zeros(4, np.int64)
                src = dist.recv(z, tag=tag)
                ref.check(src == 0 and np.all(z == tag % 1000), f"p2p tag={tag}: {src} {z}")
        count += 1
    dist.barrier()
    print(f"rank {r}: {count} extra checks passed", flush=True)
    dist.destroy_process_group()


def kill_mid(victim: str = "1") -> None:
    """Every rank loops over 1 MiB all_reduces; the victim SIGKILLs itself in the middle of one.

    Survivors must raise naming the victim; each prints 'survivor R: <seconds> <error>' and exits 7.
    """
    dist.init_process_group(timeout=20)
    r = dist.get_rank()
    v = int(victim)
    x = np.ones(1 << 18, np.float32)
    for _ in range(5):
        dist.all_reduce(x)
    t0 = time.monotonic()
    try:
        i = 0
        while True:
            if r == v and i == 3:
                w = dist.all_reduce(x, async_op=True)  # the victim dies with the collective posted
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
                w.wait()
            t0 = time.monotonic()
            dist.all_reduce(x)
            i += 1
    except dist.ProcGroupError as e:
        print(f"survivor {r}: {time.monotonic() - t0:.2f}s {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


def raise_mid(victim: str = "1") -> None:
    """The victim raises an unhandled exception between collectives; the others must not hang."""
    dist.init_process_group(timeout=60)
    r = dist.get_rank()
    x = np.ones(16, np.float32)
    dist.all_reduce(x)
    if r == int(victim):
        raise RuntimeError("the victim's own bug")
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
    except dist.ProcGroupError as e:
        print(f"survivor {r}: {time.monotonic() - t0:.2f}s {type(e).__name__}: {e}", flush=True)
        sys.exit(7)


if __name__ == "__main__":
    # arguments starting with "pgtest-" are the test's tag (it finds leftover processes by it)
    argv = [a for a in sys.argv[1:] if not a.startswith("pgtest-")]
    fn = globals().get(argv[0]) or getattr(ref, argv[0])
    fn(*argv[1:])
