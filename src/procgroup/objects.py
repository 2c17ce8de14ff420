"""Object collectives: any picklable object, pickle protocol 5 with out-of-band buffers.

Arrays inside objects are not copied into the pickle body (see
``protocol/payload.py``); point-to-point sends go segment by segment, so a
large array is sent straight from its own memory.

Every call pickles before it takes a sequence number; a member whose object cannot be pickled still
takes part, and every member raises :class:`~procgroup.errors.ObjectPicklingError` (issue 11 item 7).

Safe mode (issue 11 item 17).  Every call that unpickles a peer's objects takes ``safe=`` (True/False
wins over ``PROCGROUP_SAFE_OBJECTS``) and ``allowed=`` (``"module.Qualname"`` or ``"module.*"`` entries
added to ``PROCGROUP_SAFE_OBJECTS_ALLOW``; giving it without ``safe=`` turns safe mode on).  Safe mode
unpickles with :class:`~procgroup.protocol.safe_pickle.RestrictedUnpickler`: builtins, numpy arrays,
torch tensors and the allow-list, and :class:`~procgroup.errors.UnsafeObjectError` for anything else.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Iterable, List, Optional

import numpy as np

from . import algorithms as alg
from .arguments import API_SLOT_C
from .arguments import member_group as _group
from .arguments import peer_rank as _peer
from .arguments import root_rank as _root
from .errors import ConfigError, ObjectPicklingError, UnsafeObjectError
from .protocol import payload
from .protocol.safe_pickle import allow_list
from .tags import p2p_tag

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

_I64 = np.int64
#: added to a Comm's tag for the second collective of one call (algorithm steps stay far below 2**15)
PHASE2 = 1 << 15
#: most bytes of a pickling failure's description sent to the peers
_WHY_LIMIT = 1000
_PICKLE_FIX = (
    "make the object picklable (no locks, sockets, open files, lambdas or local classes; "
    "or give its class __reduce__/__getstate__)"
)


class _Encoded:
    """One rank's pickled contribution, made before the call takes a sequence number.

    ``data``: the payload bytes, or None when pickling failed; then ``why`` describes the failure (it
    travels to the peers instead of the object) and ``exc`` is the original error.  ``word`` is what
    the size exchange carries: the payload size, or ``-1 - len(why)`` as the failure marker.
    """

    __slots__ = ("data", "why", "exc")

    def __init__(self, data: Optional[np.ndarray], why: bytes = b"", exc: Optional[BaseException] = None) -> None:
        self.data, self.why, self.exc = data, why, exc

    @property
    def word(self) -> int:
        return int(self.data.nbytes) if self.data is not None else -1 - len(self.why)

    def why_array(self) -> np.ndarray:
        return np.frombuffer(self.why, np.uint8)


def _encode(obj: Any) -> np.ndarray:
    total, segs = payload.dumps(obj)
    return np.frombuffer(payload.join(segs, total), dtype=np.uint8)


def _decode(buf: np.ndarray, allowed: Optional[FrozenSet[str]] = None, sender: Optional[int] = None) -> Any:
    """Unpickle one payload; ``allowed`` not None: safe mode with that extra allow-list (see _safe_mode)."""
    try:
        return payload.loads(buf, allowed=allowed)
    except UnsafeObjectError as e:
        raise UnsafeObjectError(f"the object from rank {sender}: {e}", name=e.name) from None


def _safe_mode(g: Any, safe: Optional[bool], allowed: Optional[Iterable[str]]) -> Optional[FrozenSet[str]]:
    """None: plain pickle; else safe mode's extra allow-list (PROCGROUP_SAFE_OBJECTS_ALLOW and ``allowed``).

    ``safe`` (True/False) wins over PROCGROUP_SAFE_OBJECTS; ``allowed`` without ``safe`` turns safe mode on.
    """
    env = g.world.safe_objects
    on = safe if safe is not None else (env.enabled or allowed is not None)
    return allow_list(env.allowed) | allow_list(allowed) if on else None


def _why(what: str, obj: Any, e: BaseException) -> bytes:
    t = type(obj)
    text = f"{what} (a {t.__module__}.{t.__qualname__}): {type(e).__name__}: {e}"
    return text.encode("utf-8", "replace")[:_WHY_LIMIT]


def _try_encode(obj: Any, what: str = "its object") -> _Encoded:
    """Pickle ``obj`` now; a failure is kept (not raised) so the call can tell the peers."""
    try:
        return _Encoded(_encode(obj))
    except Exception as e:  # noqa: BLE001 - any error of pickling (TypeError, PicklingError, a __reduce__'s own)
        return _Encoded(None, _why(what, obj, e), e)


def _culprit(what: str, objs: List[Any], e: BaseException) -> bytes:
    """The description of a list's pickling failure, naming its first entry that fails on its own."""
    for i, o in enumerate(objs):
        try:
            payload.dumps(o)
        except Exception as e2:  # noqa: BLE001 - as in _try_encode
            return _why(f"{what}[{i}]", o, e2)
    return _why(what, objs, e)


