"""The size limits between the shared-memory algorithms of one host, and the questions the choices ask them.

``algorithms.select`` chooses with them and re-exports them: ``select.BIG_LIMIT`` is this module's dict, so a
change through either name is the same change.  The plans (``procgroup.plans``) ask the same functions, so a plan
and the selection always decide alike.  Every table maps a collective to bytes (what the bytes count: the table in
``algorithms.select``'s docstring):

=================  ===================================================================================
table              meaning
=================  ===================================================================================
BIG_LIMIT          the most bytes that go through the big slots (``algorithms.bigarena``)
BIG_LIMIT_PAIR     ... for a group of two, where lower
BIG_MIN_PAIR       the fewest bytes above which a group of two takes the big slots; below, it reads
ONECOPY_MIN        the fewest bytes above which three or more ranks read the parts straight out of their
                   owners' memory (``algorithms.onecopy``) where the big slots do not take the call
ONECOPY_MIN_PAIR   ... for a group of two
=================  ===================================================================================

``PAIR_SPLIT_MIN`` (bytes): a group of two splits a broadcast above it between its two CPUs.

The measurements behind every value are in the comments beside it (``benchmarks/results/pass*``).
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = [
    "BIG_LIMIT",
    "BIG_LIMIT_PAIR",
    "BIG_MIN_PAIR",
    "ONECOPY_MIN",
    "ONECOPY_MIN_PAIR",
    "PAIR_SPLIT_MIN",
    "big_limit",
    "big_slots_for",
    "onecopy_for",
]

#: collective -> the most bytes (see the table in the docstring) that go through the big slots
BIG_LIMIT: Dict[str, int] = {
    "all_reduce": 1 << 62,
    "reduce": 1 << 62,
    "reduce_scatter": 1 << 62,
    "broadcast": 4 << 20,
    "all_gather": 256 << 10,
    "all_to_all": 1 << 20,
}
#: collective -> a lower BIG_LIMIT for a group of two ranks.  A broadcast through the big slots copies the data
#: twice (the root into the slots, the other rank out of them, pipelined on both CPUs).  Above this limit a pair
#: splits the one copy between its two CPUs instead (``algorithms.onecopy.bcast_pair``: the root writes half into
#: the other rank's buffer while that rank reads the other half).  N=2 on the 2-CPU host (pass 18, whole jobs
#: alternating, slowest rank per call, median, us), big slots (the rendezvous above 32 MiB, where the limit was)
#: against the split: 4 MiB 91 / 124, 5 MiB 110-145 / 118-151, 6 MiB 130-200 / 111-159, 8 MiB 170-245 / 108-168,
#: 16 MiB 531-959 / 321-618, 32 MiB 1242-1995 / 1117-1478, 48 MiB (the rendezvous, two reading threads) 1771-2367 /
#: 1765-2364.  At N=4 the big slots still lead (64 MiB 0.99x, and 0.73x the one-copy reads): every reader reading
#: the root's memory at once is slower.  Pass 21's VM (its slow periods make a store into a line the other CPU
#: holds cost 4x; benchmarks/results/pass21, same method, 4-5 rounds): big against split 1.5 MiB 86-144 / 102-123,
#: 2 MiB 111-145 / 124-153, 3 MiB 172-226 / 172-207, 4 MiB 224-1828 / 165-238 (split ahead in 9 of 9 rounds): the
#: limit is 3 MiB.  A pair's all_gather above the arena's slot never takes the big slots: each rank reads the other's
#: part straight out of its ``sendbuf`` instead (``ONECOPY_MIN_PAIR``; the big slots stay for a pair that cannot).
#: all_to_all: a pair reads every stream that is not inline in its header (``BIG_LIMIT['all_to_all']`` compares the
#: longest stream; ``alltoall_shm``'s reads, inside its compiled call).  Pass 23 (benchmarks/results/pass23, whole
#: jobs alternating, 12 rounds, slowest rank per call, median over calls; min-max over jobs, median of the jobs),
#: a rank's buffer, big slots / reads / Open MPI, us: 64 KiB 8-22 (12) / 8-14 (9) / 7-13 (10), 256 KiB 21-93 (30) /
#: 18-27 (19) / 16-26 (23), 512 KiB 25-167 (36) / 33-57 (34) / 30-46 (37), 1 MiB 42-316 (55) / 58-78 (60) / 56-84
#: (68), 2 MiB 101-693 (145) / 109-147 (112) / 108-175 (126).  The big slots' spread is the VM's slow mode: in some
#: jobs every store into a line the other CPU holds costs 3-4x, for the whole job (a2a 256 KiB 69-70 in 5 of 8
#: jobs of one run, 20-30 in the others, Open MPI 22-25 in every job); the reads store into no shared line.
BIG_LIMIT_PAIR: Dict[str, int] = {"broadcast": 3 << 20, "all_gather": 0, "all_to_all": 0}
#: collective -> the fewest bytes above which a group of two ranks takes the big slots (up to ``BIG_LIMIT_PAIR``);
#: from the arena's slot up to here the pair reads instead (``ONECOPY_MIN_PAIR``).  broadcast: the reader copies
#: the root's buffer once and stores into no shared line, so the VM's slow mode (above) does not reach it; the big
#: slots' two copies on both CPUs win from 512 KiB in the fast mode.  Pass 23, same jobs, big slots / reads / Open
#: MPI: 64 KiB 10-33 (10) / 10-15 (10) / 8-10 (9), 128 KiB 17-62 (18) / 15-21 (16) / 12-17 (13), 256 KiB 26-119
#: (30) / 24-34 (27) / 22-30 (23), 512 KiB 27-226 (29) / 46-69 (50) / 42-57 (43), 1 MiB 51-445 (54) / 85-118 (95) /
#: 81-110 (83)
BIG_MIN_PAIR: Dict[str, int] = {"broadcast": 256 << 10}
#: collective -> the fewest bytes above which a group of three or more ranks of one host reads the parts straight out of
#: their owners' memory (``algorithms.onecopy``) where the big slots do not take the call.  Where a group has big slots,
#: ``BIG_LIMIT`` decides: the reads take only what is above it (broadcast 4 MiB, all_gather 256 KiB, where the compiled
#: reads overtake the big slots; the reductions never).  So these values decide between the reads and the messages for a
#: group without big slots (a host's fifth group and later, ``layout.BIG_GROUPS``; a /dev/shm too small for them,
#: ``layout.choose_big_slot``; ``PROCGROUP_SHM_BIG_SLOT=0``).  Pass 24 (benchmarks/results/pass24, whole jobs
#: alternating, 3 rounds, slowest rank per call, median, us; PROCGROUP_SHM_BIG_SLOT=0), N=4, messages / reads / Open
#: MPI: broadcast 64 KiB 23-38 / 30-39 / 25-32, 256 KiB 84-141 / 67-88 / 64-81, 1 MiB 1147-1648 / 241-321 / 212-417,
#: 4 MiB 4499-5521 / 750-1070 / 649-1046; all_gather (a rank's part) 64 KiB 243-441 / 62-90 / 71-110, 256 KiB 529-854
#: / 197-265 / 189-296.  all_reduce and reduce_scatter (``onecopy.allreduce_onecopy``, ``reduce_scatter_onecopy``;
#: bytes of the buffer, of the sendbuf), reads / messages / big slots (a group that has them) / Open MPI: all_reduce
#: 64 KiB 119-128 / 241-381 / 77-125 / 101-114, 256 KiB 232-291 / 522-978 / 167-283 / 224-258, 1 MiB 688-893 /
#: 1437-3036 / 585-886 / 544-643, 4 MiB 3940-6348 / 8751-13047 / 3352-5169 / 3235-4058; reduce_scatter 256 KiB
#: 98-176 / 429-564 / 78-146 / 93-128, 1 MiB 341-521 / 676-1062 / 193-387 / 290-415, 4 MiB 1898-2881 / 2758-4444 /
#: 1068-1458 / 9452-11716.  The big slots stay ahead of the reductions' reads where a group has them: the reads pull
#: lines the owner's CPU just wrote (its reduction, its gradients), which costs this VM several times a read of clean
#: memory (N=2 all_reduce 256 KiB: reads 93-96, big 37-52).  reduce stays on the messages: a root that read every
#: other rank's buffer (tried in pass 24, not kept) keeps the others waiting until it has, where the messages let them
#: go (N=4 messages / reads / big slots / Open MPI: 64 KiB 27-29 / 82-99 / 36-37 / 32-33, 256 KiB 349-461 / 273-283 /
#: 101-106 / 95-97, 1 MiB 734-1019 / 1052-1114 / 262-321 / 348-351; N=2 64 KiB 13 / 14-15 / 10 / 9-13, 1 MiB 111-136
#: / 172-179 / 71-72 / 108-132).
#: The big slots' side of broadcast and all_gather, behind ``BIG_LIMIT`` (pass 22, N=4, whole jobs alternating, 4
#: rounds), big slots / reads / Open MPI: broadcast 1 MiB 135-249 / 265-309 / 232-1335, 4 MiB 512-802 / 752-893 /
#: 658-3412 (big ahead in 3 of 4), 6 MiB 1544-2104 / 886-1650 / 1501-2658 (reads 4 of 4), 8 MiB 2396-2902 / 1613-2061 /
#: 2041-3683, 16 MiB 4200-4610 / 3270-3928 / 3389-8175, 32 MiB 9398-12761 / 7234-8128 / 7955-13448, 64 MiB
#: 17391-19693 / 13878-16188 / 15074-26122 (4 of 4 each); all_gather, a rank's part: 64 KiB 67-104 / 71-95 / 106-292,
#: 128 KiB 114-181 / 100-148 / 162-490, 256 KiB 177-333 / 169-265 / 252-910 (even: 4 of 8 rounds each), 512 KiB
#: 450-603 / 332-462 / 481-1763 (reads 4 of 4), 1 MiB 1336-2128 / 864-1403 / 625-1095 (4 of 4), 4 MiB 4963-7038 /
#: 4084-6169 / 3871-5461 (4 of 4).  (In Python, before the compiled call, the reads lost at N=4: 256 KiB 415-442
#: against 180-218; the pure-Python path pays that here.)
ONECOPY_MIN: Dict[str, int] = {
    "broadcast": 64 << 10,
    "all_gather": 0,
    "all_reduce": 0,
    "reduce_scatter": 0,
}
#: collective -> the fewest bytes above which a group of two ranks of one host reads the other's part straight out
#: of its memory where the big slots do not take the call (``BIG_LIMIT_PAIR``).  all_gather (one copy and no store
#: into a shared line, where the big slots copy twice; ``onecopy.allgather_direct``, one C call on the compiled path:
#: ``Arena.bind_read``): above the arena's slot.  Pass 22 (benchmarks/results/pass22, whole jobs alternating, 6
#: rounds, slowest rank per call, median, us), a rank's part, big / reads / Open MPI: 64 KiB 19-51 / 14-16 / 13-19,
#: 128 KiB 32-98 / 22-26 / 20-38, 256 KiB 51-183 / 33-43 / 37-46, 512 KiB 94-345 / 57-76 / 67-83, 1 MiB 150-690 /
#: 107-144 / 130-172.  Within the slot the arena leads (8 / 16 / 32 KiB: arena 4-5 / 5-7 / 7-11, reads 9-10 /
#: 10-11 / 12, Open MPI 6-7 / 7-8 / 9-10).  Before the compiled call (pass 21, reads in Python) big / reads: 512 KiB
#: 82-103 / 80-111, 1 MiB 166-215 / 135-184, 2 MiB 363-457 / 269-356, 4 MiB 1065-1273 / 816-1013.  broadcast: a
#: pair reads wherever nothing else takes the call: the big slots (above ``BIG_MIN_PAIR``, up to ``BIG_LIMIT_PAIR``)
#: and the split above ``PAIR_SPLIT_MIN`` (``onecopy.bcast_pair``) come first (pass 23, ``BIG_MIN_PAIR``).
#: all_reduce and reduce_scatter: as ``ONECOPY_MIN`` (a pair without big slots).  Pass 24, the same jobs at N=2,
#: reads / messages / big slots / Open MPI: all_reduce 64 KiB 22-35 / 34-54 / 21-27 / 22-27, 256 KiB 69-103 /
#: 64-110 / 52-58 / 55-74, 1 MiB 192-259 / 212-320 / 98-136 / 160-199, 4 MiB 771-1004 / 1414-1611 / 579-1004 /
#: 759-1132; reduce_scatter 256 KiB 26-43 / 47-59 / 23-35 / 55-66, 1 MiB 93-145 / 105-118 / 40-66 / 206-232, 4 MiB
#: 336-553 / 429-556 / 170-256 / 3961-4303
ONECOPY_MIN_PAIR: Dict[str, int] = {"all_gather": 0, "broadcast": 0, "all_reduce": 0, "reduce_scatter": 0}

#: a group of two ranks of one host: a broadcast above this many bytes that the big slots do not take
#: (``BIG_LIMIT_PAIR``, or a pair without big slots) is split between the two (``algorithms.onecopy.bcast_pair``).
#: Without big slots (``PROCGROUP_SHM_BIG_SLOT=0``), against the rendezvous: 256 KiB 19-21 against 10-12 us, 1 MiB
#: 47-48 against 50, 2 MiB 85 against 155-160, 4 MiB 92-109 against 295-298
PAIR_SPLIT_MIN = 1 << 20


def big_limit(collective: str, members: int) -> int:
    """The most bytes of ``collective`` that go through the big slots of a group of ``members`` ranks
    (``BIG_LIMIT``, and ``BIG_LIMIT_PAIR`` for two)."""
    lim = BIG_LIMIT[collective]
    return min(lim, BIG_LIMIT_PAIR.get(collective, lim)) if members == 2 else lim


def big_slots_for(a: Any, collective: str, nbytes: int, floor: bool = True) -> Any:
    """The arena ``a``'s big slots where ``collective`` of ``nbytes`` takes them (above the arena's slot, within
    :func:`big_limit`, and for two members above ``BIG_MIN_PAIR`` unless not ``floor``: the host stages of a group
    spanning hosts, bound to the big slots by ``algorithms.hierbind``); else None (also for no arena).  The selection
    (``algorithms.select``) and the plans (``procgroup.plans``) decide alike through it."""
    big = None if a is None else a.big
    if big is None or not a.max_bytes < nbytes <= big_limit(collective, len(a.members)):
        return None
    return None if floor and len(a.members) == 2 and nbytes <= BIG_MIN_PAIR.get(collective, 0) else big


def onecopy_for(a: Any, collective: str, nbytes: int) -> bool:
    """True where the selection (``algorithms.select``) reads ``collective`` of ``nbytes`` (a member's) straight out
    of its owners' memory on a group with arena ``a``: above the arena's slot, not within the big slots
    (:func:`big_slots_for`) and above ``ONECOPY_MIN`` / ``ONECOPY_MIN_PAIR`` (a pair's broadcast above
    ``PAIR_SPLIT_MIN`` is split instead).  The plans (``procgroup.plans``) ask it on every call."""
    if a is None or nbytes <= a.max_bytes or big_slots_for(a, collective, nbytes) is not None:
        return False
    p = len(a.members)
    if p == 2 and collective == "broadcast" and nbytes > PAIR_SPLIT_MIN:
        return False  # the pair's split (onecopy.bcast_pair), select.broadcast's choice before the reads
    return p >= 2 and nbytes > (ONECOPY_MIN if p >= 3 else ONECOPY_MIN_PAIR).get(collective, 1 << 62)
