"""Issue 11 item 4: the group-id allocator reuses released ids (create/destroy cycles at the id limit)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from procgroup.process_group import GID_LIMIT, collective_tag
from procgroup.subgroups import _alloc_gid, release_gid

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_check_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks here run one after the other, so the members' check-in barrier of new_group (item 16.3, tested
    with real processes in tests/integration/test_identity_hardening_procs.py) is left out: this is the allocator."""
    monkeypatch.setattr("procgroup.subgroups._check_in", lambda *a, **k: None)


class DictStore:
    """The store operations the allocator uses, over a dict (one process, no blocking needed)."""

    def __init__(self) -> None:
        self.d: dict = {}

    def add(self, key, amount):
        v = int(self.d.get(key, b"0")) + amount
        self.d[key] = str(v).encode()
        return v

    def set(self, key, value):
        self.d[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key, timeout=None):
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def compare_set(self, key, expected, desired):
        cur = self.d.get(key)
        if (cur is None and expected == "") or (cur is not None and cur.decode() == expected):
            self.d[key] = desired.encode()
        return self.d.get(key, expected.encode() if isinstance(expected, str) else expected)

    def delete_key(self, key):
        return self.d.pop(key, None) is not None


def _rank(store, r):
    world = SimpleNamespace(store=store, rank=r, forked=lambda: False, engine=None)
    return SimpleNamespace(world=world, gid=0, gen=0, _child_groups=0)


def _group(parent, ranks, gid, gen):
    return SimpleNamespace(
        world=parent.world, gid=gid, gen=gen, ranks=ranks, is_member=lambda: parent.world.rank in ranks
    )


def test_create_destroy_cycles_at_the_id_limit_with_a_long_lived_group():
    """10,000 create/destroy cycles at N=2 with a long-lived group, from a store set as after 2**31 cycles.

    This ran a million cycles from an empty store (22 s) so that ids had to come back.  The allocator's state is
    three counters in the store (fresh ids, free-list pushes, free-list pops) and a generation per id; the only
    bound is GID_LIMIT on the ids.  So the store starts as if every id below GID_LIMIT - 3 had been handed out
    and the free list had been pushed and popped 2**31 - 5,000 times: the long-lived group and the first cycle
    take the last two fresh ids, and every later cycle needs a reused one (without reuse the second cycle gets
    GID_LIMIT; checked by making release_gid return at once), while the free-list counters cross 2**31.  Each
    reuse must be the next incarnation of the id, and the store must not grow (a key leaked per cycle would add
    10,000).
    """
    cycles, pos = 10_000, (1 << 31) - 5_000
    store = DictStore()
    store.set("gid_counter", str(GID_LIMIT - 3))
    store.set("gid_free_tail", str(pos))
    store.set("gid_free_head", f"{pos}:0")  # head == tail: the free list is empty
    parents = [_rank(store, 0), _rank(store, 1)]
    ranks = [0, 1]
    keep = [_alloc_gid(p, ranks, 1.0) for p in parents]  # the long-lived group: never released
    assert keep[0] == keep[1] == (GID_LIMIT - 2, 0)
    t0 = time.monotonic()
    seen = set()
    gens = {}
    for i in range(cycles):
        got = [_alloc_gid(p, ranks, 1.0) for p in parents]  # rank 0 allocates first, as min(ranks)
        assert got[0] == got[1] and got[0][0] != keep[0][0] and 0 < got[0][0] < GID_LIMIT, (i, got)
        gid, gen = got[0]
        assert gen == gens.get(gid, -1) + 1, (i, got, gens)  # each reuse is the next incarnation
        gens[gid] = gen
        seen.add(gid)
        for p in parents:
            release_gid(_group(p, ranks, gid, gen))
    dt = time.monotonic() - t0
    assert len(seen) <= 2, seen  # ids come back: the pool never grows past what was alive at once
    assert got[0][1] >= cycles - 2
    assert int(store.d["gid_free_tail"]) >= pos + cycles - 2 > 1 << 31  # the free-list counters went past 2**31
    # the store does not grow: agreement, release and free-list entries were all deleted
    assert len(store.d) < 16, sorted(store.d)
    print(f"{cycles:,} cycles in {dt:.2f}s ({cycles / dt:.0f}/s)")


def test_an_id_comes_back_only_when_every_member_released_it():
    store = DictStore()
    parents = [_rank(store, 0), _rank(store, 1)]
    a = [_alloc_gid(p, [0, 1], 1.0) for p in parents][0]
    release_gid(_group(parents[0], [0, 1], *a))  # rank 1 still holds the group
    b = [_alloc_gid(p, [0, 1], 1.0) for p in parents][0]
    assert b[0] != a[0]
    release_gid(_group(parents[1], [0, 1], *a))
    c = [_alloc_gid(p, [0, 1], 1.0) for p in parents][0]
    assert c == (a[0], a[1] + 1)


def test_release_clears_the_watchdog_state_of_the_id():
    store = DictStore()
    parents = [_rank(store, 0), _rank(store, 1)]
    gid, gen = [_alloc_gid(p, [0, 1], 1.0) for p in parents][0]
    for k in (f"wd/broken/{gid}", f"wd/abort/{gid}", f"wd/{gid}/0", f"wd/{gid}/1", f"wd/hist/{gid}/1"):
        store.set(k, b"old")
    for p in parents:
        release_gid(_group(p, [0, 1], gid, gen))
    assert not [k for k in store.d if k.startswith("wd/")]


def test_generations_give_different_collective_tags():
    from procgroup.process_group import FP_MASK

    tags = {collective_tag(5, 0, 0x1234 ^ ((g * 40503) & FP_MASK)) for g in range(1 << 16)}
    assert len(tags) == 1 << 16


def test_generations_give_different_p2p_tags():
    """A p2p message of incarnation g never matches a receive of incarnations g+1..g+7 of the same id (same
    user tag and dtype), and the generation bits stay clear of the dtype code, the id and the user tag."""
    from procgroup.process_group import P2P_CODE_MASK, P2P_TAG_LIMIT, p2p_tag

    tags = [p2p_tag(5, 7, 3, g) for g in range(8)]
    assert len(set(tags)) == 8
    for t in tags:
        assert (t & P2P_CODE_MASK) == (p2p_tag(5, 7, 3) & P2P_CODE_MASK)  # the dtype probe masks the code only
        assert ((t >> 40) & ((1 << 14) - 1)) == 5 and t % P2P_TAG_LIMIT == 7 and t >> 62 == 1
    assert p2p_tag(GID_LIMIT - 1, P2P_TAG_LIMIT - 1, 31, 7) < 1 << 63
