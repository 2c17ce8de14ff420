"""Subgroup creation: new_group, new_subgroups, split_group (torch.distributed's signatures).

Every member agrees on a new group's id through the world's store; the groups are recorded in the
global state so that destroy_process_group and the watchdog see them.

Ids are reused (at most GID_LIMIT groups alive at once, any number over a job's life): the group's lowest
rank takes a released id from a free list in the store (else a fresh one) and publishes "gid:generation"
under an agreement key that the last member through deletes.  destroy_process_group(group) on a member
releases it; only when every member has released it does the last one delete the id's watchdog keys and
push (gid, generation + 1) on the free list, so a group destroyed by only some members keeps its id.  The
generation is mixed into the collective tags' fingerprint bits (a straggler of an old incarnation never
matches the new one unless 65,536 incarnations apart), and its low 3 bits into the p2p tags (bits 59-61: a
p2p message left unreceived by a destroyed group matches none of the next 7 incarnations' receives); a reused
id gets no shared-memory arena (the arena is keyed by gid).
"""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence, Tuple

from .config import ENV, to_seconds
from .errors import ConfigError, DistTimeoutError, StoreTimeoutError, format_ranks
from .objects import all_gather_object
from .process_group import ProcessGroup
from .state import GroupMember, _state, default_group, resolve_group
from .tags import GID_LIMIT

__all__ = ["new_group", "new_subgroups", "split_group", "release_gid"]


def _seconds(timeout: Any, default: float) -> float:
    """``timeout`` (seconds or a timedelta) as seconds, ``default`` when None; ConfigError when not > 0."""
    t = to_seconds(timeout)
    return default if t is None else t


def _pop_free(store: Any, rank: int, timeout: float) -> Optional[Tuple[int, int]]:
    """Take (gid, generation) off the world's free list of released group ids, or None when it is empty.

    The list is a queue in the store: ``gid_free_tail`` counts pushes, ``gid_free/<i>`` holds the i-th
    released id; ``gid_free_head`` ("<pops>:<rank>") is advanced by compare_set so that two allocating ranks
    never take the same entry (the rank makes each popper's value unique).
    """
    while True:
        tail = int(store.add("gid_free_tail", 0))
        cur = store.get("gid_free_head", timeout=timeout).decode() if store.check(["gid_free_head"]) else ""
        head = int(cur.split(":")[0]) if cur else 0
        if head >= tail:
            return None
        want = f"{head + 1}:{rank}"
        if store.compare_set("gid_free_head", cur, want).decode() != want:
            continue  # another rank popped first: look again
        entry = f"gid_free/{head + 1}"
        gid, gen = (int(x) for x in store.get(entry, timeout=timeout).decode().split(":"))
        store.delete_key(entry)
        return gid, gen


def release_gid(group: ProcessGroup) -> None:
    """A member's destroy_process_group(group): once every member released it, the id goes back to the pool.

    The last member to release deletes the id's watchdog keys (so the next incarnation starts neither broken
    nor with a stale roll call) and pushes (gid, generation + 1) on the free list.  An id whose members do not
    all destroy the group (one exits first) is not reused: ids only come back when every member let go.
    """
    store = group.world.store
    if store is None or group.gid == 0 or not group.is_member() or group.world.forked():
        return
    if group.world.engine is not None:  # the mpi backend: MPI_Comm_create_group for a reused id hung in Open MPI
        return  # (ranks 1, 2 after a destroyed [0, 1] of the same id), so there ids stay unique, as before
    gid, gen = group.gid, group.gen
    rel = f"gidrel/{gid}/{gen}"
    if int(store.add(rel, 1)) < len(group.ranks):
        return
    keys = [rel, f"wd/abort/{gid}", f"wd/broken/{gid}"]
    keys += [f"wd/{gid}/{r}" for r in group.ranks] + [f"wd/hist/{gid}/{r}" for r in group.ranks]
    for k in keys:
        store.delete_key(k)
    i = int(store.add("gid_free_tail", 1))
    store.set(f"gid_free/{i}", f"{gid}:{gen + 1}".encode())


