"""Collective algorithms over the in-memory transport, ranks as threads.

Each test runs one world of p threads; every rank loops over many cases
(dtype x count x op x root), building a fresh ``Comm`` with a fresh tag per
call but sharing its scratch pool across calls, as the API layer does.
Expected values are closed forms of the per-rank inputs (or, for bool and
BAND, a numpy reduction of the stacked inputs).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import pytest

from procgroup.algorithms import allreduce as AR
from procgroup.algorithms import alltoall as A2A
from procgroup.algorithms import bcast as BC
from procgroup.algorithms import direct as DIR
from procgroup.algorithms import dissemination as BAR
from procgroup.algorithms import gathering as GA
from procgroup.algorithms import redscat as RSC
from procgroup.algorithms import reduction as RED
from procgroup.algorithms import select
from procgroup.algorithms.comm import Comm, ScratchPool
from procgroup.deadline import Deadline
from procgroup.errors import ConfigError, PeerFailureError
from procgroup.ops import ReduceOp, bfloat16_to_float32, finalize, float32_to_bfloat16, reducer
from procgroup.transport.memory import MemoryHub

SIZES = list(range(1, 9))
COUNTS = [0, 1, 7, 1000]
DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64", "bool", "bfloat16"]
INTS = ("int8", "uint8", "int32", "int64")
FLOATS = ("float16", "float32", "float64", "bfloat16")
OPS = list(ReduceOp)


# ----------------------------------------------------------------------------- harness
def run_ranks(
    p: int,
    fn: Callable[[int, Callable[..., Comm]], Any],
    hosts: Optional[Sequence[str]] = None,
    timeout: float = 20.0,
    wrap: Optional[Callable[[Any], Any]] = None,
    host_arenas: bool = False,
) -> List[Any]:
    """Run ``fn(rank, make_comm)`` on p threads; ``make_comm(tag)`` builds this rank's Comm for one call.

    ``host_arenas``: each Comm carries the shared slots of this rank's host (``Comm.host_arena``, made once per
    rank), as a group spanning hosts does.

    Re-raises the first exception of any rank (the root cause, not the
    PeerFailureErrors it triggers in the other ranks).
    """
    hub = MemoryHub(p)
    results: List[Any] = [None] * p
    errors: List[tuple] = []

    def target(r: int) -> None:
        t = hub.transport(r)
        ha = None
        if host_arenas and hosts is not None:
            ha = t.arena(0, [i for i, h in enumerate(hosts) if h == hosts[r]])
        if wrap is not None:
            t = wrap(t)
        pool = ScratchPool()

        def make(tag: int, deadline: Optional[Deadline] = None, scratch: Optional[ScratchPool] = None) -> Comm:
            return Comm(
                t,
                ranks=list(range(p)),
                rank=r,
                tag=tag,
                deadline=deadline or Deadline.after(timeout),
                hosts=hosts,
                scratch=scratch or pool,
                host_arena=ha,
            )

        try:
            results[r] = fn(r, make)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append((r, e))
            hub.fail(r, f"test thread raised {type(e).__name__}")

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(p)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 10)
    if any(th.is_alive() for th in threads):
        raise AssertionError(f"ranks {[r for r, th in enumerate(threads) if th.is_alive()]} hung")
    if errors:
        primary = [e for e in errors if not isinstance(e[1], PeerFailureError)] or errors
        r, e = primary[0]
        raise AssertionError(f"rank {r} failed: {type(e).__name__}: {e}") from e
    return results


def storage(dt: str) -> np.dtype:
    return np.dtype(np.uint16) if dt == "bfloat16" else np.dtype(dt)


def encode(dt: str, v: np.ndarray) -> np.ndarray:
    """Values (float64/complex128/int64/bool) as a buffer of dt (ints wrap, bfloat16 rounds)."""
    if dt == "bfloat16":
        return float32_to_bfloat16(np.asarray(v, dtype=np.float32))
    if dt == "bool":
        return np.asarray(v).astype(bool)
    if dt in INTS:
        return np.asarray(v).astype(np.int64).astype(dt)
    return np.asarray(v).astype(dt)


def decode(dt: str, buf: np.ndarray) -> np.ndarray:
    if dt == "bfloat16":
        return bfloat16_to_float32(buf).astype(np.float64)
    return buf


def valid(op: ReduceOp, dt: str) -> bool:
    if op is ReduceOp.AVG:
        return dt in FLOATS or dt == "complex64"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return dt in INTS or dt == "bool"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return dt != "complex64"
    return True


# ----------------------------------------------------------------------------- reduction data
def contrib(dt: str, op: ReduceOp, r: int, n: int) -> np.ndarray:
    """Rank r's input for a reduction of op."""
    i = np.arange(n)
    if dt == "bool":
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR, ReduceOp.BXOR):
            return (i + r) % 3 == 0
        return (i + r) % 4 != 0
    if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX):
        v = (r + 1) * (i % 5) + r  # increasing in r
        if dt == "complex64":
            v = v + 1j * (r - i % 3)
    elif op is ReduceOp.PRODUCT:
        v = 1 + (i + r) % 2
    elif op is ReduceOp.BAND:
        v = 0x7F & ~(1 << ((r + i) % 7))
    else:  # BOR, BXOR
        v = 1 << ((r + i) % 7)
    return encode(dt, v)


def _rot7_ones(p: int, k: np.ndarray) -> np.ndarray:
    """OR over r < p of 1 << ((r + k) % 7): p consecutive bits, rotated by k within 7 bits."""
    if p >= 7:
        return np.full(k.shape, 0x7F)
    x = (1 << p) - 1
    return ((x << k) | (x >> (7 - k))) & 0x7F


