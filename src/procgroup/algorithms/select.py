"""Algorithm selection: every size threshold in one place, and the collective entry points.

The API layer calls the functions at the bottom (``broadcast``, ``all_reduce``,
...); each picks an algorithm from the message size and the group size.  To
tune, change the constants; to pin an algorithm (benchmarks, debugging), set
``FORCE[collective] = "name"`` with a name from ``ALGORITHMS[collective]``.

Selection table (n = bytes per rank of the call, p = group size):

=================  ==========================================  ===========================================
collective         small                                       large
=================  ==========================================  ===========================================
all_reduce         recursive doubling (fold for p != 2^k)       ring reduce-scatter + ring all-gather
                   when n <= ALLREDUCE_SMALL or elements < p    otherwise
  (multi-host)     hierarchical when hosts has >1 key and some host has >1 rank: intra-host reduce
                   (rows "reduce") -> all_reduce among host leaders (flat rows) -> intra-host broadcast;
                   multileader instead from MULTILEADER_MIN when every host has as many ranks:
                   intra-host reduce-scatter -> local rank i of every host all-reduces
                   slice i -> intra-host all-gather (through the host's big slots up to
                   HOST_SPLIT_MAX, else the ring).  The stage between hosts (leaders, or
                   local rank i of every host) is chosen by choose_all_reduce_inter: for at most
                   INTER_DIRECT_MAX_P hosts direct (every message at once: one hop) up to
                   INTER_DIRECT_SMALL, direct reduce-scatter + direct all-gather (two hops) above
                   (up to INTER_RSAG_MAX); the flat rows for more hosts
broadcast          binomial tree when n <= BCAST_SMALL or p<=2  binomial scatter + ring all-gather
reduce             binomial tree when n <= REDUCE_SMALL         ring reduce-scatter + direct gather to root
                   (REDUCE_SMALL_SHM on one host) or
                   elements < p
reduce_scatter     recursive doubling on a copy when p*n <=     ring
                   REDUCE_SCATTER_SMALL
all_gather         Bruck when p*n <= ALLGATHER_SMALL            ring
all_gatherv        binomial gather + bcast when total <=        ring
                   ALLGATHER_SMALL
gather / scatter   binomial tree when p*n <= GATHER_SMALL       linear (direct to / from the root)
all_to_all         linear (all posted at once) when total sent  pairwise exchange
                   <= ALLTOALL_SMALL
barrier            dissemination
=================  ==========================================  ===========================================

Before the table: when the group has an arena (``comm.arena``: every rank on
one host, see ``algorithms.arena``) and one rank's bytes fit its slot
(``ARENA_BYTES``, 32 KiB), all_reduce, broadcast, reduce, all_gather,
reduce_scatter (its whole sendbuf) and barrier are a single arena exchange.  ``FORCE`` still wins.

Above the arena size, when the arena has big slots (``comm.arena.big``: two
shared buffers per member, ``PROCGROUP_SHM_BIG_SLOT``, 1 MiB by default;
see ``algorithms.bigarena``) and the per-rank bytes are at most
``BIG_LIMIT[collective]``, all_reduce, reduce, reduce_scatter, broadcast and
all_gather go through them: chunked, double-buffered copies and in-place
reductions in shared memory, no messages.

=================  ==============================  ===================================================
collective         big-slot algorithm              n compared with BIG_LIMIT
=================  ==============================  ===================================================
all_reduce         reduce-scatter + all-gather     bytes per rank
                   (<= DIRECT_MAX, 128 KiB: one
                   sync, each rank reduces all)
reduce             reduce-scatter + root gathers   bytes per rank
                   (members x bytes <= 512 KiB:
                   root reduces)
reduce_scatter     per-piece reduce                bytes of sendbuf (p blocks)
broadcast          pipelined copy in / copy out    bytes
all_gather         pipelined copy in / copy out    bytes per rank (sendbuf)
=================  ==============================  ===================================================

all_to_all on such a group always goes through the arena (``algorithms.alltoall_shm``): a header with the
rank's counts and, when it fits the slot, the data, in one exchange; the longer streams (bytes a rank sends
to the others) continue through the big slots up to ``BIG_LIMIT['all_to_all']`` (compared with the longest
stream of any rank, which every rank reads from the headers, so all agree) and above it are read straight out
of the senders' buffers (one process_vm_readv a piece), or go as messages where a rank cannot read the others.
A group of two reads every stream that is not inline (``BIG_LIMIT_PAIR``; the list form keeps ``BIG_LIMIT``).
A broadcast among three or more ranks of one host above ``ONECOPY_MIN['broadcast']`` that the big slots do not take
(``BIG_LIMIT``; a group without big slots: only the first ``BIG_GROUPS`` groups of a transport get them,
``PROCGROUP_SHM_BIG_SLOT=0``) every rank reads straight out of the root's buffer (``algorithms.onecopy``, one
compiled call where the arena has one); where some rank cannot read, every rank takes the big slots instead, or
the table above (:func:`broadcast_unread`).  An all_gather above ``ONECOPY_MIN['all_gather']``
(``ONECOPY_MIN_PAIR`` for two ranks) that the big slots do not take (``BIG_LIMIT``, ``BIG_LIMIT_PAIR``) every
rank reads out of every other's ``sendbuf``, in one compiled call where the arena has one (``Arena.bind_read``);
where some rank cannot read the others, every rank takes the big slots instead, or the messages without them
(:func:`all_gather_unread`).
A group of two splits a broadcast above its big slots' limit (``BIG_LIMIT_PAIR``; without big slots, above
``limits.PAIR_SPLIT_MIN``) between its two CPUs (``algorithms.onecopy.bcast_pair``): the root writes half straight into
the other rank's buffer (process_vm_writev) while that rank reads the other half out of the root's.  Below the
big slots' floor (``BIG_MIN_PAIR``; without big slots, up to the split) the other rank reads the root's buffer.
An all_reduce or reduce_scatter above the arena's slot that the big slots do not take (a group without them: they
take every size where a group has them) every rank reduces by one-copy reads (``onecopy.allreduce_onecopy``,
``reduce_scatter_onecopy``, one compiled call where the arena has one): each reads its slice of every other rank's
buffer and reduces it; an all_reduce then reads the others' reduced slices back.  Where some rank cannot read the
others, every rank takes the messages (:func:`all_reduce_unread`, :func:`reduce_scatter_unread`).
The limit tables and the functions that read them live in ``algorithms.limits`` (re-exported here).

``BIG_LIMIT[collective]`` hands calls above it back to the table above (the message algorithms, with the
single-copy path for large messages).  The limits come from same-process A/B runs on the 2-CPU host
(benchmarks/ab_bigslots.py: the algorithms alternating per iteration, time = max over ranks, median; N=2 and N=4,
64 KiB-64 MiB): the big slots took 0.3x-0.9x of the message algorithms' time for all_reduce, reduce and
reduce_scatter at every size, so those have no limit.  Nor have broadcast and all_gather (2026-11-28, after the
compiled big-slot copies): broadcast N=2 4 / 16 / 32 / 64 MiB big 0.37 / 0.82 / 0.95 / 0.97x the messages' time
(the rendezvous read by two threads), N=4 16 / 64 MiB 0.66 / 0.69x and 0.80 / 0.73x the one-copy reads' -- except a
group of two above 32 MiB (``BIG_LIMIT_PAIR``: those same-process A/Bs read a root buffer of untouched zero pages,
which stays in the cache; with written data whole jobs put the rendezvous ahead at 48 / 64 MiB, 0.84 / 0.86x);
all_gather N=2 4 / 8 / 32 MiB a rank 0.95 / 0.90 / 0.86x the messages' (ring of rendezvous reads) and 0.91-1.0x the
one-copy reads' (read first or local copy first), N=4 2 / 4 / 16 MiB a rank 0.69 / 0.69 / 0.80x the one-copy
reads'.  (They had stopped at 16 and 2 MiB when the big slots' copies were pure Python.)  Since pass 22 the reads
are one compiled call, and all_gather's and broadcast's limits are where they overtake the big slots
(``ONECOPY_MIN``, ``ONECOPY_MIN_PAIR`` say by how much); above them a group that cannot read still takes the big
slots.  all_to_all
(benchmarks/ab_alltoall.py, loaded 2-CPU host, equal splits): the big slots took 0.8x the messages' time up to a 1
MiB stream at N=2 (2 MiB per rank), 0.98x at 1.5 MiB, 1.07x-1.34x from 2 MiB (two copies against the single-copy
path's one); at N=4 0.3x-0.9x up to 1.5 MiB, 1.3x-1.4x at 6 MiB: the limit was a 1 MiB stream.  Since the streams
above it are read straight from the senders (one copy, ``algorithms.onecopy``), the big slots still win at a 2 MiB
stream at N=2 (4 MiB per rank: 343-347 against 410-432 us) and tie at N=4 (1.5 and 3 MiB streams: 0.8-0.9 and
1.5-1.9 ms both); at a 3 MiB stream N=2 ties and from 4 MiB the reads win (N=2 4 MiB 0.90-0.99 against 1.04 ms;
rechecked 2026-11-28: big 1.21x / 1.08x the reads' at 4 / 16 MiB N=2, 1.09-1.45x at N=4): the limit was a 2 MiB
stream.  Pass 21 (2026-11-29, whole jobs alternating, 4 rounds, slowest rank per call, median, us;
benchmarks/results/pass21): a stream past one window (``alltoall_shm.STEP_MAX``) takes its further rounds in
Python, and its stores into shared lines pay the VM's slow periods, while the reads store nothing shared: N=4 a
rank 1.5 MiB (1.1 MiB stream) big 875-1419 against reads 825-888, 2 MiB 1121-2062 against 1040-1215; N=2 3 MiB
(1.5 MiB stream) 290-1079 against 257-314, 4 MiB 641-1429 against 275-498.  Up to a 1 MiB stream the big slots
stay (N=2 2 MiB a rank: 105-779, bimodal, against the reads' 199-220; N=4 1 MiB: 203-1037 against 521-573, the
reads' two exchanges costing about 250 us there): the limit is a 1 MiB stream.

Every choice is computed from values all ranks of the call agree on (the
group size and the per-rank message size), so all ranks pick the same
algorithm -- except all_to_all with uneven counts, where each rank looks at
what it sends; the two all_to_all algorithms use the same messages (one per
ordered pair, same step) and post receives before waiting, so ranks that chose
differently still match up.  (With an arena, all_to_all decides from the
headers of its first exchange, which every rank reads alike.)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from . import allreduce as _allreduce
from . import alltoall_shm as _alltoall_shm
from . import bigarena as _bigarena
from . import limits as _limits
from ._util import flat
from .allreduce import (
    StageChoices,
    allreduce_hierarchical,
    allreduce_multileader,
    allreduce_recursive_doubling,
    allreduce_reduce_bcast,
    allreduce_ring,
    host_layout,
    install_stage_choices,
    uniform_layout,
)
from .alltoall import alltoall_linear, alltoall_pairwise
from .alltoall_shm import alltoall_shm, shm_applies
from .arena import (
    allgather_arena,
    allreduce_arena,
    barrier_arena,
    bcast_arena,
    fits,
    reduce_arena,
    reduce_scatter_arena,
)
from .bcast import bcast_binomial, bcast_scatter_allgather
from .bigarena import allgather_big, allreduce_big, allreduce_big_split, bcast_big, reduce_big, reduce_scatter_big
from .direct import allreduce_direct, allreduce_direct_rsag
from .dissemination import barrier_dissemination
from .gathering import (
    allgather_bruck,
    allgather_ring,
    allgatherv_gather_bcast,
    allgatherv_ring,
    gather_binomial,
    gather_linear,
    scatter_binomial,
    scatter_linear,
)
from .limits import (
    BIG_LIMIT,
    BIG_LIMIT_PAIR,
    BIG_MIN_PAIR,
    ONECOPY_MIN,
    ONECOPY_MIN_PAIR,
    big_limit,
    big_slots_for,
    onecopy_for,
)
from .onecopy import allgather_direct, allreduce_onecopy, bcast_direct, bcast_pair, reduce_scatter_onecopy
from .redscat import reduce_scatter_allreduce, reduce_scatter_ring
from .reduction import reduce_binomial, reduce_scatter_gather

__all__ = [
    "ALLREDUCE_SMALL",
    "BCAST_SMALL",
    "REDUCE_SMALL",
    "REDUCE_SMALL_SHM",
    "REDUCE_SCATTER_SMALL",
    "ALLGATHER_SMALL",
    "GATHER_SMALL",
    "ALLTOALL_SMALL",
    "HIERARCHICAL",
    "BIG_LIMIT",
    "BIG_LIMIT_PAIR",
    "BIG_MIN_PAIR",
    "ONECOPY_MIN",
    "ONECOPY_MIN_PAIR",
    "big_limit",
    "big_slots_for",
    "onecopy_for",
    "all_gather_unread",
    "allreduce_reads",
    "all_reduce_unread",
    "reduce_scatter_reads",
    "reduce_scatter_unread",
    "broadcast_unread",
    "FORCE",
    "ALGORITHMS",
    "choose_all_reduce",
    "tunables",
    "choose_all_reduce_flat",
    "choose_all_reduce_inter",
    "choose_broadcast",
    "choose_reduce",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gatherv",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
]

# ----------------------------------------------------------------------------- thresholds (bytes)
#: all_reduce: recursive doubling up to here, ring above
ALLREDUCE_SMALL = 64 * 1024
#: broadcast: binomial tree up to here, scatter + ring all-gather above
BCAST_SMALL = 256 * 1024
#: reduce: binomial tree up to here, ring reduce-scatter + gather above
REDUCE_SMALL = 64 * 1024
#: ... on one host, where the messages go through shared memory (a group without big slots: they take every reduce
#: above the arena's slot where a group has them).  Pass 24 (benchmarks/results/pass24, whole jobs alternating, 3
#: rounds, slowest rank per call, median, us; PROCGROUP_SHM_BIG_SLOT=0), reduce-scatter + gather / binomial / Open
#: MPI: N=4 128 KiB 291-319 / 47-53 / 45-53, 256 KiB 350-367 / 80-99 / 95-106, 512 KiB 460-474 / 370-467 / 468-564,
#: 1 MiB 711-731 / 1625-2283 / 350-440; N=2 128 KiB 34-39 / 22-38 / 16-17, 256 KiB 44-72 / 31-57 / 29, 512 KiB 63-91
#: / 269-286 / 57, 1 MiB 106-160 / 533-555 / 108-109
REDUCE_SMALL_SHM = 256 * 1024
#: reduce_scatter: all-reduce of a copy up to here (total p*n bytes), ring above
REDUCE_SCATTER_SMALL = 64 * 1024
#: all_gather / all_gatherv: Bruck / gather+bcast up to here (total bytes), ring above
ALLGATHER_SMALL = 64 * 1024
#: gather / scatter: binomial tree up to here (total bytes at the root), linear above
GATHER_SMALL = 256 * 1024
#: all_to_all: everything posted at once up to here (bytes this rank sends), pairwise above
ALLTOALL_SMALL = 256 * 1024
#: use the hierarchical all_reduce when the host layout allows it
HIERARCHICAL = True
#: multi-host all_reduce on hosts with as many ranks each: one leader per host below this, multileader
#: from here.  3 netns hosts x 2 ranks on the 2-CPU host (same-process A/B, variants alternating per
#: iteration, direct stages between hosts): hierarchical 0.78-0.94x multileader's time at 64-512 KiB with
#: 0.7-0.9x its CPU (half the messages: the per-message Python cost dominates there), multileader
#: ahead from 1 MiB (hierarchical 1.03-1.23x at 1-4 MiB).  Since the host's members barely spin in the
#: host's slots (``Transport.arena(spanning=True)``), hierarchical leads at 1 MiB: slowest rank per call,
#: median, rounds alternating, 6.2-6.9 ms against multileader's 8.8-9.3 (3.9 against 5.6-5.7 on a quieter
#: machine); at 4 MiB the medians are even (12.8-13.2 / 13.1-13.7 ms) and multileader's mean per call 3-9 %
#: lower; 8 MiB even; multileader ahead at 16 MiB (49.9-53.5 / 54.0-58.8 ms).  Those A/Bs alternated the
#: variants call by call in one job, which on this VM can favour either side (a call runs after the other
#: variant's); pass 13 timed whole jobs instead, one variant each, alternating (``loop.py`` with
#: ``FORCE=all_reduce=...``, 3 rounds, slowest rank per call, median): hierarchical / multileader 1 MiB
#: 3044-3200 / 4088-4232 us, 1.5 MiB 4303-4662 / 4532-4655, 2 MiB 5454-5655 / 5013-5181 (0.92x).  Once
#: multileader's host stages ran in the big slots and the stage between hosts took reduce-scatter + all-gather
#: above 128 KiB (6 rounds each): multileader / hierarchical 256 KiB 1.37x, 512 KiB 1.24x, 1 MiB 0.88x (faster in
#: 6 of 6 rounds)
MULTILEADER_MIN = 1 << 20
#: ... and runs a buffer above MULTILEADER_WHOLE bytes as consecutive pieces of at most MULTILEADER_CHUNK
#: (``allreduce.multileader_pieces``), each all three stages.  A piece's host stages take one step of the 1 MiB big
#: slots (one compiled call each where bound), and the ranks meet again after every piece, where a whole buffer's
#: steps waited at every sync for a partner whose stage between hosts ended at another time.  3 netns hosts x 2
#: ranks (pass 18, whole jobs alternating, slowest rank per call, median): whole / 1 MiB pieces 2 MiB 3824 / 2633
#: us, 4 MiB 7675 / 5038, 16 MiB 29380 / 20316 (4 of 4 rounds each), 64 MiB 114078 / 88316 (3 of 3), with 8-25 %
#: less CPU; 512 KiB pieces at 4 MiB 1.145x the 1 MiB ones' time (0 of 4).  HOST_SPLIT_MAX no longer applies to
#: such a buffer: its pieces are below it
MULTILEADER_WHOLE = 1 << 20
#: ... the pieces' largest size.  Pass 19, same whole-job A/B, 768 KiB / 1 MiB: 4 MiB (6 pieces of 683 KiB
#: against 4 of 1 MiB) 0.941x (4 of 4 rounds), 16 MiB 0.933x (3 of 3), 64 MiB 0.955x (3 of 3), 2 MiB 1.017x (2 of
#: 4); at 4 MiB against 768 KiB, 640 KiB (7 pieces of 585 KiB) 1.13x and 1020 KiB (5 of 819 KiB) 1.28x (0 of 4
#: each).  A 1 MiB buffer stays whole (MULTILEADER_WHOLE): two 512 KiB pieces took 1.26x its time (1 of 4)
MULTILEADER_CHUNK = 768 << 10
#: the all_reduce between hosts (a stage of the two above) uses the direct algorithms up to this many hosts
INTER_DIRECT_MAX_P = 8
#: ... and between them: direct (one hop, (p-1)n bytes out per rank) up to here, direct reduce-scatter +
#: all-gather (two hops, the ring's bytes) above.  Same A/B: direct and direct reduce-scatter + all-gather
#: within noise of each other up to 1 MiB, direct with fewer messages and less CPU up to 512 KiB; both
#: ahead of recursive doubling / ring (those 1.02-1.22x at 64 KiB-4 MiB).  Timed as whole jobs instead (pass
#: 13, 3 netns hosts x 2 ranks, hierarchical all_reduce, 6 rounds alternating, slowest rank per call, median),
#: direct reduce-scatter + all-gather against direct: 64 KiB 1.17x (0 of 6 rounds faster), 128 KiB 1.05x (3 of
#: 6), 256 KiB 0.89x (5 of 6), 512 KiB 0.71x (6 of 6), 1 MiB 0.74x (6 of 6).  Once both ran their phases through
#: the bound phases (pass 17, ``Comm.phases``; the same whole-job A/B), direct reduce-scatter + all-gather against
#: direct: 32 KiB 1.27x (0 of 6), 64 KiB 1.08x (2 of 6), 128 KiB 0.87x (6 of 6), 256 KiB 0.74x (6 of 6)
INTER_DIRECT_SMALL = 64 * 1024
#: ... and the direct reduce-scatter + all-gather up to here (bytes of the stage), the flat rows (ring) above:
#: no limit, the same A/B at 4-16 MiB per rank (stages of 2-8 MiB) gave the ring 0.98-1.07x its time and
#: 1.07-1.10x its CPU (a knob for hosts where many concurrent streams lose)
INTER_RSAG_MAX = 1 << 62

#: collective -> algorithm name, overriding the size-based choice
FORCE: Dict[str, str] = {}


def tunables() -> tuple:
    """Every threshold the selection and the big slots' steps read, and the stage choices installed, as one value:
    a plan that bound a choice (``plans``: a group spanning hosts) compares it per call and takes the selection's
    choice once anything changed since."""
    return (
        ALLREDUCE_SMALL,
        BCAST_SMALL,
        REDUCE_SMALL,
        HIERARCHICAL,
        MULTILEADER_MIN,
        MULTILEADER_CHUNK,
        MULTILEADER_WHOLE,
        INTER_DIRECT_MAX_P,
        INTER_DIRECT_SMALL,
        INTER_RSAG_MAX,
        HOST_SLOTS_MAX,
        HOST_SLOTS_BCAST_MAX,
        HOST_SPLIT_MAX,
        BIG_LIMIT["all_reduce"],
        BIG_LIMIT["reduce"],
        BIG_LIMIT["broadcast"],
        _bigarena.DIRECT_MAX,
        _bigarena.REDUCE_DIRECT_READS,
        _bigarena.STEP_MAX,
        _alltoall_shm.STEP_MAX,
        _bigarena.PIPE_MIN,
        _bigarena.PIPE_PARTS_PAIR,
        _bigarena.PIPE_PARTS,
        _allreduce._stages,
    )


ALGORITHMS: Dict[str, Dict[str, Callable[..., None]]] = {
    "all_reduce": {
        "recursive_doubling": allreduce_recursive_doubling,
        "ring": allreduce_ring,
        "reduce_bcast": allreduce_reduce_bcast,
        "hierarchical": allreduce_hierarchical,
        "multileader": allreduce_multileader,
        "direct": allreduce_direct,
        "direct_rsag": allreduce_direct_rsag,
        "arena": allreduce_arena,
        "big": allreduce_big,
    },
    "broadcast": {
        "binomial": bcast_binomial,
        "scatter_allgather": bcast_scatter_allgather,
        "arena": bcast_arena,
        "big": bcast_big,
    },
    "reduce": {
        "binomial": reduce_binomial,
        "reduce_scatter_gather": reduce_scatter_gather,
        "arena": reduce_arena,
        "big": reduce_big,
    },
    "reduce_scatter": {
        "allreduce": reduce_scatter_allreduce,
        "ring": reduce_scatter_ring,
        "big": reduce_scatter_big,
        "arena": reduce_scatter_arena,
    },
    "all_gather": {"bruck": allgather_bruck, "ring": allgather_ring, "arena": allgather_arena, "big": allgather_big},
    "all_gatherv": {"gather_bcast": allgatherv_gather_bcast, "ring": allgatherv_ring},
    "gather": {"binomial": gather_binomial, "linear": gather_linear},
    "scatter": {"binomial": scatter_binomial, "linear": scatter_linear},
    "all_to_all": {"linear": alltoall_linear, "pairwise": alltoall_pairwise, "shm": alltoall_shm},
    "barrier": {"dissemination": barrier_dissemination, "arena": barrier_arena},
}


def _forced(collective: str) -> Optional[Callable[..., None]]:
    name = FORCE.get(collective)
    if name is None:
        return None
    try:
        return ALGORITHMS[collective][name]
    except KeyError:
        raise ConfigError(
            f"FORCE[{collective!r}] = {name!r} is not an algorithm of {collective}: "
            f"choose from {sorted(ALGORITHMS.get(collective, {}))}"
        ) from None


# ----------------------------------------------------------------------------- choices
def _big(comm: Any, collective: str, nbytes: int, floor: bool = True) -> bool:
    """True when ``comm`` has big slots and ``nbytes`` is above the arena size and within BIG_LIMIT (and, with
    ``floor``, for two ranks above BIG_MIN_PAIR: :func:`big_slots_for`)."""
    return big_slots_for(comm.arena, collective, nbytes, floor) is not None


def _onecopy(comm: Any, collective: str, nbytes: int) -> bool:
    """True when ``comm``'s ranks share a host (an arena) and ``nbytes`` is above ``ONECOPY_MIN[collective]`` for
    three or more, ``ONECOPY_MIN_PAIR[collective]`` for two (asked where the big slots do not take the call):
    ``algorithms.onecopy`` may then read the parts straight out of their owners' memory (a pair's broadcast has a
    split of its own, ``bcast_pair``; the rendezvous reads a broadcast's root with two threads)."""
    if comm.arena is None or comm.size < 2:
        return False
    return nbytes > (ONECOPY_MIN[collective] if comm.size >= 3 else ONECOPY_MIN_PAIR.get(collective, 1 << 62))


