"""``torch.distributed.monitored_barrier`` on procgroup groups.

torch's ``monitored_barrier`` refuses every backend not named "gloo": its Python checks the name
(``get_backend(group) != Backend.GLOO``) before the call reaches the backend, although the
backend interface has the method.  procgroup's backend serves it
(:meth:`procgroup.torch.backend.ProcgroupBackend.monitored_barrier`, with torch's wording), so when
the first procgroup group is created, :func:`install` wraps torch's function: a group whose backend
is procgroup skips the name check and calls the group's ``monitored_barrier`` as torch would; every
other group goes to torch's own function, unchanged.
"""

from __future__ import annotations

import functools
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["install"]

_MARK = "_procgroup_wrapped"


def _is_procgroup(name: Any) -> bool:
    s = str(name).lower()
    return s == "procgroup" or "cpu:procgroup" in s


def install() -> None:
    """Let ``torch.distributed.monitored_barrier`` through for procgroup groups (idempotent; never raises)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        orig = c10d.monitored_barrier
        if getattr(orig, _MARK, False):
            return

        @functools.wraps(orig)
        def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
            if c10d._rank_not_in_group(group) or not _is_procgroup(c10d.get_backend(group)):
                return orig(group, timeout, wait_all_ranks)
            if timeout is None:
                timeout = c10d._get_default_timeout(c10d.get_backend(group))
            elif isinstance(timeout, (int, float)):
                warnings.warn(  # torch's own warning for a float timeout
                    "Please specify timeout arg as a timedelta. "
                    f"Converting current value of {timeout} assuming it represents seconds",
                    stacklevel=2,
                )
                timeout = timedelta(seconds=timeout)
            g = c10d._get_default_group() if group is None else group
            return g.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

        setattr(monitored_barrier, _MARK, True)
        c10d.monitored_barrier = monitored_barrier
        if getattr(dist, "monitored_barrier", None) is orig:
            dist.monitored_barrier = monitored_barrier
    except Exception:  # noqa: BLE001 - torch's function stays as it was; procgroup's group still has the method
        import logging

        logging.getLogger("procgroup.torch").debug("could not wrap torch's monitored_barrier", exc_info=True)