def _marker_len(word: int) -> int:
    """Length of the failure description announced by a size word (0 for a payload size)."""
    return -1 - word if word < 0 else 0


def _pickling_error(failures: List[tuple], mine: Optional[_Encoded] = None) -> ObjectPicklingError:
    """One ObjectPicklingError for every member: ``failures`` = [(global rank, description bytes)]."""
    ranks = [r for r, _ in failures]
    lines = "; ".join(f"rank {r} could not pickle {w.decode('utf-8', 'replace')}" for r, w in failures)
    err = ObjectPicklingError(
        f"{lines}. Nothing was exchanged, every member of the call raises this error and the group stays "
        f"usable; {_PICKLE_FIX}",
        ranks=ranks,
    )
    if mine is not None and mine.exc is not None:
        err.__cause__ = mine.exc
    return err


def _check_failures(c: Any, words: List[int], mine: _Encoded) -> None:
    """When any member's size word is a failure marker: exchange the descriptions, raise on every member."""
    lens = [_marker_len(w) for w in words]
    if not any(lens):
        return
    out = np.empty(sum(lens), np.uint8)
    alg.all_gatherv(c, mine.why_array(), out, lens)
    c.tag += PHASE2
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    failures = [(c.ranks[i], out[offs[i] : offs[i + 1]].tobytes()) for i in range(c.size) if lens[i]]
    raise _pickling_error(failures, mine)


def broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
    *,
    safe: Optional[bool] = None,
    allowed: Optional[Iterable[str]] = None,
) -> None:
    """Root's ``object_list`` entries replace every other rank's, in place (same length everywhere)."""
    g = _group(group, "broadcast_object_list")
    if g is None:
        return
    root = _root(g, "broadcast_object_list", src, group_src, "src", default=0)

    enc = _try_encode(list(object_list), "object_list") if g.rank() == root else None
    if enc is not None and enc.exc is not None:
        enc.why = _culprit("object_list", list(object_list), enc.exc)

    mode = _safe_mode(g, safe, allowed)

    def run(c: Any) -> None:
        n = np.zeros(1, _I64)
        if enc is not None:
            n[0] = enc.word
        alg.broadcast(c, n, root)
        c.tag += PHASE2  # second collective of this call: steps of its own
        if n[0] < 0:  # the source could not pickle: its description instead of the objects
            why = enc.why_array().copy() if enc is not None else np.empty(_marker_len(int(n[0])), np.uint8)
            alg.broadcast(c, why, root)
            raise _pickling_error([(c.ranks[root], why.tobytes())], enc)
        data = enc.data if enc is not None else np.empty(int(n[0]), np.uint8)
        assert data is not None
        alg.broadcast(c, data, root)
        if c.rank != root:
            got = _decode(data, mode, c.ranks[root])
            if len(got) != len(object_list):
                raise ConfigError(
                    f"broadcast_object_list: the source sent {len(got)} objects but this rank's list has "
                    f"{len(object_list)}; use lists of the same length"
                )
            object_list[:] = got

    g.run("broadcast_object_list", run, signature=("broadcast_object_list", f"root={root}"))


def _gatherv(c: Any, mine: _Encoded, root: Optional[int]) -> Optional[List[np.ndarray]]:
    """All-gather (root None) or gather of variable-size byte arrays; every member raises on a pickling failure."""
    sizes = np.zeros(c.size, _I64)
    alg.all_gather(c, np.array([mine.word], _I64), sizes)
    c.tag += PHASE2
    counts = [int(s) for s in sizes]
    _check_failures(c, counts, mine)
    data = mine.data
    assert data is not None
    if root is None:
        out = np.empty(sum(counts), np.uint8)
        alg.all_gatherv(c, data, out, counts)
    else:
        m = max(counts) if counts else 0
        padded = c.scratch(m, slot=API_SLOT_C)
        padded[: data.nbytes] = data
        gathered = np.empty(m * c.size, np.uint8) if c.rank == root else None
        alg.gather(c, padded, gathered, root)
        if gathered is None:
            return None
        return [gathered[i * m : i * m + counts[i]] for i in range(c.size)]
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [out[offs[i] : offs[i + 1]] for i in range(c.size)]