def choose_all_reduce_flat(p: int, nbytes: int, nelems: int) -> Callable[..., None]:
    """All-reduce among ``p`` ranks without host structure: recursive doubling or ring."""
    if nbytes <= ALLREDUCE_SMALL or nelems < p:
        return allreduce_recursive_doubling
    return allreduce_ring


def choose_all_reduce_inter(p: int, nbytes: int, nelems: int) -> Callable[..., None]:
    """The all-reduce between hosts (one rank per host, a stage of the hierarchical all_reduces).

    Every pair of hosts has its own connection, so for few hosts all messages of a phase go at once:
    direct (one hop) when small, direct reduce-scatter + all-gather (two hops) otherwise; the flat
    choice for more than ``INTER_DIRECT_MAX_P`` hosts.
    """
    if p > INTER_DIRECT_MAX_P:
        return choose_all_reduce_flat(p, nbytes, nelems)
    if nbytes <= INTER_DIRECT_SMALL or nelems < p:
        return allreduce_direct
    if nbytes <= INTER_RSAG_MAX:
        return allreduce_direct_rsag
    return choose_all_reduce_flat(p, nbytes, nelems)


#: host keys -> (hierarchical applies, every host has as many ranks)
_HIER_CACHE: Dict[tuple, tuple] = {}