def expected(dt: str, op: ReduceOp, p: int, n: int) -> np.ndarray:
    """Closed-form result of reducing contrib(dt, op, r, n) over r < p (AVG: float64/complex128 values)."""
    i = np.arange(n)
    if dt == "bool":
        stacked = np.stack([contrib(dt, op, r, n) for r in range(p)]) if n else np.zeros((p, 0), bool)
        f = {
            ReduceOp.SUM: np.logical_or,
            ReduceOp.MAX: np.logical_or,
            ReduceOp.BOR: np.logical_or,
            ReduceOp.PRODUCT: np.logical_and,
            ReduceOp.MIN: np.logical_and,
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BXOR: np.logical_xor,
        }[op]
        return f.reduce(stacked, axis=0)
    tri = p * (p + 1) // 2
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        v = (i % 5) * tri + p * (p - 1) // 2
        if dt == "complex64":
            v = v + 1j * (p * (p - 1) // 2 - p * (i % 3))
        if op is ReduceOp.AVG:
            return v / p
    elif op is ReduceOp.MIN:
        v = i % 5
    elif op is ReduceOp.MAX:
        v = p * (i % 5) + p - 1
    elif op is ReduceOp.PRODUCT:
        v = np.where(i % 2 == 0, 2 ** (p // 2), 2 ** ((p + 1) // 2))
    elif op is ReduceOp.BOR:
        v = _rot7_ones(p, i % 7)
    elif op is ReduceOp.BXOR:
        v = _rot7_ones(p, i % 7) if p <= 7 else 0x7F ^ (1 << (i % 7))
    elif op is ReduceOp.BAND:
        v = 0x7F & ~_rot7_ones(p, i % 7)
    return encode(dt, v)


def check_reduced(dt: str, op: ReduceOp, p: int, got: np.ndarray, what: str, want: Optional[np.ndarray] = None) -> None:
    """got == expected(dt, op, p, len(got)) (or ``want``): bit-exact, AVG within rounding."""
    if want is None:
        want = expected(dt, op, p, got.shape[0])
    if op is ReduceOp.AVG:
        rtol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "complex64": 1e-6, "float64": 1e-12}[dt]
        np.testing.assert_allclose(decode(dt, got), want, rtol=rtol, atol=rtol, err_msg=what)
        return
    assert got.dtype == want.dtype, what
    if got.tobytes() != want.tobytes():
        bad = np.nonzero(got != want)[0][:5]
        raise AssertionError(f"{what}: first differences at {bad.tolist()}: got {got[bad]} want {want[bad]}")


def red_cases(extra_n: int = 37):
    """SUM for every dtype x count, then every other valid op x dtype at one odd count."""
    cases = [(dt, ReduceOp.SUM, n) for dt in DTYPES for n in COUNTS]
    cases += [(dt, op, extra_n) for dt in DTYPES for op in OPS if op is not ReduceOp.SUM and valid(op, dt)]
    return cases


def kernel(op: ReduceOp, dt: str):
    return reducer(op, "bfloat16" if dt == "bfloat16" else np.dtype(dt))


def data(dt: str, r: int, n: int, salt: int = 0) -> np.ndarray:
    """Distinct per-rank payload for the data-movement collectives."""
    v = (r * 1000 + salt * 7 + np.arange(n)) % 30011  # fits float16
    if dt == "bool":
        return (v * 7 + r) % 3 == 0
    return encode(dt, v)


def garbage(dt: str, n: int) -> np.ndarray:
    b = np.full(n * storage(dt).itemsize, 0xAB, np.uint8).view(storage(dt))
    return b if dt != "bool" else np.ones(n, bool)


def rooted_cases(p: int):
    """Every root x every count (dtypes rotating), plus every dtype at the last root."""
    cases = []
    for root in range(p):
        for j, n in enumerate(COUNTS):
            cases.append((root, DTYPES[(root * len(COUNTS) + j) % len(DTYPES)], n))
    cases += [(p - 1, dt, n) for dt in DTYPES for n in (1, 7, 1000)]
    return cases


# ----------------------------------------------------------------------------- all_reduce
ALLREDUCE = {
    "recursive_doubling": AR.allreduce_recursive_doubling,
    "ring": AR.allreduce_ring,
    "reduce_bcast": AR.allreduce_reduce_bcast,
    "hierarchical_1host": AR.allreduce_hierarchical,
    "direct": DIR.allreduce_direct,
    "direct_rsag": DIR.allreduce_direct_rsag,
    "select": select.all_reduce,
}


def _allreduce_body(f, cases, p, out=None):
    """A rank's body: all-reduce every (dtype, op, n) of ``cases`` with ``f`` and check it exact (``out``: also
    keep each result's bytes under (rank, case))."""

    def body(r, make):
        for k, (dt, op, n) in enumerate(cases):
            buf = contrib(dt, op, r, n)
            f(make(k + 1), buf, kernel(op, dt))
            finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
            check_reduced(dt, op, p, buf, f"case {k} {dt} {op.name} n={n} rank {r}/{p}")
            if out is not None:
                out[(r, k)] = buf.tobytes()

    return body


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(ALLREDUCE))
def test_all_reduce(alg, p):
    run_ranks(p, _allreduce_body(ALLREDUCE[alg], red_cases(), p))


@pytest.mark.parametrize("p", [3, 5, 6, 8])
@pytest.mark.parametrize("alg", ["recursive_doubling", "ring", "reduce_bcast", "direct", "direct_rsag"])
def test_all_reduce_identical_bits_on_every_rank(alg, p):
    """Inexact float sums: every rank must hold the same bits, close to the float64 sum."""
    n = 5003
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) * 1e3 for r in range(p)]
    bf_inputs = [float32_to_bfloat16(x) for x in inputs]
    f = ALLREDUCE[alg]

    def body(r, make):
        a = inputs[r].copy()
        f(make(1), a, kernel(ReduceOp.SUM, "float32"))
        b = bf_inputs[r].copy()
        f(make(2), b, kernel(ReduceOp.SUM, "bfloat16"))
        return a, b

    out = run_ranks(p, body)
    ref = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    for a, b in out:
        assert a.tobytes() == out[0][0].tobytes()
        assert b.tobytes() == out[0][1].tobytes()
    np.testing.assert_allclose(out[0][0], ref, rtol=1e-4, atol=1e-2)
    bf_ref = np.sum(np.stack([bfloat16_to_float32(x) for x in bf_inputs]).astype(np.float64), axis=0)
    np.testing.assert_allclose(bfloat16_to_float32(out[0][1]), bf_ref, rtol=3e-2, atol=30)


