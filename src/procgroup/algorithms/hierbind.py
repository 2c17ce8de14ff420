"""The all_reduces of a group spanning hosts, bound once per call shape (for :mod:`procgroup.plans`).

:func:`~.allreduce.allreduce_hierarchical` and :func:`~.allreduce.allreduce_multileader` derive on every call what
is the same for every call of one shape: the host layout, this rank's host and its place in it, the sub-groups of
its host and of the leaders (objects built afresh), and the algorithm of each stage.  On 3 network-namespace hosts
x 2 ranks that derivation was most of a 64 KiB call's Python: a host partner's whole call is a copy in, a sleep
and a copy out.  :func:`bind_hierarchical` and :func:`bind_multileader` derive it once and return
``fn(comm, buf)``, which runs the same stages, with the same steps, check words and messages, as the unbound
algorithm: ranks that take the bound path and ranks that do not meet in the same call.  Where the host stages are
the big slots' one-step reduce and broadcast, the bound stages are their compiled one-call forms
(:func:`~.bigarena.bind_reduce`, :func:`~.bigarena.bind_bcast`).

The binding reads the stage choices installed by :mod:`~.select` (:data:`~.allreduce._stages`) when it is made;
the caller (a plan) checks per call that no threshold changed since (``select.tunables()``).  The sub-groups are
made once per parent Comm (a plan's calls reuse their group's) and take the call's deadline on every call.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from . import allreduce as _ar
from ._util import SPAN, HostComm, SubComm
from .allreduce import host_layout, stage_pieces, uniform_layout
from .bigarena import allreduce_big_split, bcast_big, bind_bcast, bind_reduce, bind_split, reduce_big

__all__ = ["bind_hierarchical", "bind_multileader"]

Kernel = Callable[[np.ndarray, np.ndarray], None]
Bound = Callable[[Any, np.ndarray], None]


class _Subs:
    """The sub-groups of one parent Comm: this host's members (with its shared slots) and, where given, the ranks
    that cross hosts with this one; remade when the parent changes, their deadline the parent's at every call."""

    __slots__ = ("mine", "arena", "across", "parent", "host", "inter")

    def __init__(self, mine: List[int], arena: Any, across: Optional[List[int]]) -> None:
        self.mine, self.arena, self.across = mine, arena, across
        self.parent: Any = None
        self.host: Any = None
        self.inter: Any = None

    def of(self, c: Any) -> Tuple[Any, Any]:
        if self.parent is not c:
            self.host = HostComm(c, self.mine, 1 * SPAN, self.arena)
            self.inter = SubComm(c, self.across, 2 * SPAN) if self.across is not None else None
            self.parent = c
        dl = c.deadline
        self.host.deadline = dl
        if self.inter is not None:
            self.inter.deadline = dl
        return self.host, self.inter


def _layout(probe: Any) -> Optional[Tuple[List[List[int]], List[int], int, Any]]:
    """(hosts, this host's members, this rank's index among them, the host's slots), where the host stages can
    run in the host's shared slots (``probe.host_arena``, more than one member); else None."""
    ha = getattr(probe, "host_arena", None)
    if ha is None:
        return None
    hosts = host_layout(list(probe.hosts), probe.size)
    mine = next(h for h in hosts if probe.rank in h)
    if len(hosts) < 2 or len(mine) < 2:
        return None
    return hosts, mine, mine.index(probe.rank), ha


def bind_hierarchical(probe: Any, nbytes: int, nelems: int, dt: np.dtype, reduce: Kernel) -> Optional[Bound]:
    """:func:`~.allreduce.allreduce_hierarchical` of ``nelems`` elements of ``dt`` (``nbytes``) with ``reduce`` on
    ``probe``'s rank (a Comm of the group: size, hosts, host_arena), where both host stages run in the host's shared
    slots; else None (the caller runs the algorithm)."""
    lay = _layout(probe)
    if lay is None or nelems == 0:
        return None
    hosts, mine, li, ha = lay
    st = _ar._stages
    hp = HostComm(probe, mine, 1 * SPAN, ha)
    fold0, spread0 = st.host_reduce(hp, nbytes), st.host_broadcast(hp, nbytes)
    if fold0 is None or spread0 is None:
        return None
    big = getattr(ha, "big", None)
    fold = bind_reduce(big, nbytes, dt, len(mine), li, 0, reduce) if fold0 is reduce_big else None
    spread = bind_bcast(big, nbytes, dt, 0, li) if spread0 is bcast_big else None
    if fold is None:

        def fold(h: Any, a: np.ndarray) -> None:
            fold0(h, a, reduce, 0)

    if spread is None:

        def spread(h: Any, a: np.ndarray) -> None:
            spread0(h, a, 0)

    leaders = [h[0] for h in hosts]
    across = st.all_reduce_flat(len(leaders), nbytes, nelems) if li == 0 else None
    subs = _Subs(mine, ha, leaders if across is not None else None)

    def fn(c: Any, buf: np.ndarray) -> None:
        host, inter = subs.of(c)
        fold(host, buf)
        if across is not None:  # a leader (``inter`` is its sub-group of leaders)
            across(inter, buf, reduce)
        spread(host, buf)

    return fn


def bind_multileader(probe: Any, nbytes: int, nelems: int, dt: np.dtype, reduce: Kernel) -> Optional[Bound]:
    """:func:`~.allreduce.allreduce_multileader` as :func:`bind_hierarchical` binds the hierarchical one, where its
    host stages run in the host's shared slots (``host_split``) on blocks of equal size; else None.  A buffer the
    algorithm runs in pieces (:func:`~.allreduce.multileader_pieces`) binds each piece's shape and runs them in
    turn, as the algorithm does."""
    lay = _layout(probe)
    if lay is None:
        return None
    hosts, mine, li, ha = lay
    per = len(mine)
    if not uniform_layout(hosts) or nelems < per:
        return None
    st = _ar._stages
    pieces = stage_pieces(nelems, per, dt.itemsize)
    if len(pieces) > 1:  # the algorithm's pieces, each bound (at most two shapes: the pieces and the last)
        bound: Dict[int, Bound] = {}
        for a, b in pieces:
            if b - a not in bound:
                f = bind_multileader(probe, (b - a) * dt.itemsize, b - a, dt, reduce)
                if f is None:
                    return None
                bound[b - a] = f
        steps = [(a, b, bound[b - a]) for a, b in pieces]

        def chunked(c: Any, buf: np.ndarray) -> None:
            for a, b, f in steps:
                f(c, buf[a:b])

        return chunked
    if nelems % per:
        return None
    split = st.host_split(HostComm(probe, mine, 1 * SPAN, ha), nbytes)
    if split is None:
        return None
    # the host stages in one step each: their compiled one-call forms
    fast = bind_split(ha.big, nelems, dt, per, li, reduce) if split is allreduce_big_split else None
    m = nelems // per
    across = st.all_reduce_flat(len(hosts), m * dt.itemsize, m)
    subs = _Subs(mine, ha, [h[li] for h in hosts])
    between: List[Any] = [None, None]  # (inter, its closure) of the current parent

    def fn(c: Any, buf: np.ndarray) -> None:
        host, inter = subs.of(c)
        if between[0] is not inter:

            def part(block: np.ndarray) -> None:
                across(inter, block, reduce)

            between[0], between[1] = inter, part
        if fast is not None:
            fast(host, buf, between[1])
        elif not split(host, buf, reduce, between[1]):  # not expected (blocks are equal): the algorithm itself
            _ar.allreduce_multileader(c, buf, reduce)

    return fn