def _host_structure(hosts: Sequence[str], p: int) -> tuple:
    key = tuple(hosts)
    got = _HIER_CACHE.get(key)
    if got is None or len(key) != p:
        layout = host_layout(list(hosts), p)
        got = (len(layout) > 1 and any(len(h) > 1 for h in layout), uniform_layout(layout))
        if len(_HIER_CACHE) >= 256:
            _HIER_CACHE.clear()
        _HIER_CACHE[key] = got
    return got


def _hierarchical_applies(hosts: Sequence[str], p: int) -> bool:
    return HIERARCHICAL and p > 2 and _host_structure(hosts, p)[0]


def choose_all_reduce(comm: Any, nbytes: int, nelems: int) -> Callable[..., None]:
    """The all-reduce for ``comm`` and this size: forced, arena, hierarchical or flat."""
    f = _forced("all_reduce")
    if f is not None:
        return f
    if fits(comm, nbytes):
        return allreduce_arena
    if onecopy_for(comm.arena, "all_reduce", nbytes):
        return allreduce_reads
    if _big(comm, "all_reduce", nbytes):
        return allreduce_big
    if _hierarchical_applies(comm.hosts, comm.size):
        if nbytes >= MULTILEADER_MIN and _host_structure(comm.hosts, comm.size)[1]:
            return allreduce_multileader
        return allreduce_hierarchical
    return choose_all_reduce_flat(comm.size, nbytes, nelems)