# ----------------------------------------------------------------------------- reduce
REDUCE = {
    "binomial": RED.reduce_binomial,
    "reduce_scatter_gather": RED.reduce_scatter_gather,
    "select": select.reduce,
}


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(REDUCE))
def test_reduce(alg, p):
    f = REDUCE[alg]
    cases = [
        (root, dt, ReduceOp.SUM if root % 2 == 0 else ReduceOp.MAX if dt != "complex64" else ReduceOp.PRODUCT, n)
        for root, dt, n in rooted_cases(p)
    ]
    cases += [(p // 2, dt, op, n) for dt, op, n in red_cases() if op is not ReduceOp.SUM]

    def body(r, make):
        for k, (root, dt, op, n) in enumerate(cases):
            buf = contrib(dt, op, r, n)
            orig = buf.copy()
            f(make(k + 1), buf, kernel(op, dt), root)
            what = f"case {k} root {root} {dt} {op.name} n={n} rank {r}/{p}"
            if r == root:
                finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
                check_reduced(dt, op, p, buf, what)
            else:
                assert buf.tobytes() == orig.tobytes(), f"{what}: non-root buffer modified"

    run_ranks(p, body)


# ----------------------------------------------------------------------------- broadcast
BCAST = {"binomial": BC.bcast_binomial, "scatter_allgather": BC.bcast_scatter_allgather, "select": select.broadcast}


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(BCAST))
def test_broadcast(alg, p):
    f = BCAST[alg]
    cases = rooted_cases(p)

    def body(r, make):
        for k, (root, dt, n) in enumerate(cases):
            want = data(dt, root, n, k)
            buf = want.copy() if r == root else garbage(dt, n)
            f(make(k + 1), buf, root)
            assert buf.tobytes() == want.tobytes(), f"case {k} root {root} {dt} n={n} rank {r}/{p}"

    run_ranks(p, body)


# ----------------------------------------------------------------------------- gather / scatter
GATHER = {"binomial": GA.gather_binomial, "linear": GA.gather_linear, "select": select.gather}
SCATTER = {"binomial": GA.scatter_binomial, "linear": GA.scatter_linear, "select": select.scatter}


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(GATHER))
def test_gather(alg, p):
    f = GATHER[alg]
    cases = rooted_cases(p)

    def body(r, make):
        for k, (root, dt, n) in enumerate(cases):
            send = data(dt, r, n, k)
            keep = send.copy()
            recv = garbage(dt, p * n) if r == root else None
            f(make(k + 1), send, recv, root)
            assert send.tobytes() == keep.tobytes()
            if r == root:
                want = np.concatenate([data(dt, i, n, k) for i in range(p)])
                assert recv.tobytes() == want.tobytes(), f"case {k} root {root} {dt} n={n} p={p}"

    run_ranks(p, body)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(SCATTER))
def test_scatter(alg, p):
    f = SCATTER[alg]
    cases = rooted_cases(p)

    def body(r, make):
        for k, (root, dt, n) in enumerate(cases):
            send = np.concatenate([data(dt, i, n, k) for i in range(p)]) if r == root else None
            keep = None if send is None else send.copy()
            recv = garbage(dt, n)
            f(make(k + 1), send, recv, root)
            assert recv.tobytes() == data(dt, r, n, k).tobytes(), f"case {k} root {root} {dt} n={n} rank {r}/{p}"
            if send is not None:
                assert send.tobytes() == keep.tobytes()

    run_ranks(p, body)


# ----------------------------------------------------------------------------- all_gather(v)
ALLGATHER = {"bruck": GA.allgather_bruck, "ring": GA.allgather_ring, "select": select.all_gather}
ALLGATHERV = {"gather_bcast": GA.allgatherv_gather_bcast, "ring": GA.allgatherv_ring, "select": select.all_gatherv}


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(ALLGATHER))
def test_all_gather(alg, p):
    f = ALLGATHER[alg]
    cases = [(dt, n) for dt in DTYPES for n in COUNTS]

    def body(r, make):
        for k, (dt, n) in enumerate(cases):
            send = data(dt, r, n, k)
            recv = garbage(dt, p * n)
            f(make(k + 1), send, recv)
            want = np.concatenate([data(dt, i, n, k) for i in range(p)])
            assert recv.tobytes() == want.tobytes(), f"case {k} {dt} n={n} rank {r}/{p}"

    run_ranks(p, body)


