"""The compiled all_to_all (``ShmArena.exchange_a2a``, _native_a2a.c), ranks as threads, closed-form values.

The compiled call takes a stream that fits behind the header in the arena slot (flag 0) or, longer, one that
fits one big-slot window (flag 2); a stream of several windows or above the limit is left to Python before
anything is published (-1), and a call whose headers show such a stream elsewhere, or counts that disagree,
is finished by Python after the exchange (flag 4).  These tests put every stream exactly at, one element
below and one element above each of those thresholds (arena capacity, the big slot, the limit), with equal
and uneven splits, zero and odd pieces, every dtype, world sizes 2-4, on the three transports (memory and
the pure-Python shm path run the same cases: same results), and check that on the compiled transport every
one of those routes ran.  Buffers whose destination lies 1-63 bytes past the source modulo 4096 (the copy
that avoids glibc's slow case) are checked byte for byte too.
"""

from __future__ import annotations

import mmap
from typing import Any, Callable, List

import numpy as np
import pytest

from procgroup.algorithms import alltoall_shm as A2A
from procgroup.algorithms.comm import Comm
from procgroup.transport.shm.arena import ShmArena

from .test_algorithms import DTYPES, storage
from .test_alltoall_shm import ARENA, _check_a2a, _pieces, world  # noqa: F401  (the fixture, by name)
from .test_bigarena import SLOT, _run


def _cap(p: int) -> int:
    """Stream bytes that fit behind the header in the arena slot."""
    return ARENA - A2A._header_bytes(p)