def choose_broadcast(p: int, nbytes: int) -> Callable[..., None]:
    """Broadcast among ``p`` ranks: binomial tree, or scatter + all-gather when large."""
    f = _forced("broadcast")
    if f is not None:
        return f
    if nbytes <= BCAST_SMALL or p <= 2:
        return bcast_binomial
    return bcast_scatter_allgather


def choose_reduce(p: int, nbytes: int, nelems: int, shm: bool = False) -> Callable[..., None]:
    """Reduce among ``p`` ranks: binomial tree, or reduce-scatter + gather when large (``REDUCE_SMALL``, or with
    ``shm`` -- the ranks of one host -- ``REDUCE_SMALL_SHM``)."""
    f = _forced("reduce")
    if f is not None:
        return f
    if nbytes <= (REDUCE_SMALL_SHM if shm else REDUCE_SMALL) or nelems < p:
        return reduce_binomial
    return reduce_scatter_gather


#: a group spanning hosts: its hierarchical all_reduce reduces to each host's leader (HOST_SLOTS_MAX) and broadcasts
#: the leader's result
#: (HOST_SLOTS_BCAST_MAX) within each host through the host's shared slots (Comm.host_arena) up to this many bytes,
#: and with messages above (0: never through the slots)
HOST_SLOTS_MAX = 1 << 62
HOST_SLOTS_BCAST_MAX = 1 << 62


