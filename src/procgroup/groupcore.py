"""The per-call state of a process group, as the base class of :class:`~procgroup.process_group.ProcessGroup`.

Every planned collective (:mod:`procgroup.plans`) reads and writes the same few fields of its group: the
sequence number, the fingerprint chain, the flight and chain windows, the one-thread token, the reused Comm
and Deadline.  :class:`GroupCore` holds them, and a plan (:class:`procgroup.plans.Plan`) keeps the fields
that run_plan reads in its base :class:`PlanCore`.  Where the optional extension ``_groupcore`` was built
(setup.py; plain C on the CPython API), these are C fields and ``GroupCore.run_plan`` does a planned call's
bookkeeping in one C call (about 0.5 µs of Python less per small collective); ``ProcessGroup._run_plan_py`` is
the reference and takes every uncommon case.  Without the extension, both bases are plain slotted classes
and ``ProcessGroup.run_plan`` is ``_run_plan_py``.  ``PROCGROUP_NATIVE=0`` selects the Python path per group
(``ProcessGroup._fast``), as it does for the shared-memory fast paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .algorithms.comm import STEP_BITS
from .tags import GID_LIMIT, SEQ_MASK

__all__ = ["GroupCore", "PlanCore", "COMPILED", "crc32"]

#: the fields, in both forms (the C type's members; the Python fallback's slots)
FIELDS = (
    "_halt",
    "_pending",
    "_busy",
    "chain",
    "flight",
    "inflight",
    "_plan_dl",
    "_comm",
    "_home",
    "_owner",
    "_seq",
    "gid",
    "last_completed",
    "timeout",
    "_chain",
    "_comm_busy",
    "_fast",
)


class PyGroupCore:
    """The pure-Python GroupCore: the same fields as slots (ProcessGroup._run_plan_py does the calls)."""

    __slots__ = FIELDS


class PyPlanCore:
    """The pure-Python PlanCore: the fields of a plan that run_plan reads (procgroup.plans.Plan's base)."""

    __slots__ = ("fpb", "fpx", "fn", "post", "direct")


COMPILED: bool
crc32: Any
if TYPE_CHECKING:  # the type checker sees the Python twins (the compiled types have the same fields)
    GroupCore = PyGroupCore
    PlanCore = PyPlanCore
else:
    try:
        from . import _groupcore
    except ImportError:  # not built (no compiler at install time): the pure-Python path
        GroupCore, PlanCore, COMPILED, crc32 = PyGroupCore, PyPlanCore, False, None
    else:
        _groupcore.set_layout(SEQ_MASK, STEP_BITS, GID_LIMIT)
        GroupCore, PlanCore, COMPILED, crc32 = _groupcore.GroupCore, _groupcore.PlanCore, True, _groupcore.crc32