def _stream_cases(p: int, isz: int, limit: int) -> List[List[List[int]]]:
    """Counts (elements of ``isz`` bytes) whose streams (bytes a rank sends to the others) sit at, just below and
    just above every threshold: the arena capacity, one big slot, the limit; equal and uneven splits."""
    cases: List[List[List[int]]] = []
    for stream in (_cap(p), SLOT, limit):
        for d in (-1, 0, 1):
            n = stream // isz + d  # elements in the stream
            # equal pieces where they divide it, else the remainder on the last peer
            base, extra = divmod(max(n, 0), p - 1)
            cases.append(
                [[base + (extra if j == (r - 1) % p else 0) if j != r else 3 for j in range(p)] for r in range(p)]
            )
    # ranks on different routes in one call: rank 0 inline at the capacity, rank 1 one element above it (a big
    # slot), rank 2 (p > 2) one element above a big slot (several rounds: Python), the others 0 and odd pieces
    mixed = [[(r * 5 + j) % 4 for j in range(p)] for r in range(p)]
    mixed[0] = [0] * (p - 1) + [_cap(p) // isz]
    mixed[1] = [_cap(p) // isz + 1] + [0] * (p - 1)
    if p > 2:
        mixed[2] = [SLOT // isz + 1] + [0] * (p - 1)
    cases.append(mixed)
    # rank 0 inline, the last rank above the limit (read out of its sendbuf, in the compiled call where it runs)
    over = [[(r + j) % 3 for j in range(p)] for r in range(p)]
    over[p - 1] = [limit // isz + 1] + [0] * (p - 1)
    cases.append(over)
    cases.append([[0] * p for _ in range(p)])
    cases.append([[1 if j != r else 0 for j in range(p)] for r in range(p)])
    return cases


@pytest.fixture
def routes(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """What every compiled call returned (-1: not taken, else its flags)."""
    seen: List[int] = []
    real = ShmArena.exchange_a2a

    def spy(self: ShmArena, *a: Any) -> int:
        f = real(self, *a)
        seen.append(f)
        return f

    monkeypatch.setattr(ShmArena, "exchange_a2a", spy)
    return seen


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_threshold_every_route_closed_form(world: Any, p: int, routes: List[int]) -> None:  # noqa: F811
    limit = 3 * SLOT  # above it: one-copy reads (the compiled call reads them where every rank offers its sendbuf)
    dts = ["int8", "float64", "complex64"]

    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for dt in dts:
            for C in _stream_cases(p, storage(dt).itemsize, limit):
                k += 1
                _check_a2a(r, make(k), dt, C, k, lambda c, s, sc, o, rc: A2A.alltoall_shm(c, s, sc, o, rc, None, limit))

    ts = world(p)
    _run(ts, body, timeout=120)
    if world.kind in ("shm", "shm-stream"):  # type: ignore[attr-defined]
        # 4 (Python finishes): a stream of several big-slot windows, which only the mixed case of p > 2 has; the
        # streams above the limit are read out of their senders inside the compiled call (Slots.rd_calls)
        assert {-1, 0, 2} | ({4} if p > 2 else set()) <= set(routes), sorted(set(routes))
        assert sum(a._nat.rd_calls for t in ts for a in t._arenas) >= p * len(dts), "no compiled reads"
    else:
        assert set(routes) <= {-1}, sorted(set(routes))  # the pure-Python shm path: never compiled


@pytest.mark.parametrize("p", [2, 3])
def test_every_dtype_inline_and_in_a_big_slot(world: Any, p: int) -> None:  # noqa: F811
    def body(r: int, make: Callable[..., Comm]) -> None:
        k = 0
        for dt in DTYPES:
            isz = storage(dt).itemsize
            for stream in (7 * isz, _cap(p) + isz, SLOT - isz):
                n = stream // isz // (p - 1)
                k += 1
                _check_a2a(r, make(k), dt, [[n + (r + j) % 2 for j in range(p)] for r in range(p)], k, A2A.alltoall_shm)

    _run(world(p), body)


@pytest.mark.parametrize("skew", [1, 8, 16, 31, 63, 64, 4080])
def test_buffers_skewed_modulo_a_page(world: Any, skew: int) -> None:  # noqa: F811
    """recv lies ``skew`` bytes past send modulo 4096: the own piece and the pieces out of the slots are copied
    by copy_bytes' aligned-store loop where skew < 64 (odd lengths, heads and tails), memcpy elsewhere."""
    p = 2
    counts = [0, 1, 511, 512, 513, 4096 + 17, 20_000, SLOT - 5]

    def body(r: int, make: Callable[..., Comm]) -> None:
        mm = mmap.mmap(-1, 1 << 20)
        base = np.frombuffer(mm, np.uint8)
        for k, n in enumerate(counts):
            C = [[n + 3 * (i == j) + i for j in range(p)] for i in range(p)]
            send_n, recv_n = sum(C[r]), sum(C[i][r] for i in range(p))
            so = 4096 + 64 * r + 3 * k
            send = base[so : so + send_n]
            send[:] = np.concatenate(_pieces("uint8", C, r, k))
            ro = so + (1 << 19) + skew
            recv = base[ro : ro + recv_n]
            recv[:] = 0xAB
            A2A.alltoall_shm(make(k + 1), send, C[r], recv, [C[i][r] for i in range(p)])
            want = np.concatenate([_pieces("uint8", C, i, k)[r] for i in range(p)])
            assert recv.tobytes() == want.tobytes(), (n, skew)
        del send, recv, base
        mm.close()

    _run(world(p), body)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_list_form_in_place_every_route_closed_form(
    world: Any,  # noqa: F811
    p: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The list form's plan (collectives' helpers over ``ShmArena.bind_a2a`` with ``Prep.list_spec``): inputs read
    and outputs written in place by the compiled call at every route, the general path where it takes nothing,
    the single form's buffers where it leaves the rest to Python; pieces of 0, 1, odd and threshold lengths."""
    from procgroup import collectives
    from procgroup.algorithms import select

    limit = 3 * SLOT
    monkeypatch.setitem(select.BIG_LIMIT, "all_to_all", limit)
    routes: List[int] = []

    def body(r: int, make: Callable[..., Comm]) -> None:
        arena = make(0).arena
        k = 0
        for dt in ("int8", "float32", "bool"):
            isz = storage(dt).itemsize
            for C in _stream_cases(p, isz, limit):
                k += 1
                c = make(k)
                rc = [C[i][r] for i in range(p)]
                prep = A2A.prepare(p, r, C[r], rc, isz)
                ins = tuple(_pieces(dt, C, r, k))
                outs = tuple(np.full(n, 1, storage(dt)) if dt != "bool" else np.zeros(n, bool) for n in rc)
                bind = getattr(arena, "bind_a2a", None)
                xa = bind(prep.list_spec(), prep.header, arena.big) if bind is not None else None  # type: ignore
                f = xa(ins, outs, c.check_word() ^ A2A.SALT, c.deadline, limit, limit) if xa is not None else -1
                routes.append(f)
                if f < 0:
                    collectives._lists_general(c, ins, outs)
                elif f:
                    collectives._lists_after(c, f, ins, outs, prep, limit)
                for i in range(p):
                    want = _pieces(dt, C, i, k)[r]
                    assert outs[i].tobytes() == want.astype(storage(dt), copy=False).tobytes(), (dt, C, i)

    _run(world(p), body, timeout=120)
    if world.kind in ("shm", "shm-stream"):  # type: ignore[attr-defined]
        assert {-1, 0, 2, 4} <= set(routes), sorted(set(routes))