def choose_host_reduce(host: Any, nbytes: int) -> Optional[Callable[..., None]]:
    """The reduce to a host's first member through the host's shared slots (``host.arena``), or None."""
    if nbytes > HOST_SLOTS_MAX:
        return None
    if fits(host, nbytes):
        return reduce_arena
    if _big(host, "reduce", nbytes):
        return reduce_big
    return None


#: ... and its multi-leader all_reduce does the host's reduce-scatter and all-gather through those slots up to this
#: many bytes, with messages above (each host's ring: at two ranks a host one single-copy exchange each way,
#: where the slots copy every byte twice).  3 netns hosts x 2 ranks, whole jobs alternating (6-8 rounds,
#: slowest rank per call, median), slots / messages: 2 MiB 4970 / 5297 us, 4 MiB 9353 / 9847, 8 MiB 17859 /
#: 19429 (each in 6 of 6 rounds), 16 MiB 33925 / 33257
HOST_SPLIT_MAX = 8 << 20


def choose_host_split(host: Any, nbytes: int) -> Optional[Callable[..., bool]]:
    """The multi-leader all_reduce's host stages through the host's shared slots (``host.arena``), or None."""
    if nbytes > min(HOST_SLOTS_MAX, HOST_SPLIT_MAX) or not _big(host, "all_reduce", nbytes):
        return None
    return allreduce_big_split