def all_gather_object(
    object_list: List[Any],
    obj: Any,
    group: Any = None,
    *,
    safe: Optional[bool] = None,
    allowed: Optional[Iterable[str]] = None,
) -> None:
    """Every member's ``obj`` into ``object_list`` (length = group size), on every member."""
    g = _group(group, "all_gather_object")
    if g is None:
        return
    if len(object_list) != g.size():
        raise ConfigError(
            f"all_gather_object: object_list has {len(object_list)} entries but the group has {g.size()} ranks; "
            "pass [None] * world_size"
        )

    enc = _try_encode(obj)  # before the call takes a sequence number
    mode = _safe_mode(g, safe, allowed)

    def run(c: Any) -> None:
        parts = _gatherv(c, enc, None)
        assert parts is not None
        for i, p in enumerate(parts):
            object_list[i] = _decode(p, mode, c.ranks[i])

    g.run("all_gather_object", run, signature=("all_gather_object",))


def gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
    *,
    safe: Optional[bool] = None,
    allowed: Optional[Iterable[str]] = None,
) -> None:
    """Every member's ``obj`` into ``object_gather_list`` on ``dst``."""
    g = _group(group, "gather_object")
    if g is None:
        return
    root = _root(g, "gather_object", dst, group_dst, "dst", default=0)
    if g.rank() == root and (object_gather_list is None or len(object_gather_list) != g.size()):
        raise ConfigError(f"gather_object: the destination rank needs object_gather_list of length {g.size()}")

    enc = _try_encode(obj)  # before the call takes a sequence number
    mode = _safe_mode(g, safe, allowed)

    def run(c: Any) -> None:
        parts = _gatherv(c, enc, root)
        if parts is not None and object_gather_list is not None:
            for i, p in enumerate(parts):
                object_gather_list[i] = _decode(p, mode, c.ranks[i])

    g.run("gather_object", run, signature=("gather_object", f"root={root}"))


def scatter_object_list(
    scatter_object_output_list: List[Any],
    scatter_object_input_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
    *,
    safe: Optional[bool] = None,
    allowed: Optional[Iterable[str]] = None,
) -> None:
    """Rank i gets ``scatter_object_input_list[i]`` (from the source) in ``scatter_object_output_list[0]``."""
    g = _group(group, "scatter_object_list")
    if g is None:
        return
    root = _root(g, "scatter_object_list", src, group_src, "src", default=0)
    if not scatter_object_output_list:
        raise ConfigError(
            "scatter_object_list: scatter_object_output_list must have at least one element to receive into"
        )
    if g.rank() == root and (scatter_object_input_list is None or len(scatter_object_input_list) != g.size()):
        raise ConfigError(f"scatter_object_list: the source rank needs scatter_object_input_list of length {g.size()}")

    encs: List[Optional[_Encoded]] = []
    why = b""
    if g.rank() == root:
        assert scatter_object_input_list is not None
        encs = [
            None if i == root else _try_encode(o, f"scatter_object_input_list[{i}]")
            for i, o in enumerate(scatter_object_input_list)
        ]
        why = b"; ".join(e.why for e in encs if e is not None and e.data is None)[:_WHY_LIMIT]
    mode = _safe_mode(g, safe, allowed)
    first_bad = next((e for e in encs if e is not None and e.data is None), None)

    def run(c: Any) -> None:
        if c.rank == root:
            assert scatter_object_input_list is not None
            reqs = []
            keep = []  # payloads stay alive until their sends complete
            for i, o in enumerate(scatter_object_input_list):
                if i == root:
                    if not why:
                        scatter_object_output_list[0] = o
                    continue
                e = encs[i]
                assert e is not None
                data = e.data if not why else np.frombuffer(why, np.uint8)
                assert data is not None
                size = np.array([data.nbytes if not why else -1 - len(why)], _I64)
                keep += [size, data]
                reqs.append(c.isend(i, size, step=0))
                reqs.append(c.isend(i, data, step=1))
            c.wait_all(reqs)
            if why:
                raise _pickling_error([(c.ranks[root], why)], first_bad)
        else:
            n = np.zeros(1, _I64)
            c.recv(root, n, step=0)
            data = np.empty(int(n[0]) if n[0] >= 0 else _marker_len(int(n[0])), np.uint8)
            c.recv(root, data, step=1)
            if n[0] < 0:
                raise _pickling_error([(c.ranks[root], data.tobytes())])
            scatter_object_output_list[0] = _decode(data, mode, c.ranks[root])

    g.run("scatter_object_list", run, signature=("scatter_object_list", f"root={root}"))


