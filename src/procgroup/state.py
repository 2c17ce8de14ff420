"""The process's global state (the default group and every group it made) and group resolution.

A leaf below the API modules: lifecycle (``api``), subgroup creation (``subgroups``), the
collectives and the debugging aids all read it; it imports none of them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional

from .config import RuntimeConfig
from .errors import ConfigError, NotInitializedError
from .process_group import ProcessGroup, World

__all__ = ["GroupMember", "group", "default_group", "resolve_group", "member_group"]


@dataclass
class _State:
    world: Optional[World] = None
    default: Optional[ProcessGroup] = None
    groups: List[ProcessGroup] = field(default_factory=list)
    backend: str = "cpu"
    store_server: Any = None
    file_path: Optional[str] = None
    prefix_store: Any = None
    base_store: Any = None
    #: ((host, port), connect) of procgroup's own TCPStore, which torch's env:// rendezvous may share
    store_for_torch: Any = None
    #: connections to that store handed to torch (the store's host then keeps serving after destroy)
    torch_store_users: int = 0
    #: the configuration parsed by init_process_group (None before init)
    config: Optional[RuntimeConfig] = None
    lock: threading.RLock = field(default_factory=threading.RLock)


_state = _State()


class _NonMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802 - torch's spelling
        return _state.default


class GroupMember(metaclass=_GroupMemberMeta):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` is returned to non-members."""

    NON_GROUP_MEMBER = _NonMember()


class group(metaclass=_GroupMemberMeta):  # noqa: N801 - torch's spelling: dist.group.WORLD
    """torch's ``dist.group``: ``group.WORLD`` is the default group (None before init)."""


def default_group(what: str = "this call") -> ProcessGroup:
    """The default (world) group; :class:`NotInitializedError` naming ``what`` before init."""
    if _state.default is None:
        raise NotInitializedError(what)
    return _state.default


def resolve_group(group: Optional[ProcessGroup], what: str) -> ProcessGroup:
    """``group``, or the default group when None.

    Raises :class:`ConfigError` for NON_GROUP_MEMBER or anything that is not a ProcessGroup, and
    :class:`NotInitializedError` for None before init.  Any ProcessGroup is accepted, also one made by
    :func:`procgroup.backends.create_group` outside the global state.
    """
    if group is None:
        return default_group(what)
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ConfigError(f"{what}: this rank is not a member of that group (new_group returned NON_GROUP_MEMBER here)")
    if not isinstance(group, ProcessGroup):
        raise ConfigError(f"{what}: group must be a ProcessGroup from new_group(), got {type(group).__name__}")
    return group


def member_group(group: Any, op: str) -> Optional[ProcessGroup]:
    """The group, or None when this rank is not a member (the call is then a no-op, as in torch)."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    g = resolve_group(group, op)
    if g._halt is not None:  # destroyed, broken (or forked): refuse before anything is posted
        raise g.halted(op)
    return g if g.is_member() else None