def choose_host_broadcast(host: Any, nbytes: int) -> Optional[Callable[..., None]]:
    """The broadcast among a host's members through their shared slots (``host.arena``), or None."""
    if nbytes > HOST_SLOTS_BCAST_MAX:
        return None
    if fits(host, nbytes):
        return bcast_arena
    if _big(host, "broadcast", nbytes, floor=False):  # host stages keep the big slots (bound by hierbind)
        return bcast_big
    return None


# the hierarchical all_reduces pick their stages with this policy (they do not import this module)
install_stage_choices(
    StageChoices(
        all_reduce_flat=choose_all_reduce_inter,
        reduce=choose_reduce,
        broadcast=choose_broadcast,
        host_reduce=choose_host_reduce,
        host_broadcast=choose_host_broadcast,
        host_split=choose_host_split,
        multileader_chunk=lambda: MULTILEADER_CHUNK,
        multileader_whole=lambda: MULTILEADER_WHOLE,
    )
)


# ----------------------------------------------------------------------------- entry points
def broadcast(comm: Any, buf: np.ndarray, root: int) -> None:
    """``buf`` of ``root`` to every rank, in place."""
    buf = flat(buf, "broadcast buffer")
    if comm.size == 1 or buf.nbytes == 0:
        return
    if "broadcast" not in FORCE:
        if fits(comm, buf.nbytes):
            return bcast_arena(comm, buf, root)
        if _big(comm, "broadcast", buf.nbytes):
            return bcast_big(comm, buf, root)
        if comm.size == 2 and comm.arena is not None and buf.nbytes > _limits.PAIR_SPLIT_MIN:
            if bcast_pair(comm, buf, root):
                return  # the root wrote half into the other rank's buffer while it read the other half
            return broadcast_unread(comm, buf, root)  # a rank cannot read or write the other: on every rank
        if _onecopy(comm, "broadcast", buf.nbytes):
            if bcast_direct(comm, buf, root):  # every reader copies the root's buffer at once (algorithms.onecopy)
                return
            return broadcast_unread(comm, buf, root)
    choose_broadcast(comm.size, buf.nbytes)(comm, buf, root)