def _alloc_gid(parent: ProcessGroup, ranks: Sequence[int], timeout: float) -> Tuple[int, int]:
    """Agree on a world-unique (id, generation) for a new group: its lowest rank allocates it through the
    store (a released id first, else a fresh one) and the other members read it; -1 on non-members."""
    world = parent.world
    k = parent._child_groups
    parent._child_groups += 1
    if world.store is None:  # no store (mpi backend): deterministic ids from the parent
        return (parent.gid * 131 + k + 1) % GID_LIMIT or 1, 0
    if world.rank not in ranks:
        return -1, 0
    store = world.store
    key = f"gid/{parent.gid}.{parent.gen}/{k}/{min(ranks)}"  # the parent's generation: its id may be reused
    got: Optional[Tuple[int, int]] = None
    if world.rank == min(ranks):
        got = _pop_free(store, world.rank, timeout)
        if got is None:
            got = (int(store.add("gid_counter", 1)), 0)
        if len(ranks) == 1:
            return got
        store.set(key, f"{got[0]}:{got[1]}".encode())  # before checking in: once all are in, every member reads it
    _check_in(world, key, ranks, timeout)
    if got is None:
        gid, gen = (int(x) for x in store.get(key, timeout=timeout).decode().split(":"))
        got = (gid, gen)
    if int(store.add(f"{key}/done", 1)) == len(ranks):  # the last member through cleans the agreement up
        for k2 in [key, f"{key}/n", f"{key}/all", f"{key}/done"] + [f"{key}/in/{r}" for r in ranks]:
            store.delete_key(k2)
    return got


def _check_in(world: Any, key: str, ranks: Sequence[int], timeout: float) -> None:
    """Barrier of the new group's members over the store: ``<key>/in/<rank>`` per member, a counter, and
    ``<key>/all`` set by the last to arrive.  DistTimeoutError naming the members that never called new_group."""
    st = world.store
    t0 = time.monotonic()
    st.set(f"{key}/in/{world.rank}", b"1")
    if int(st.add(f"{key}/n", 1)) == len(ranks):
        st.set(f"{key}/all", b"1")
    try:
        st.wait([f"{key}/all"], timeout=timeout)
    except StoreTimeoutError:
        called = [r for r in ranks if st.check([f"{key}/in/{r}"])]
        never = [r for r in ranks if r not in called]
        raise DistTimeoutError(
            f"new_group(ranks={format_ranks(ranks)}) on rank {world.rank} timed out after "
            f"{time.monotonic() - t0:.1f}s: rank{'s' if len(called) > 1 else ''} {format_ranks(called)} called it, "
            f"rank{'s' if len(never) > 1 else ''} {format_ranks(never)} never did. Every rank must call new_group "
            "(and subgroup creation) in the same order, as in torch; call it on those ranks too, or raise the "
            f"deadline with new_group(timeout=) / {ENV.TIMEOUT}"
        ) from None


def new_group(
    ranks: Optional[Sequence[int]] = None,
    timeout: Any = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
) -> Any:
    """A group of the given global ranks; every rank of the world must call it, in the same order (as torch).

    Returns the new ProcessGroup, or NON_GROUP_MEMBER on ranks outside ``ranks``.  Raises ConfigError for
    duplicate, out-of-range or no ranks, NotInitializedError before init.
    """
    parent = default_group("new_group")
    world = parent.world
    rs = sorted(set(range(world.size) if ranks is None else (int(r) for r in ranks)))
    if ranks is not None and len(rs) != len(list(ranks)):
        raise ConfigError(f"new_group(ranks={list(ranks)}) lists a rank twice")
    bad = [r for r in rs if not 0 <= r < world.size]
    if bad:
        raise ConfigError(f"new_group: ranks {bad} are outside [0, {world.size})")
    if not rs:
        raise ConfigError("new_group(ranks=[]): a group needs at least one rank")
    tmo = _seconds(timeout, world.timeout)
    return _make_group(parent, rs, tmo, group_desc)


