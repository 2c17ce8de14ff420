"""Argument resolution shared by the collectives and the object collectives: group, root and peer ranks.

Ranks passed as ``src``/``dst``/``peer`` are *global* ranks (as torch); the ``group_src``/``group_dst``/
``group_peer`` keywords take ranks within the group.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import ConfigError
from .process_group import ProcessGroup
from .state import member_group
from .transport.base import ANY_SOURCE

__all__ = ["member_group", "root_rank", "peer_rank", "device_ops", "API_SLOT_A", "API_SLOT_B", "API_SLOT_C"]

#: scratch slots of the API layer (the algorithms use small slot numbers; see algorithms/_util.py)
API_SLOT_A, API_SLOT_B, API_SLOT_C = 101, 102, 103


def root_rank(
    g: ProcessGroup, op: str, rank: Optional[int], group_rank: Optional[int], name: str, default: Optional[int] = None
) -> int:
    """The group rank of a root given as global ``rank`` or ``group_rank`` (``default``: group rank if neither).

    Raises :class:`ConfigError` when both are given, when neither is and there is no default, or when the
    rank is not in the group (naming ``name``, e.g. "src").
    """
    if rank is not None and group_rank is not None:
        raise ConfigError(f"{op}: pass {name}= (global rank) or group_{name}= (rank in the group), not both")
    if group_rank is not None:
        if not 0 <= group_rank < g.size():
            raise ConfigError(f"{op}: group_{name}={group_rank} is outside [0, {g.size()}) for group {g.name}")
        return int(group_rank)
    if rank is None:
        if default is None:
            raise ConfigError(f"{op}: {name}= is required")
        rank = g.ranks[default]
    if int(rank) not in g.ranks:
        raise ConfigError(
            f"{op}: {name}={rank} is not a rank of group {g.name} (its global ranks are {g.ranks}); "
            f"{name} is a global rank, use group_{name}= for a rank within the group"
        )
    return g.ranks.index(int(rank))


def peer_rank(
    g: ProcessGroup, op: str, peer: Optional[int], group_peer: Optional[int], name: str, allow_any: bool = False
) -> int:
    """Global rank of a point-to-point peer (ANY_SOURCE when neither is given and ``allow_any``).

    Raises :class:`ConfigError` when the peer is missing, outside the group, or this rank itself.
    """
    if peer is None and group_peer is None:
        if allow_any:
            return ANY_SOURCE
        raise ConfigError(f"{op}: {name}= is required")
    gr = root_rank(g, op, peer, group_peer, name)
    gl = g.ranks[gr]
    if gl == g.world.rank:
        raise ConfigError(f"{op}: rank {gl} cannot {op} to/from itself ({name}={gl}); pick another rank")
    return gl


def device_ops(g: ProcessGroup, err: BaseException) -> Any:
    """The device collectives of ``g``'s world that carry the device of ``err`` (a DeviceTensorError), else
    raise ``err``: a CUDA tensor on the cpu backend stays the ConfigError that names the fix."""
    eng = g.world.engine
    dev = getattr(getattr(err, "device", None), "type", None)
    if eng is None or dev not in eng.device_types:
        raise err
    return eng.device_ops