def broadcast_unread(comm: Any, buf: np.ndarray, root: int) -> None:
    """:func:`broadcast` where the one-copy reads (or a pair's split) were to take the call but some rank cannot
    read the others: the big slots where the group has them, at any size above the arena's slot (``BIG_LIMIT``
    hands the calls above it to the reads, which beat the big slots there; the big slots still beat the
    messages), else the messages."""
    a = comm.arena
    if a is not None and a.big is not None and a.max_bytes < buf.nbytes:
        bcast_big(comm, buf, root)
        return
    choose_broadcast(comm.size, buf.nbytes)(comm, buf, root)


def all_reduce(comm: Any, buf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """``buf = op over ranks of buf``, in place, identical bits on every rank (AVG: caller finalizes)."""
    buf = flat(buf, "all_reduce buffer")
    if comm.size == 1 or buf.shape[0] == 0:
        return
    choose_all_reduce(comm, buf.nbytes, buf.shape[0])(comm, buf, reduce)


def reduce(comm: Any, buf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None], root: int) -> None:
    """Result in ``buf`` on ``root``; other ranks' ``buf`` is unchanged."""
    buf = flat(buf, "reduce buffer")
    if comm.size == 1 or buf.shape[0] == 0:
        return
    if "reduce" not in FORCE:
        if fits(comm, buf.nbytes):
            return reduce_arena(comm, buf, reduce, root)
        if _big(comm, "reduce", buf.nbytes):
            return reduce_big(comm, buf, reduce, root)
    choose_reduce(comm.size, buf.nbytes, buf.shape[0], comm.arena is not None)(comm, buf, reduce, root)