def _make_group(parent: ProcessGroup, rs: List[int], tmo: float, desc: Optional[str]) -> Any:
    """Make the group of global ranks ``rs`` (collective over the parent's world) and record it."""
    if parent._halt is not None:  # forked, broken or destroyed: no store traffic on the parent's behalf
        raise parent.halted("new_group")
    gid, gen = _alloc_gid(parent, rs, tmo)
    if gid < 0:
        return GroupMember.NON_GROUP_MEMBER
    pg = ProcessGroup(parent.world, rs, gid, desc or f"group{gid}{rs if len(rs) <= 8 else ''}", tmo, gen=gen)
    pg.set_home_thread()
    if parent.world is _state.world:  # a group of a world from backends.create_group stays out of the globals
        _state.groups.append(pg)
    return pg


def new_subgroups(
    group_size: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    timeout: Any = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
) -> Tuple[Any, List[Any]]:
    """Split the world into subgroups: one per host by default, else consecutive blocks of ``group_size``.

    Returns (the subgroup of this rank, all subgroups this rank is a member of or knows) like torch.
    """
    parent = default_group("new_subgroups")
    world = parent.world
    if group_size is None:
        order: List[str] = []
        for h in world.hosts:
            if h not in order:
                order.append(h)
        blocks = [[r for r in range(world.size) if world.hosts[r] == h] for h in order]
    else:
        if group_size <= 0 or world.size % group_size:
            raise ConfigError(
                f"new_subgroups(group_size={group_size}): the world size {world.size} must be a positive multiple of it"
            )
        blocks = [list(range(i, i + group_size)) for i in range(0, world.size, group_size)]
    tmo = _seconds(timeout, world.timeout)
    mine = None
    groups = []
    for b in blocks:
        g = _make_group(parent, b, tmo, group_desc)
        groups.append(g)
        if world.rank in b:
            mine = g
    return mine, groups


def split_group(
    parent_pg: Optional[ProcessGroup] = None,
    split_ranks: Optional[Sequence[Sequence[int]]] = None,
    timeout: Any = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
    *,
    color: Optional[int] = None,
    key: Optional[int] = None,
) -> Any:
    """Split ``parent_pg`` (default: world) into disjoint groups.

    Either ``split_ranks`` (torch's form: a list of disjoint global-rank lists, the same on every member),
    or MPI's ``color``/``key``: members with the same colour form a group, ordered by (key, rank);
    ``color=None`` with ``split_ranks=None`` is an error; a negative colour opts out.
    Only members of the parent call it.  Returns this rank's new group or NON_GROUP_MEMBER.
    """
    parent = resolve_group(parent_pg, "split_group")
    if not parent.is_member():
        raise ConfigError("split_group must be called by members of the parent group only")
    tmo = _seconds(timeout, parent.timeout)
    if split_ranks is not None:
        if color is not None:
            raise ConfigError("split_group: pass split_ranks= or color=, not both")
        seen: set = set()
        blocks = []
        for b in split_ranks:
            b = sorted(int(r) for r in b)
            for r in b:
                if r not in parent.ranks:
                    raise ConfigError(f"split_group: rank {r} is not in the parent group {parent.ranks}")
                if r in seen:
                    raise ConfigError(f"split_group: rank {r} appears in two splits; splits must be disjoint")
                seen.add(r)
            blocks.append(b)
    else:
        if color is None:
            raise ConfigError("split_group needs split_ranks=[[...], ...] or color= (and optionally key=)")
        mine = (int(color), int(key if key is not None else parent.rank()), parent.world.rank)
        got: List[Any] = [None] * parent.size()
        all_gather_object(got, mine, group=parent, safe=True)  # three ints: never needs more
        colors = sorted({c for c, _, _ in got if c >= 0})
        blocks = [[g for _, _, g in sorted(t for t in got if t[0] == c)] for c in colors]
    result: Any = GroupMember.NON_GROUP_MEMBER
    for b in blocks:
        g = _make_group(parent, b, tmo, group_desc) if parent.world.rank in b else None
        if g is None:
            parent._child_groups += 1  # keep the parent's counter in step with the members of b
        else:
            result = g
    return result