def send_object_list(
    object_list: List[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_dst: Optional[int] = None,
) -> None:
    """Send the picklable objects of ``object_list`` to ``dst`` (see recv_object_list)."""
    g = _group(group, "send_object_list")
    if g is None:
        return
    peer = _peer(g, "send_object_list", dst, group_dst, "dst")
    t = g.world.transport
    tag = p2p_tag(g.gid, (1 << 39) | 0, 0, g.gen)  # tags above 2**39 are reserved for object p2p
    dl = g._deadline(None)
    try:
        total, segs = payload.dumps(list(object_list))
    except Exception as e:  # noqa: BLE001 - any error of pickling: tell the receiver, then raise here
        why = _culprit("object_list", list(object_list), e)
        t.send(peer, tag, np.array([-1, len(why)], _I64), dl)
        t.send(peer, tag, np.frombuffer(why, np.uint8), dl)
        err = _pickling_error([(g.world.rank, why)], _Encoded(None, why, e))
        raise ObjectPicklingError(
            f"send_object_list on rank {g.world.rank} to rank {peer}: {err}", ranks=err.ranks
        ) from e
    t.send(peer, tag, np.array([total, len(segs)], _I64), dl)
    t.send(peer, tag, np.array([s.nbytes for s in segs], _I64), dl)
    for s in segs:
        t.send(peer, tag, s, dl)


def recv_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Any = None,
    group_src: Optional[int] = None,
    *,
    safe: Optional[bool] = None,
    allowed: Optional[Iterable[str]] = None,
) -> int:
    """Fill ``object_list`` in place from ``src`` (any rank when None); returns the sender's global rank."""
    g = _group(group, "recv_object_list")
    if g is None:
        return -1
    peer = _peer(g, "recv_object_list", src, group_src, "src", allow_any=True)
    t = g.world.transport
    tag = p2p_tag(g.gid, (1 << 39) | 0, 0, g.gen)
    dl = g._deadline(None)
    head = np.zeros(2, _I64)
    sender = t.recv(peer, tag, head, dl).source
    total, nseg = int(head[0]), int(head[1])
    if total == -1 and 0 <= nseg <= _WHY_LIMIT:  # the sender could not pickle: its description follows
        why = np.empty(nseg, np.uint8)
        t.recv(sender, tag, why, dl)
        err = _pickling_error([(sender, why.tobytes())])
        raise ObjectPicklingError(f"recv_object_list on rank {g.world.rank} from rank {sender}: {err}", ranks=[sender])
    if not 0 < nseg <= payload.MAX_BUFFERS + 2:
        raise ConfigError(f"recv_object_list: rank {sender} announced {nseg} segments")
    lens_a = np.zeros(nseg, _I64)
    t.recv(sender, tag, lens_a, dl)
    lens = [int(x) for x in lens_a]
    if sum(lens) != total:
        raise ConfigError(f"recv_object_list: inconsistent header from rank {sender}")
    buf = np.empty(total, np.uint8)
    pos = 0
    for ln in lens:
        t.recv(sender, tag, buf[pos : pos + ln], dl)
        pos += ln
    try:
        got = _decode(buf, _safe_mode(g, safe, allowed), sender)
    except UnsafeObjectError as e:
        raise UnsafeObjectError(f"recv_object_list on rank {g.world.rank}: {e}", name=e.name) from None
    if len(got) != len(object_list):
        raise ConfigError(
            f"recv_object_list: rank {sender} sent {len(got)} objects but object_list has {len(object_list)} "
            "slots; use lists of the same length"
        )
    object_list[:] = got
    return sender
