"""What is measured and how, shared by every system's worker (procgroup, gloo, MPI).

Pure numpy: no procgroup collectives, torch or mpi4py here, so that the three
workers run exactly the same cases, fill the same data, apply the same
closed-form checks and time the same loop.  A worker only supplies an
:class:`Adapter` (how to call each op of its system on numpy arrays, a
barrier, and a gather of float64 rows to rank 0).

Conventions (those of nccl-tests):

* ``nbytes`` is the per-rank buffer size; for ``all_gather`` the *output*
  size, for ``reduce_scatter`` the *input* size, for ``all_to_all`` the send
  size.  Data is float32.  Ops that split a buffer into one chunk per rank
  round the element count down to a multiple of the world size; a size too
  small for one element per rank is skipped.
* ``algbw = bytes / time``; ``busbw = algbw * factor`` with factor
  ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter and
  all_to_all, ``1`` for broadcast, reduce and send/recv.
* ``sendrecv`` is a ping-pong between ranks 0 and 1 (the other ranks idle);
  its time is one way, half a round trip (the OSU convention).
* One iteration's time is the maximum over the participating ranks of that
  iteration's duration on each rank; iterations run back to back after a
  barrier-synchronised warm-up.  median, p90, mean and min are over
  iterations.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

__all__ = [
    "OPS",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_MAX_BYTES",
    "Case",
    "Layout",
    "Adapter",
    "busbw_factor",
    "parse_size",
    "fmt_size",
    "sizes_between",
    "auto_iters",
    "layout",
    "plan",
    "run_cases",
]

#: every op, in report order
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier", "sendrecv")
DEFAULT_MIN_BYTES = 4
DEFAULT_MAX_BYTES = 64 << 20
ITEMSIZE = 4  # float32
DTYPE = np.float32
#: seconds after which a case's loop stops early in auto mode (at least MIN_AUTO_ITERS iterations run)
CASE_TIME_CAP = 1.5
MIN_AUTO_ITERS = 5
#: timed iterations of the largest sizes in auto mode (fewer only where CASE_TIME_CAP stops a slow case)
MIN_LARGE_ITERS = 20


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"4"``, ``"1K"``, ``"64M"``, ``"64MiB"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 4, 1K, 64M")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def fmt_size(n: int) -> str:
    for unit, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v}{unit}"
    return f"{n}"


def sizes_between(lo: int, hi: int) -> list[int]:
    """4, 16, 64, ... (powers of 4 from 4 B) within [lo, hi]."""
    out, s = [], 4
    while s <= hi:
        if s >= lo:
            out.append(s)
        s *= 4
    return out


def auto_iters(op: str, nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iterations for a case in ``--iters auto`` mode.

    Many iterations for small messages (where a sample is microseconds and
    the distribution matters), fewer for large ones, but never fewer than
    :data:`MIN_LARGE_ITERS`: a median of 8 or 12 samples moved a 16 MiB
    send/recv's ratio to Open MPI between 1.02 and 1.50 on a noisy 2-CPU
    machine (100 samples: 1.02-1.10).  :data:`CASE_TIME_CAP` additionally
    stops a slow case early.
    """
    if op == "barrier":
        return 20, 500
    if nbytes <= 64 << 10:
        return 10, 200
    if nbytes <= 256 << 10:
        return 5, 100
    if nbytes <= 1 << 20:
        return 3, 50
    if nbytes <= 4 << 20:
        return 2, 40
    if nbytes <= 16 << 20:
        return 2, 30
    return 2, MIN_LARGE_ITERS


@dataclass(frozen=True)
class Layout:
    """Element counts of one case: ``count`` per chunk, ``in_count``/``out_count`` per buffer."""

    in_count: int
    out_count: int
    chunk: int

    @property
    def nbytes(self) -> int:
        """The reported size: nccl-tests' per-rank buffer (output for all_gather)."""
        return max(self.in_count, self.out_count) * ITEMSIZE