def allreduce_reads(comm: Any, buf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """:func:`all_reduce` of one host's ranks by one-copy reads (``onecopy.allreduce_onecopy``), or where some rank
    cannot read the others :func:`all_reduce_unread` on every rank alike."""
    if not allreduce_onecopy(comm, buf, reduce):
        all_reduce_unread(comm, buf, reduce)


def all_reduce_unread(comm: Any, buf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """:func:`all_reduce` where some rank cannot read the others (the reads took the call: a group without big slots,
    or above a lowered ``BIG_LIMIT``): the big slots where they take the call (floor or not), else the messages."""
    if _big(comm, "all_reduce", buf.nbytes, floor=False):
        allreduce_big(comm, buf, reduce)
    else:
        choose_all_reduce_flat(comm.size, buf.nbytes, buf.shape[0])(comm, buf, reduce)


def all_gather(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """``recvbuf`` = every rank's ``sendbuf`` in rank order."""
    sendbuf, recvbuf = flat(sendbuf, "all_gather sendbuf"), flat(recvbuf, "all_gather recvbuf")
    f = _forced("all_gather")
    if f is None:
        if fits(comm, sendbuf.nbytes):
            f = allgather_arena
        elif _big(comm, "all_gather", sendbuf.nbytes):
            f = allgather_big
        elif (
            _onecopy(comm, "all_gather", sendbuf.nbytes)
            and recvbuf.dtype == sendbuf.dtype
            and allgather_direct(comm, sendbuf, recvbuf)  # each rank read the others' parts (algorithms.onecopy)
        ):
            return
        else:
            f = all_gather_unread
    f(comm, sendbuf, recvbuf)


def all_gather_unread(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
    """:func:`all_gather` where the one-copy reads do not take the call (or some rank cannot read the others):
    the big slots where the group has them, at any size above the arena's slot (``BIG_LIMIT`` hands the calls
    above it to the reads, which beat the big slots there; the big slots still beat the messages), else messages
    (Bruck or the ring by size)."""
    a = comm.arena
    if a is not None and a.big is not None and a.max_bytes < sendbuf.nbytes:
        allgather_big(comm, sendbuf, recvbuf)
        return
    f = allgather_bruck if sendbuf.nbytes * comm.size <= ALLGATHER_SMALL else allgather_ring
    f(comm, sendbuf, recvbuf)


def all_gatherv(comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, counts: Sequence[int]) -> None:
    """Like all_gather with ``counts[i]`` elements from rank i (counts known to all)."""
    sendbuf, recvbuf = flat(sendbuf, "all_gatherv sendbuf"), flat(recvbuf, "all_gatherv recvbuf")
    f = _forced("all_gatherv")
    if f is None:
        total = sum(int(c) for c in counts) * recvbuf.dtype.itemsize
        f = allgatherv_gather_bcast if total <= ALLGATHER_SMALL else allgatherv_ring
    f(comm, sendbuf, recvbuf, counts)


def gather(comm: Any, sendbuf: np.ndarray, recvbuf: Optional[np.ndarray], root: int) -> None:
    """Every rank's ``sendbuf`` into the root's ``recvbuf`` in rank order (others pass None)."""
    sendbuf, recvbuf = flat(sendbuf, "gather sendbuf"), flat(recvbuf, "gather recvbuf")
    f = _forced("gather")
    if f is None:
        f = gather_binomial if sendbuf.nbytes * comm.size <= GATHER_SMALL else gather_linear
    f(comm, sendbuf, recvbuf, root)


def scatter(comm: Any, sendbuf: Optional[np.ndarray], recvbuf: np.ndarray, root: int) -> None:
    """Block i of the root's ``sendbuf`` (p blocks of len(recvbuf)) into rank i's ``recvbuf``."""
    sendbuf, recvbuf = flat(sendbuf, "scatter sendbuf"), flat(recvbuf, "scatter recvbuf")
    f = _forced("scatter")
    if f is None:
        f = scatter_binomial if recvbuf.nbytes * comm.size <= GATHER_SMALL else scatter_linear
    f(comm, sendbuf, recvbuf, root)


def reduce_scatter(
    comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]
) -> None:
    """Rank r gets block r of ``sendbuf`` reduced over ranks; ``sendbuf`` is not modified."""
    sendbuf, recvbuf = flat(sendbuf, "reduce_scatter sendbuf"), flat(recvbuf, "reduce_scatter recvbuf")
    f = _forced("reduce_scatter")
    if f is None and fits(comm, sendbuf.nbytes):
        f = reduce_scatter_arena
    if f is None and onecopy_for(comm.arena, "reduce_scatter", sendbuf.nbytes) and recvbuf.dtype == sendbuf.dtype:
        f = reduce_scatter_reads
    (f or reduce_scatter_unread)(comm, sendbuf, recvbuf, reduce)


def reduce_scatter_reads(
    comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]
) -> None:
    """:func:`reduce_scatter` of one host's ranks by one-copy reads (``onecopy.reduce_scatter_onecopy``), or where
    some rank cannot read the others :func:`reduce_scatter_unread` on every rank alike."""
    if not reduce_scatter_onecopy(comm, sendbuf, recvbuf, reduce):
        reduce_scatter_unread(comm, sendbuf, recvbuf, reduce)


ALGORITHMS["all_reduce"]["reads"] = allreduce_reads  # defined below the table, which the thresholds' docs lead
ALGORITHMS["reduce_scatter"]["reads"] = reduce_scatter_reads


def reduce_scatter_unread(
    comm: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, reduce: Callable[[np.ndarray, np.ndarray], None]
) -> None:
    """:func:`reduce_scatter` where the one-copy reads do not take the call or some rank cannot read the others: the
    big slots where they take the call (floor or not), else the messages by size."""
    if _big(comm, "reduce_scatter", sendbuf.nbytes, floor=False):
        reduce_scatter_big(comm, sendbuf, recvbuf, reduce)
    elif sendbuf.nbytes <= REDUCE_SCATTER_SMALL:
        reduce_scatter_allreduce(comm, sendbuf, recvbuf, reduce)
    else:
        reduce_scatter_ring(comm, sendbuf, recvbuf, reduce)


def all_to_all(
    comm: Any,
    sendbuf: np.ndarray,
    send_counts: Sequence[int],
    recvbuf: np.ndarray,
    recv_counts: Sequence[int],
    lists: bool = False,
) -> None:
    """``send_counts[j]`` elements to rank j, ``recv_counts[i]`` from rank i (displacements: prefix sums).

    On a group with an arena, the streams' limit between the big slots and the reads is the group size's
    (``big_limit``: a pair reads every stream that is not inline), or with ``lists`` ``BIG_LIMIT``'s at every size:
    the list form's (``plans.all_to_all_list``, whose compiled call offers no one buffer to read)."""
    sendbuf, recvbuf = flat(sendbuf, "all_to_all sendbuf"), flat(recvbuf, "all_to_all recvbuf")
    f = _forced("all_to_all")
    if f is None and shm_applies(comm):
        lim = BIG_LIMIT["all_to_all"] if lists else big_limit("all_to_all", comm.size)
        return alltoall_shm(comm, sendbuf, send_counts, recvbuf, recv_counts, None, lim)
    if f is None:
        sent = sum(int(c) for c in send_counts) * sendbuf.dtype.itemsize
        f = alltoall_linear if sent <= ALLTOALL_SMALL else alltoall_pairwise
    f(comm, sendbuf, send_counts, recvbuf, recv_counts)


def barrier(comm: Any) -> None:
    """Returns once every rank has entered."""
    f = _forced("barrier")
    if f is None:
        f = barrier_arena if comm.arena is not None else barrier_dissemination
    f(comm)