def vcounts(p: int, n: int) -> List[int]:
    """Uneven counts with zeros: n, n - (n//p + 1), ... clipped at 0."""
    return [max(0, n - r * (n // p + 1)) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(ALLGATHERV))
def test_all_gatherv(alg, p):
    f = ALLGATHERV[alg]
    cases = [(dt, n, rev) for dt in DTYPES for n in COUNTS for rev in (False, True)]

    def body(r, make):
        for k, (dt, n, rev) in enumerate(cases):
            counts = vcounts(p, n)
            if rev:
                counts = counts[::-1]
            send = data(dt, r, counts[r], k)
            recv = garbage(dt, sum(counts) + 3)  # larger than needed: the tail is untouched
            tail = recv[-3:].copy()
            f(make(k + 1), send, recv, counts)
            want = np.concatenate([data(dt, i, counts[i], k) for i in range(p)])
            assert recv[: sum(counts)].tobytes() == want.tobytes(), f"case {k} {dt} counts={counts} rank {r}/{p}"
            assert recv[-3:].tobytes() == tail.tobytes()

    run_ranks(p, body)


# ----------------------------------------------------------------------------- reduce_scatter
REDSCAT = {"allreduce": RSC.reduce_scatter_allreduce, "ring": RSC.reduce_scatter_ring, "select": select.reduce_scatter}


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(REDSCAT))
def test_reduce_scatter(alg, p):
    f = REDSCAT[alg]
    cases = red_cases(extra_n=7)

    def body(r, make):
        for k, (dt, op, n) in enumerate(cases):
            # block j of rank r's sendbuf is contrib(...) of a "virtual rank" r, shifted by j*31 elements
            full = contrib(dt, op, r, p * n + 31 * p)
            send = (
                np.concatenate([full[j * 31 + j * n : j * 31 + j * n + n] for j in range(p)]) if n else full[:0].copy()
            )
            keep = send.copy()
            recv = garbage(dt, n)
            f(make(k + 1), send, recv, kernel(op, dt))
            assert send.tobytes() == keep.tobytes(), "sendbuf modified"
            finalize(op, recv, p, dtype="bfloat16" if dt == "bfloat16" else None)
            lo = r * 31 + r * n
            want = expected(dt, op, p, p * n + 31 * p)[lo : lo + n]
            check_reduced(dt, op, p, recv, f"case {k} {dt} {op.name} n={n} rank {r}/{p}", want)

    run_ranks(p, body)


# ----------------------------------------------------------------------------- all_to_all
ALLTOALL = {"linear": A2A.alltoall_linear, "pairwise": A2A.alltoall_pairwise, "select": select.all_to_all}


def a2a_count(n: int, uniform: bool, src: int, dst: int) -> int:
    return n if uniform else (n * ((src + 2 * dst) % 3)) // 2


def a2a_block(dt: str, src: int, dst: int, cnt: int, salt: int) -> np.ndarray:
    return data(dt, src * 16 + dst, cnt, salt)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("alg", list(ALLTOALL))
def test_all_to_all(alg, p):
    f = ALLTOALL[alg]
    cases = [(dt, n, uni) for dt in DTYPES for n in COUNTS for uni in (True, False)]

    def body(r, make):
        for k, (dt, n, uni) in enumerate(cases):
            sc = [a2a_count(n, uni, r, j) for j in range(p)]
            rc = [a2a_count(n, uni, i, r) for i in range(p)]
            send = np.concatenate([a2a_block(dt, r, j, sc[j], k) for j in range(p)])
            keep = send.copy()
            recv = garbage(dt, sum(rc))
            f(make(k + 1), send, sc, recv, rc)
            want = np.concatenate([a2a_block(dt, i, r, rc[i], k) for i in range(p)])
            assert recv.tobytes() == want.tobytes(), f"case {k} {dt} n={n} uniform={uni} rank {r}/{p}"
            assert send.tobytes() == keep.tobytes()

    run_ranks(p, body)


def test_all_to_all_count_disagreement_is_reported():
    def body(r, make):
        send = np.arange(8, dtype=np.int32)
        recv = np.zeros(16, np.int32)
        # rank 0 sends 4 elements to rank 1, which expects 5 from it
        rc = [4, 4] if r == 0 else [5, 4]
        A2A.alltoall_linear(make(1, Deadline.after(2)), send, [4, 4], recv, rc)

    with pytest.raises(AssertionError, match="rank 1 failed: ProcGroupError.*counts disagree"):
        run_ranks(2, body)


# ----------------------------------------------------------------------------- barrier
@pytest.mark.parametrize("p", SIZES)
def test_barrier(p):
    rounds = 6
    entered = [0] * rounds
    lock = threading.Lock()

    def body(r, make):
        rnd = random.Random(r)
        for k in range(rounds):
            time.sleep(rnd.random() * 0.004 * (r == k % p))  # one late rank per round
            with lock:
                entered[k] += 1
            BAR.barrier_dissemination(make(k + 1))
            with lock:
                assert entered[k] == p, f"rank {r} left barrier {k} after only {entered[k]}/{p} ranks entered"

    run_ranks(p, body)
    assert select.ALGORITHMS["barrier"]["dissemination"] is BAR.barrier_dissemination


# ----------------------------------------------------------------------------- hierarchical
HOST_LAYOUTS = [
    ["a", "a", "b", "b", "b"],
    ["a", "b", "a", "b"],  # interleaved
    ["x", "y", "y", "z", "z", "z", "x", "x"],
    ["a", "a", "a", "b"],
    ["a", "b", "c", "c", "c", "c", "d"],
]


class RecordingTransport:
    """Wraps a transport; records (src, dst) of every send."""

    def __init__(self, inner, log, lock):
        self.inner, self.log, self.lock = inner, log, lock
        self.rank, self.world_size = inner.rank, inner.world_size

    def isend(self, dst, tag, data):
        with self.lock:
            self.log.append((self.inner.rank, dst))
        return self.inner.isend(dst, tag, data)

    def irecv(self, src, tag, out):
        return self.inner.irecv(src, tag, out)


def reduce_everywhere(fn: Callable[..., None], hosts: List[str], cases: list, host_arenas: bool = False) -> list:
    """Run the all-reduce ``fn`` on every (dtype, op, n) of ``cases`` over ranks laid out on ``hosts``: each result
    exact and bitwise equal on every rank.  Returns the (src, dst) of every message sent."""
    p = len(hosts)
    log: list = []
    lock = threading.Lock()
    out: dict = {}
    body = _allreduce_body(fn, cases, p, out)
    run_ranks(p, body, hosts=hosts, wrap=lambda t: RecordingTransport(t, log, lock), host_arenas=host_arenas)
    for k in range(len(cases)):
        assert len({out[(r, k)] for r in range(p)}) == 1, f"case {k}: ranks disagree bitwise"
    return log


@pytest.mark.parametrize("hosts", HOST_LAYOUTS, ids=["-".join(h) for h in HOST_LAYOUTS])
def test_hierarchical_all_reduce(hosts):
    p = len(hosts)
    comm = Comm(None, range(p), 0, 0, Deadline.after(1), hosts)
    assert select.choose_all_reduce(comm, 4, 1) is AR.allreduce_hierarchical
    leaders = {h: hosts.index(h) for h in hosts}
    cases = red_cases() + [("float32", ReduceOp.SUM, 100_003), ("float64", ReduceOp.MAX, 100_003)]
    log: list = []
    lock = threading.Lock()

    # select.all_reduce picks multileader for large buffers on uniform layouts (tested below), where
    # every rank crosses hosts: here only the one-leader-per-host algorithm
    uniform = AR.uniform_layout(AR.host_layout(hosts, p))
    fns = (AR.allreduce_hierarchical,) if uniform else (AR.allreduce_hierarchical, select.all_reduce)

    def body(r, make):
        for k, (dt, op, n) in enumerate(cases):
            for j, f in enumerate(fns):
                buf = contrib(dt, op, r, n)
                f(make(2 * k + j + 1), buf, kernel(op, dt))
                finalize(op, buf, p, dtype="bfloat16" if dt == "bfloat16" else None)
                check_reduced(dt, op, p, buf, f"case {k} via {f.__name__} {dt} {op.name} n={n} rank {r}/{p}")

    run_ranks(p, body, hosts=hosts, wrap=lambda t: RecordingTransport(t, log, lock))
    cross = {(s, d) for s, d in log if hosts[s] != hosts[d]}
    assert cross, "no cross-host traffic at all?"
    lead = set(leaders.values())
    assert all(s in lead and d in lead for s, d in cross), f"non-leader crossed hosts: {sorted(cross)}"


@pytest.mark.parametrize("mode", ["both", "fold", "spread"])
@pytest.mark.parametrize("hosts", HOST_LAYOUTS, ids=["-".join(h) for h in HOST_LAYOUTS])
def test_hierarchical_all_reduce_through_host_slots(hosts, mode, monkeypatch):
    """A group spanning hosts with each host's shared slots (Comm.host_arena): the host-local stages are arena /
    big-slot exchanges (no message between ranks of one host), only leaders cross hosts, results exact and bitwise
    equal on every rank; sizes within the arena, in the big slots (pipelined, odd) and 0/1.  ``fold``/``spread``:
    only that stage through the slots (select.HOST_SLOTS_BCAST_MAX / HOST_SLOTS_MAX = 0), the other with messages."""
    if mode == "fold":
        monkeypatch.setattr(select, "HOST_SLOTS_BCAST_MAX", 0)
    elif mode == "spread":
        monkeypatch.setattr(select, "HOST_SLOTS_MAX", 0)
    cases = red_cases() + [
        ("float32", ReduceOp.SUM, 100_003),
        ("float64", ReduceOp.MAX, 100_003),
        ("int64", ReduceOp.SUM, 8191),
        ("float32", ReduceOp.SUM, 8176),  # 32,704 bytes: the arena's payload exactly
        ("float32", ReduceOp.SUM, 8177),  # just above: big slots
    ]
    log = reduce_everywhere(AR.allreduce_hierarchical, hosts, cases, host_arenas=True)
    leaders = {hosts.index(h) for h in hosts}
    within = [(s, d) for s, d in log if hosts[s] == hosts[d]]
    if mode == "both":
        assert log and all(s in leaders and d in leaders for s, d in log), f"messages besides between leaders: {log}"
        assert not within, f"messages between ranks of one host: {within}"
    else:  # the other stage runs on messages within hosts
        assert within, f"{mode}: no messages within hosts"


UNIFORM_LAYOUTS = [
    ["a", "a", "b", "b"],
    ["a", "a", "b", "b", "c", "c"],
    ["a", "b", "c", "a", "b", "c"],  # interleaved: local rank i of host h is not rank h*L+i
    ["x", "x", "x", "y", "y", "y"],
]


@pytest.mark.parametrize("hosts", UNIFORM_LAYOUTS, ids=["-".join(h) for h in UNIFORM_LAYOUTS])
def test_multileader_all_reduce(hosts):
    """Every rank of a host drives one slice across hosts; results are exact and identical on every rank."""
    p = len(hosts)
    mk = Comm(None, range(p), 0, 0, Deadline.after(1), hosts)
    assert select.choose_all_reduce(mk, 4, 1) is AR.allreduce_hierarchical  # small: one leader per host
    assert select.choose_all_reduce(mk, 256 << 10, 1 << 16) is AR.allreduce_hierarchical
    assert select.choose_all_reduce(mk, 64 << 20, 16 << 20) is AR.allreduce_multileader
    m = select.MULTILEADER_MIN
    assert select.choose_all_reduce(mk, m - 4, m // 4 - 1) is AR.allreduce_hierarchical
    assert select.choose_all_reduce(mk, m, m // 4) is AR.allreduce_multileader
    cases = red_cases() + [
        ("float32", ReduceOp.SUM, 100_003),
        ("float64", ReduceOp.MAX, 100_003),
        ("int32", ReduceOp.SUM, 2),
        ("float32", ReduceOp.SUM, 1 << 18),  # 1 MiB
        ("float64", ReduceOp.MIN, (1 << 17) + 1),  # odd, just above
    ]
    log = reduce_everywhere(AR.allreduce_multileader, hosts, cases)
    crossing = {s for s, d in log if hosts[s] != hosts[d]}
    assert crossing == set(range(p)), f"every rank should send across hosts, only {sorted(crossing)} did"


@pytest.mark.parametrize("hosts", UNIFORM_LAYOUTS, ids=["-".join(h) for h in UNIFORM_LAYOUTS])
def test_multileader_all_reduce_through_host_slots(hosts, monkeypatch):
    """With each host's shared slots (Comm.host_arena) the multi-leader all_reduce's host stages are big-slot
    reduce-scatter and all-gather: no message between ranks of one host, every rank crosses hosts with its block,
    results exact and bitwise equal on every rank, across steps of the buffers (several per call) and every op.
    Elements that are not a multiple of the host's ranks (uneven blocks), and buffers above
    select.HOST_SPLIT_MAX, take the ring within the host instead."""
    per = hosts.count(hosts[0])
    even = [
        ("float32", ReduceOp.SUM, 12 * 1024 * per),  # above the arena: one step
        ("int64", ReduceOp.SUM, 160 * 1024 * per),  # blocks of 1.25 MiB: two reduce-scatter steps and more
        ("float64", ReduceOp.MAX, 9000 * per),
        ("int32", ReduceOp.MIN, 9001 * per),
        ("float32", ReduceOp.PRODUCT, 9002 * per),
    ]
    log = reduce_everywhere(AR.allreduce_multileader, hosts, even, host_arenas=True)
    within = [(s, d) for s, d in log if hosts[s] == hosts[d]]
    assert not within, f"messages between ranks of one host: {within[:8]}"
    assert {s for s, d in log} == set(range(len(hosts))), "every rank should send its block across hosts"
    log = reduce_everywhere(AR.allreduce_multileader, hosts, [("float32", ReduceOp.SUM, 9000 * per + 1)], True)
    assert any(hosts[s] == hosts[d] for s, d in log), "uneven blocks: the ring within the host"
    monkeypatch.setattr(select, "HOST_SPLIT_MAX", 9000 * per * 4 - 4)
    log = reduce_everywhere(AR.allreduce_multileader, hosts, [("float32", ReduceOp.SUM, 9000 * per)], True)
    assert any(hosts[s] == hosts[d] for s, d in log), "above HOST_SPLIT_MAX: the ring within the host"
    assert select.choose_host_split(None, 9000 * per * 4) is None


def test_inter_host_stage_is_direct_for_few_hosts(monkeypatch):
    """The stage between hosts: direct (one hop) when small, direct reduce-scatter + all-gather above, flat rows
    beyond INTER_DIRECT_MAX_P hosts; the hierarchical all_reduces ask for it."""
    small, maxp = select.INTER_DIRECT_SMALL, select.INTER_DIRECT_MAX_P
    assert AR._stages.all_reduce_flat is select.choose_all_reduce_inter
    assert select.choose_all_reduce_inter(3, 4, 1) is DIR.allreduce_direct
    assert select.choose_all_reduce_inter(3, small, small // 4) is DIR.allreduce_direct
    assert select.choose_all_reduce_inter(3, small + 4, small // 4 + 1) is DIR.allreduce_direct_rsag
    assert select.choose_all_reduce_inter(maxp, 1 << 20, 1 << 18) is DIR.allreduce_direct_rsag
    assert select.choose_all_reduce_inter(maxp + 1, 4, 1) is AR.allreduce_recursive_doubling
    assert select.choose_all_reduce_inter(maxp + 1, 1 << 20, 1 << 18) is AR.allreduce_ring
    monkeypatch.setattr(select, "INTER_RSAG_MAX", 1 << 20)
    assert select.choose_all_reduce_inter(3, 1 << 20, 1 << 18) is DIR.allreduce_direct_rsag
    assert select.choose_all_reduce_inter(3, (1 << 20) + 4, (1 << 18) + 1) is AR.allreduce_ring
    assert select.ALGORITHMS["all_reduce"]["direct"] is DIR.allreduce_direct


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b", "c", "c"], ["a", "b", "c", "a", "b", "c"]])
def test_multileader_and_hierarchical_across_the_direct_threshold(hosts):
    """Slices at, just below and just above INTER_DIRECT_SMALL (direct / direct_rsag between hosts), odd sizes."""
    p = len(hosts)
    per = select.INTER_DIRECT_SMALL // 4 * 2  # float32 elements whose multileader slice is exactly the threshold
    half = per // 2  # ... whose whole buffer is (the hierarchical stage between hosts)
    ns = [half - 1, half, half + 1, per - 1, per, per + 1, per + 3, 3 * per + 5]
    cases = [(dt, op, n) for n in ns for dt, op in (("float32", ReduceOp.SUM), ("int32", ReduceOp.MAX))]
    fns = (AR.allreduce_multileader, AR.allreduce_hierarchical)
    out: dict = {}

    def body(r, make):
        for k, (dt, op, n) in enumerate(cases):
            for j, f in enumerate(fns):
                buf = contrib(dt, op, r, n)
                f(make(2 * k + j + 1), buf, kernel(op, dt))
                check_reduced(dt, op, p, buf, f"case {k} via {f.__name__} {dt} {op.name} n={n} rank {r}/{p}")
                out[(r, k, j)] = buf.tobytes()

    run_ranks(p, body, hosts=hosts)
    for k in range(len(cases)):
        for j in range(len(fns)):
            assert len({out[(r, k, j)] for r in range(p)}) == 1, f"case {k}: ranks disagree bitwise"


def test_multileader_falls_back_on_uneven_hosts():
    hosts = ["a", "a", "b", "b", "b"]
    mk = Comm(None, range(5), 0, 0, Deadline.after(1), hosts)
    assert select.choose_all_reduce(mk, 1 << 20, 1 << 18) is AR.allreduce_hierarchical
    k = kernel(ReduceOp.SUM, "float32")

    def body(r, make):
        buf = np.full(1000, r + 1, dtype=np.float32)
        AR.allreduce_multileader(make(1), buf, k)
        assert (buf == 15).all()

    run_ranks(5, body, hosts=hosts)


def test_hierarchical_not_chosen_without_structure():
    mk = lambda hosts: Comm(None, range(len(hosts)), 0, 0, Deadline.after(1), hosts)  # noqa: E731
    assert select.choose_all_reduce(mk(["a"] * 4), 4, 1) is AR.allreduce_recursive_doubling  # one host
    assert select.choose_all_reduce(mk(["a", "b", "c", "d"]), 4, 1) is AR.allreduce_recursive_doubling  # 1 per host
    assert select.choose_all_reduce(mk(["a", "b", "c", "d"]), 1 << 20, 1 << 18) is AR.allreduce_ring
    with pytest.raises(ConfigError, match="hosts"):  # one host key per rank
        select.choose_all_reduce(Comm(None, range(3), 0, 0, Deadline.after(1), ["a", "b"]), 4, 1)


# ----------------------------------------------------------------------------- large buffers
BIG = 4 * 1024 * 1024 + 3  # not divisible by 2, 3, 4, 5


@pytest.mark.parametrize(
    "p, what",
    [
        (3, "ring"),
        (4, "select"),
        (5, "reduce_scatter_gather"),
        (3, "bcast"),
        (4, "reduce_scatter_ring"),
        (5, "hierarchical"),
    ],
)
def test_large(p, what):
    """~4M float32 elements through the bandwidth-optimal paths."""
    k = kernel(ReduceOp.SUM, "float32")
    hosts = ["a", "a", "b", "b", "b"] if what == "hierarchical" else None

    def body(r, make):
        comm = make(1, Deadline.after(60))
        if what == "bcast":
            want = data("float32", 0, BIG) if r == 0 else None
            buf = np.array(want) if r == 0 else np.zeros(BIG, np.float32)
            BC.bcast_scatter_allgather(comm, buf, 0)
            want = data("float32", 0, BIG)
            assert buf.tobytes() == want.tobytes()
            return
        if what == "reduce_scatter_ring":
            n = BIG // p
            send = contrib("float32", ReduceOp.SUM, r, p * n)
            recv = np.zeros(n, np.float32)
            RSC.reduce_scatter_ring(comm, send, recv, k)
            want = expected("float32", ReduceOp.SUM, p, p * n)[r * n : (r + 1) * n]
            check_reduced("float32", ReduceOp.SUM, p, recv, f"reduce_scatter rank {r}", want)
            return
        buf = contrib("float32", ReduceOp.SUM, r, BIG)
        if what == "ring":
            AR.allreduce_ring(comm, buf, k)
        elif what == "select":
            assert select.choose_all_reduce(comm, buf.nbytes, BIG) is AR.allreduce_ring
            select.all_reduce(comm, buf, k)
        elif what == "hierarchical":
            select.all_reduce(comm, buf, k)
        else:
            orig = buf.copy()
            assert select.choose_reduce(p, buf.nbytes, BIG) is RED.reduce_scatter_gather
            RED.reduce_scatter_gather(comm, buf, k, 2)
            if r != 2:
                assert np.array_equal(buf, orig)
                return
        check_reduced("float32", ReduceOp.SUM, p, buf, f"{what} rank {r}")

    run_ranks(p, body, hosts=hosts, timeout=60)


# ----------------------------------------------------------------------------- tags, deadlines, selection
def test_consecutive_collectives_with_skew_do_not_cross():
    """Ranks run many collectives back to back; the slow rank makes others run ahead into later tags."""
    p = 5
    plan = []
    for k in range(40):
        plan.append(["rd", "ring", "bcast", "allgather", "barrier", "reduce", "a2a"][k % 7])

    def body(r, make):
        rnd = random.Random(100 + r)
        k_sum = kernel(ReduceOp.SUM, "int64")
        for k, what in enumerate(plan):
            if r == k % p:
                time.sleep(rnd.random() * 0.003)
            c = make(1000 + k)
            if what in ("rd", "ring"):
                buf = contrib("int64", ReduceOp.SUM, r, 1000)
                (AR.allreduce_recursive_doubling if what == "rd" else AR.allreduce_ring)(c, buf, k_sum)
                check_reduced("int64", ReduceOp.SUM, p, buf, f"{k} {what}")
            elif what == "bcast":
                buf = data("int32", k % p, 100, k) if r == k % p else np.zeros(100, np.int32)
                BC.bcast_binomial(c, buf, k % p)
                assert np.array_equal(buf, data("int32", k % p, 100, k))
            elif what == "allgather":
                recv = np.zeros(p * 9, np.int64)
                GA.allgather_bruck(c, data("int64", r, 9, k), recv)
                assert np.array_equal(recv, np.concatenate([data("int64", i, 9, k) for i in range(p)]))
            elif what == "barrier":
                BAR.barrier_dissemination(c)
            elif what == "reduce":
                buf = contrib("int64", ReduceOp.SUM, r, 33)
                RED.reduce_binomial(c, buf, k_sum, k % p)
                if r == k % p:
                    check_reduced("int64", ReduceOp.SUM, p, buf, f"{k} reduce")
            else:
                send = np.concatenate([a2a_block("int32", r, j, 3, k) for j in range(p)])
                recv = np.zeros(3 * p, np.int32)
                A2A.alltoall_linear(c, send, [3] * p, recv, [3] * p)
                assert np.array_equal(recv, np.concatenate([a2a_block("int32", i, r, 3, k) for i in range(p)]))

    run_ranks(p, body)


def test_concurrent_collectives_on_different_tags():
    """Two all_reduces in flight per rank at once (own scratch each), started in rank-dependent order."""
    p = 4
    k_sum = kernel(ReduceOp.SUM, "float64")
    k_max = kernel(ReduceOp.MAX, "int32")

    def body(r, make):
        out = {}
        errs = []

        def one(name):
            try:
                if name == "a":
                    buf = contrib("float64", ReduceOp.SUM, r, 3001)
                    AR.allreduce_ring(make(77, scratch=ScratchPool()), buf, k_sum)
                else:
                    buf = contrib("int32", ReduceOp.MAX, r, 3001)
                    AR.allreduce_recursive_doubling(make(78, scratch=ScratchPool()), buf, k_max)
                out[name] = buf
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        order = ["a", "b"] if r % 2 else ["b", "a"]
        ths = [threading.Thread(target=one, args=(nm,)) for nm in order]
        for th in ths:
            th.start()
            time.sleep(0.002)
        for th in ths:
            th.join(20)
        if errs:
            raise errs[0]
        check_reduced("float64", ReduceOp.SUM, p, out["a"], "a")
        check_reduced("int32", ReduceOp.MAX, p, out["b"], "b")

    run_ranks(p, body)


def test_missing_rank_times_out():
    def body(r, make):
        if r == 1:
            return  # never joins
        buf = np.ones(10, np.float32)
        AR.allreduce_recursive_doubling(make(1, Deadline.after(0.3)), buf, kernel(ReduceOp.SUM, "float32"))

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="DistTimeoutError"):
        run_ranks(2, body)
    assert time.monotonic() - t0 < 5


def test_size_one_sends_nothing():
    class NoSend:
        rank, world_size = 0, 1

        def isend(self, *a):
            raise AssertionError("size-1 group sent a message")

        irecv = isend

    c = Comm(NoSend(), [0], 0, 1, Deadline.after(1))
    k = kernel(ReduceOp.SUM, "int32")
    buf = np.arange(5, dtype=np.int32)
    for f in list(ALLREDUCE.values()):
        f(c, buf, k)
    for f in REDUCE.values():
        f(c, buf, k, 0)
    for f in BCAST.values():
        f(c, buf, 0)
    assert buf.tolist() == [0, 1, 2, 3, 4]
    out = np.zeros(5, np.int32)
    for f in list(GATHER.values()):
        out[:] = 0
        f(c, buf, out, 0)
        assert out.tolist() == [0, 1, 2, 3, 4]
    for f in list(SCATTER.values()):
        out[:] = 0
        f(c, buf, out, 0)
        assert out.tolist() == [0, 1, 2, 3, 4]
    for f in list(ALLGATHER.values()):
        out[:] = 0
        f(c, buf, out)
        assert out.tolist() == [0, 1, 2, 3, 4]
    for f in list(ALLGATHERV.values()):
        out[:] = 0
        f(c, buf, out, [5])
        assert out.tolist() == [0, 1, 2, 3, 4]
    for f in list(REDSCAT.values()):
        out[:] = 0
        f(c, buf, out, k)
        assert out.tolist() == [0, 1, 2, 3, 4]
    for f in list(ALLTOALL.values()):
        out[:] = 0
        f(c, buf, [5], out, [5])
        assert out.tolist() == [0, 1, 2, 3, 4]
    BAR.barrier_dissemination(c)


def test_selection_thresholds(monkeypatch):
    c8 = Comm(None, range(8), 0, 0, Deadline.after(1))
    S = select
    assert S.choose_all_reduce(c8, S.ALLREDUCE_SMALL, S.ALLREDUCE_SMALL // 4) is AR.allreduce_recursive_doubling
    assert S.choose_all_reduce(c8, S.ALLREDUCE_SMALL + 4, S.ALLREDUCE_SMALL // 4 + 1) is AR.allreduce_ring
    assert S.choose_all_reduce_flat(8, 1 << 30, 7) is AR.allreduce_recursive_doubling  # fewer elements than ranks
    assert S.choose_broadcast(8, S.BCAST_SMALL) is BC.bcast_binomial
    assert S.choose_broadcast(8, S.BCAST_SMALL + 1) is BC.bcast_scatter_allgather
    assert S.choose_broadcast(2, 1 << 30) is BC.bcast_binomial
    assert S.choose_reduce(8, S.REDUCE_SMALL, 100) is RED.reduce_binomial
    assert S.choose_reduce(8, S.REDUCE_SMALL + 1, 1 << 20) is RED.reduce_scatter_gather
    assert S.REDUCE_SMALL < S.REDUCE_SMALL_SHM  # one host's messages (a group without big slots): the tree for longer
    assert S.choose_reduce(8, S.REDUCE_SMALL_SHM, 1 << 20, shm=True) is RED.reduce_binomial
    assert S.choose_reduce(8, S.REDUCE_SMALL_SHM + 1, 1 << 20, shm=True) is RED.reduce_scatter_gather
    monkeypatch.setitem(S.FORCE, "all_reduce", "ring")
    assert S.choose_all_reduce(c8, 4, 1) is AR.allreduce_ring
    monkeypatch.setitem(S.FORCE, "all_reduce", "nope")
    with pytest.raises(ConfigError, match="recursive_doubling"):
        S.choose_all_reduce(c8, 4, 1)


def test_entry_points_pick_small_and_large(monkeypatch):
    """The entry points route to the small and the large algorithm (spied)."""
    calls: list = []

    def spy(name, fn):
        def w(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        monkeypatch.setattr(select, name, w)

    for name in (
        "allgather_bruck",
        "allgather_ring",
        "gather_binomial",
        "gather_linear",
        "scatter_binomial",
        "scatter_linear",
        "reduce_scatter_allreduce",
        "reduce_scatter_ring",
        "alltoall_linear",
        "alltoall_pairwise",
        "allgatherv_gather_bcast",
        "allgatherv_ring",
    ):
        spy(name, getattr(select, name))
    monkeypatch.setattr(select, "ALLGATHER_SMALL", 64)
    monkeypatch.setattr(select, "GATHER_SMALL", 64)
    monkeypatch.setattr(select, "REDUCE_SCATTER_SMALL", 64)
    monkeypatch.setattr(select, "ALLTOALL_SMALL", 64)
    p = 3
    k = kernel(ReduceOp.SUM, "int32")

    def body(r, make):
        for j, n in enumerate((2, 50)):
            base = 10 * j
            recv = np.zeros(p * n, np.int32)
            select.all_gather(make(base + 1), np.full(n, r, np.int32), recv)
            assert recv.tolist() == sum(([i] * n for i in range(p)), [])
            g = np.zeros(p * n, np.int32) if r == 1 else None
            select.gather(make(base + 2), np.full(n, r, np.int32), g, 1)
            out = np.zeros(n, np.int32)
            select.scatter(make(base + 3), np.repeat(np.arange(p, dtype=np.int32), n) if r == 1 else None, out, 1)
            assert out.tolist() == [r] * n
            rs = np.zeros(n, np.int32)
            select.reduce_scatter(make(base + 4), np.ones(p * n, np.int32), rs, k)
            assert rs.tolist() == [p] * n
            a2 = np.zeros(p * n, np.int32)
            select.all_to_all(make(base + 5), np.full(p * n, r, np.int32), [n] * p, a2, [n] * p)
            assert a2.tolist() == sum(([i] * n for i in range(p)), [])
            v = np.zeros(p * n, np.int32)
            select.all_gatherv(make(base + 6), np.full(n, r, np.int32), v, [n] * p)

    run_ranks(p, body)
    for small, large in (
        ("allgather_bruck", "allgather_ring"),
        ("gather_binomial", "gather_linear"),
        ("scatter_binomial", "scatter_linear"),
        ("reduce_scatter_allreduce", "reduce_scatter_ring"),
        ("alltoall_linear", "alltoall_pairwise"),
        ("allgatherv_gather_bcast", "allgatherv_ring"),
    ):
        assert small in calls and large in calls, (small, large, calls)


def test_bad_arguments_raise_config_error():
    c = Comm(None, range(3), 0, 0, Deadline.after(1))
    with pytest.raises(ConfigError):
        GA.allgather_ring(c, np.zeros(4, np.int8), np.zeros(11, np.int8))
    with pytest.raises(ConfigError):
        GA.allgatherv_ring(c, np.zeros(4, np.int8), np.zeros(20, np.int8), [3, 4, 4])
    with pytest.raises(ConfigError):
        GA.allgatherv_ring(c, np.zeros(4, np.int8), np.zeros(20, np.int8), [4, 4])
    with pytest.raises(ConfigError):
        GA.gather_linear(c, np.zeros(4, np.int8), None, 0)
    with pytest.raises(ConfigError):
        GA.scatter_binomial(c, np.zeros(5, np.int8), np.zeros(2, np.int8), 0)
    with pytest.raises(ConfigError):
        RSC.reduce_scatter_ring(c, np.zeros(10, np.int8), np.zeros(3, np.int8), kernel(ReduceOp.SUM, "int8"))
    with pytest.raises(ConfigError):
        A2A.alltoall_pairwise(c, np.zeros(3, np.int8), [1, 1, 2], np.zeros(3, np.int8), [1, 1, 1])
    with pytest.raises(ConfigError):
        A2A.alltoall_linear(c, np.zeros(3, np.int8), [2, 1, 0], np.zeros(3, np.int8), [1, 1, 1])


@pytest.mark.parametrize("p", [3, 4])
def test_in_place_aliasing(p):
    """sendbuf may be this rank's block of recvbuf (all_gather_into_tensor / reduce_scatter_tensor in place)."""
    n = 11
    k = kernel(ReduceOp.SUM, "int64")

    def body(r, make):
        tag = 0
        for f in (GA.allgather_ring, GA.allgather_bruck):
            recv = np.zeros(p * n, np.int64)
            recv[r * n : (r + 1) * n] = data("int64", r, n)
            tag += 1
            f(make(tag), recv[r * n : (r + 1) * n], recv)
            assert np.array_equal(recv, np.concatenate([data("int64", i, n) for i in range(p)])), f.__name__
        for f in (GA.allgatherv_ring, GA.allgatherv_gather_bcast):
            counts = vcounts(p, n)
            offs = np.cumsum([0] + counts)
            recv = np.zeros(offs[-1], np.int64)
            recv[offs[r] : offs[r + 1]] = data("int64", r, counts[r])
            tag += 1
            f(make(tag), recv[offs[r] : offs[r + 1]], recv, counts)
            assert np.array_equal(recv, np.concatenate([data("int64", i, counts[i]) for i in range(p)])), f.__name__
        for f in (RSC.reduce_scatter_ring, RSC.reduce_scatter_allreduce):
            send = contrib("int64", ReduceOp.SUM, r, p * n)
            tag += 1
            f(make(tag), send, send[r * n : (r + 1) * n], k)
            want = expected("int64", ReduceOp.SUM, p, p * n)
            assert np.array_equal(send[r * n : (r + 1) * n], want[r * n : (r + 1) * n]), f.__name__
            # the other blocks are still this rank's input
            mine = contrib("int64", ReduceOp.SUM, r, p * n)
            mask = np.ones(p * n, bool)
            mask[r * n : (r + 1) * n] = False
            assert np.array_equal(send[mask], mine[mask]), f.__name__

    run_ranks(p, body)


def test_entry_points_flatten_and_reject_strided():
    p = 2
    k = kernel(ReduceOp.SUM, "float32")

    def body(r, make):
        buf = np.full((3, 4), r + 1, np.float32)  # 2-D, contiguous: reduced as 12 elements
        select.all_reduce(make(1), buf, k)
        assert np.all(buf == 3)
        with pytest.raises(ConfigError, match="C-contiguous"):
            select.all_reduce(make(2), np.zeros((4, 4), np.float32)[:, 1], k)
        with pytest.raises(ConfigError, match="C-contiguous"):
            GA.allgather_ring(make(3), np.zeros(8, np.int8)[::2], np.zeros(8, np.int8))

    run_ranks(p, body)


@pytest.mark.parametrize("p", [4, 5])
def test_all_to_all_ranks_may_choose_different_algorithms(p):
    """With uneven counts the size-based choice is per rank; mixed choices must still match up."""

    def body(r, make):
        for k, (n, uni) in enumerate([(7, False), (1000, False), (3, True)]):
            f = A2A.alltoall_linear if r % 2 else A2A.alltoall_pairwise
            sc = [a2a_count(n, uni, r, j) for j in range(p)]
            rc = [a2a_count(n, uni, i, r) for i in range(p)]
            send = np.concatenate([a2a_block("int32", r, j, sc[j], k) for j in range(p)])
            recv = garbage("int32", sum(rc))
            f(make(k + 1), send, sc, recv, rc)
            want = np.concatenate([a2a_block("int32", i, r, rc[i], k) for i in range(p)])
            assert recv.tobytes() == want.tobytes()

    run_ranks(p, body)