def layout(op: str, nbytes: int, n: int) -> Optional[Layout]:
    """The buffers of ``op`` at nominal size ``nbytes`` on ``n`` ranks, or None when too small."""
    count = nbytes // ITEMSIZE
    if op == "barrier":
        return Layout(0, 0, 0)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        chunk = count // n
        if chunk == 0:
            return None
        if op == "all_gather":
            return Layout(chunk, chunk * n, chunk)
        if op == "reduce_scatter":
            return Layout(chunk * n, chunk, chunk)
        return Layout(chunk * n, chunk * n, chunk)
    if count == 0:
        return None
    return Layout(count, count, count)


@dataclass(frozen=True)
class Case:
    op: str
    nominal: int  # the size asked for
    lay: Optional[Layout]  # None: skipped (too small)
    warmup: int
    iters: int
    auto: bool  # stop early after CASE_TIME_CAP seconds


def plan(ops: Sequence[str], sizes: Sequence[int], n: int, iters: Optional[int]) -> list[Case]:
    """The ordered list of cases; identical on every rank and every system."""
    out = []
    for op in ops:
        for s in [0] if op == "barrier" else sizes:
            w, it = auto_iters(op, s)
            if iters is not None:
                w, it = min(w, max(1, iters // 5)), iters
            lay = layout(op, s, n)
            if op == "sendrecv" and n < 2:
                lay = None
            out.append(Case(op, s, lay, w, it, iters is None))
    return out


# ----------------------------------------------------------------------------- data and checks


def _saw(period: int, count: int, scale: int = 1, offset: int = 0) -> np.ndarray:
    """float32 ``[(i % period) * scale + offset for i in range(count)]``, built by tiling (cheap at 64 MiB)."""
    base = np.arange(period, dtype=DTYPE) * scale + offset
    if count <= period:
        return base[:count].copy()
    block = np.tile(base, min(-(-count // period), max(1, (1 << 16) // period)))  # ~64K elements
    return np.resize(block, count)


def _chunks(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, DTYPE)


# Patterns: small integers, exact in float32 for any world size used here.  Each chunk of a
# chunked op carries its source and destination, so a chunk delivered to the wrong place fails.


def fill(op: str, lay: Layout, rank: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Fresh (input, output) arrays holding the check pattern.

    In-place ops (all_reduce, broadcast, reduce, sendrecv) return the same array twice.
    """
    c = lay.chunk
    if op in ("all_reduce", "reduce"):
        a = _saw(7, lay.in_count, offset=rank + 1)  # rank + 1 + i % 7
        return a, a
    if op in ("broadcast", "sendrecv"):
        period = 251 if op == "broadcast" else 253
        a = _saw(period, lay.in_count, offset=1) if rank == 0 else np.full(lay.in_count, -1, DTYPE)
        return a, a
    if op == "all_gather":
        return _saw(997, c, offset=1000 * rank), np.full(lay.out_count, -1, DTYPE)
    if op == "reduce_scatter":
        # chunk d (for rank d): rank + 1 + 2 d + i % 5
        return _chunks([_saw(5, c, offset=rank + 1 + 2 * d) for d in range(n)]), np.full(lay.out_count, -1, DTYPE)
    if op == "all_to_all":
        # chunk d (for rank d): 8 (rank n + d) + i % 8
        return _chunks([_saw(8, c, offset=8 * (rank * n + d)) for d in range(n)]), np.full(lay.out_count, -1, DTYPE)
    raise ValueError(op)


def expected(op: str, lay: Layout, rank: int, n: int) -> Optional[np.ndarray]:
    """The closed form of this rank's result buffer after one call on :func:`fill`'s data (None: nothing to check)."""
    c = lay.chunk
    tri = n * (n + 1) // 2  # sum of rank + 1 over the ranks
    if op == "all_reduce" or (op == "reduce" and rank == 0):
        return _saw(7, lay.in_count, scale=n, offset=tri)
    if op == "reduce":
        return None  # non-root buffers are scratch in torch's semantics
    if op in ("broadcast", "sendrecv"):
        if op == "sendrecv" and rank not in (0, 1):
            return None
        return _saw(251 if op == "broadcast" else 253, lay.in_count, offset=1)
    if op == "all_gather":
        return _chunks([_saw(997, c, offset=1000 * s) for s in range(n)])
    if op == "reduce_scatter":
        return _saw(5, c, scale=n, offset=tri + 2 * rank * n)
    if op == "all_to_all":
        return _chunks([_saw(8, c, offset=8 * (s * n + rank)) for s in range(n)])
    raise ValueError(op)


def check(got: np.ndarray, want: Optional[np.ndarray], what: str) -> Optional[str]:
    """None when equal, else a message naming the first wrong element."""
    if want is None:
        return None
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if np.array_equal(got, want):
        return None
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        return f"{what}: {bad.size} of {want.size} elements wrong, first at [{i}]: {got[i]!r}, expected {want[i]!r}"
    return None


# ----------------------------------------------------------------------------- the loop


class Adapter:
    """One system's way to run the ops; subclass per worker."""

    rank: int
    size: int
    name: str

    def barrier(self) -> None:
        raise NotImplementedError

    def gather_rows(self, row: np.ndarray) -> Optional[np.ndarray]:
        """Gather equal-length float64 rows to rank 0: an (n, len) matrix there, None elsewhere."""
        raise NotImplementedError

    def bcast_int(self, value: int) -> int:
        """Rank 0's value on every rank."""
        raise NotImplementedError

    def op(self, op: str, inp: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        """A no-argument callable doing one ``op`` on these buffers (root 0; ping-pong 0 <-> 1)."""
        raise NotImplementedError


class TorchStyleAdapter(Adapter):
    """An Adapter over a torch.distributed-shaped module ``dist`` (procgroup itself, or torch's).

    ``wrap`` turns a numpy buffer into what ``dist`` takes, sharing its memory (identity for procgroup,
    ``torch.from_numpy`` for torch), so results land in the numpy buffers the checks read.
    """

    def __init__(self, name: str, dist: Any, wrap: Callable[[np.ndarray], Any] = lambda a: a) -> None:
        self.name, self.dist, self.wrap = name, dist, wrap
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._one = np.zeros(1, dtype=np.int64)
        self._one_w = wrap(self._one)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather_rows(self, row: np.ndarray) -> Optional[np.ndarray]:
        row = np.ascontiguousarray(row, dtype=np.float64)
        if self.rank == 0:
            out = [np.empty_like(row) for _ in range(self.size)]
            self.dist.gather(self.wrap(row), [self.wrap(o) for o in out], dst=0)
            return np.stack(out)
        self.dist.gather(self.wrap(row), None, dst=0)
        return None

    def bcast_int(self, value: int) -> int:
        self._one[0] = value
        self.dist.broadcast(self._one_w, src=0)
        return int(self._one[0])

    def op(self, op: str, inp: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        d, r = self.dist, self.rank
        ti, to = self.wrap(inp), self.wrap(out)
        if op == "all_reduce":
            return lambda: d.all_reduce(ti)
        if op == "broadcast":
            return lambda: d.broadcast(ti, src=0)
        if op == "reduce":
            return lambda: d.reduce(ti, dst=0)
        if op == "all_gather":
            return lambda: d.all_gather_into_tensor(to, ti)
        if op == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(to, ti)
        if op == "all_to_all":
            return lambda: d.all_to_all_single(to, ti)
        if op == "sendrecv":
            if r == 0:

                def ping() -> None:
                    d.send(ti, dst=1)
                    d.recv(ti, src=1)

                return ping
            if r == 1:

                def pong() -> None:
                    d.recv(ti, src=0)
                    d.send(ti, dst=0)

                return pong
            return lambda: None
        raise ValueError(f"unknown op {op!r}")


def _barrier_check(a: Adapter) -> Optional[str]:
    """A barrier must not let anyone out before the last rank came in (ranks enter staggered)."""
    a.barrier()
    time.sleep(0.002 * a.rank)
    t_in = time.monotonic()
    a.barrier()
    t_out = time.monotonic()
    m = a.gather_rows(np.array([t_in, t_out], dtype=np.float64))
    if m is not None:
        last_in, first_out = float(m[:, 0].max()), float(m[:, 1].min())
        if first_out < last_in:
            return f"barrier released a rank {1e6 * (last_in - first_out):.0f} us before the last rank entered"
    return None


def stats(times: np.ndarray) -> dict:
    """Summary (seconds) of per-iteration times."""
    return {
        "median_s": float(np.median(times)),
        "p90_s": float(np.percentile(times, 90)),
        "mean_s": float(np.mean(times)),
        "min_s": float(np.min(times)),
        "max_s": float(np.max(times)),
    }


def run_case(a: Adapter, case: Case) -> Optional[dict]:
    """Run one case on every rank; rank 0 returns its record (None elsewhere)."""
    n, rank = a.size, a.rank
    lay = case.lay
    rec: dict = {"op": case.op, "nominal_bytes": case.nominal}
    if lay is None:
        if rank == 0:
            rec["skipped"] = "smaller than one float32 element per rank" if case.op != "sendrecv" else "needs 2 ranks"
            return rec
        return None
    rec["bytes"] = lay.nbytes
    err: Optional[str] = None
    participates = case.op != "sendrecv" or rank in (0, 1)

    # 1. one call on the check pattern, compared with the closed form
    want: Optional[np.ndarray] = None
    if case.op == "barrier":
        err = _barrier_check(a)
        inp = out = np.zeros(0, DTYPE)
    else:
        inp, out = fill(case.op, lay, rank, n)
        try:
            fn = a.op(case.op, inp, out)
            fn()
            want = expected(case.op, lay, rank, n)
            err = check(out, want, f"{case.op} rank {rank}")
        except Exception as e:  # noqa: BLE001 - reported in the table; every rank raises alike (unsupported op)
            err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            fn = None
    # agree on the verdict before timing a broken op
    flags = a.gather_rows(np.array([0.0 if err is None else 1.0], dtype=np.float64))
    bad = a.bcast_int(int(flags.sum()) if flags is not None else 0)
    if bad:
        if rank == 0:
            rec["error"] = err or "the result check failed on another rank"
            return rec
        return None
    if case.op == "barrier":
        fn = a.barrier
    elif case.op in ("all_reduce", "reduce"):
        # the in-place result would grow by a factor n per call: time on zeros (same cost for a sum)
        inp[...] = 0
    assert fn is not None

    # 2. warm-up, synchronised (timed: rank 0's median warm-up iteration sizes the slow cases)
    a.barrier()
    warm = np.zeros(max(1, case.warmup))
    for k in range(case.warmup):
        t0 = time.perf_counter()
        if participates:
            fn()
        warm[k] = time.perf_counter() - t0
    iters = case.iters
    if case.auto:
        cap = int(CASE_TIME_CAP / max(float(np.median(warm)), 1e-9))
        iters = a.bcast_int(max(MIN_AUTO_ITERS, min(iters, cap)))  # also a synchronisation
    a.barrier()

    # 3. timed iterations, back to back
    times = np.zeros(iters, dtype=np.float64)
    if participates:
        perf = time.perf_counter
        t = perf()
        for k in range(iters):
            fn()
            t2 = perf()
            times[k] = t2 - t
            t = t2
    # 4. the idempotent ops must still hold the right result after the loop
    if err is None and case.op in ("broadcast", "all_gather", "reduce_scatter", "all_to_all", "sendrecv"):
        err = check(out, want, f"{case.op} rank {rank} after the timed loop")
    row = np.concatenate([[0.0 if err is None else 1.0, 1.0 if participates else 0.0], times])
    m = a.gather_rows(row)
    if rank != 0:
        return None
    assert m is not None
    if m[:, 0].any():
        rec["error"] = (
            err or f"the result check failed after the timed loop on rank(s) {np.flatnonzero(m[:, 0]).tolist()}"
        )
        return rec
    part = m[m[:, 1] > 0, 2:]
    per_iter = part.max(axis=0)
    if case.op == "sendrecv":
        per_iter = per_iter / 2.0  # one way
    st = stats(per_iter)
    med = st["median_s"]
    rec.update(st)
    rec["iters"] = iters
    rec["warmup"] = case.warmup
    rec["algbw_GBps"] = (lay.nbytes / med / 1e9) if lay.nbytes and med > 0 else 0.0
    rec["busbw_GBps"] = rec["algbw_GBps"] * busbw_factor(case.op, n)
    rec["checked"] = True
    return rec


def run_cases(a: Adapter, cases: Sequence[Case]) -> Iterator[dict]:
    """Run every case in order; yields rank 0's records (nothing elsewhere)."""
    for case in cases:
        rec = run_case(a, case)
        if rec is not None:
            yield rec
