"""The per-call cost of a blocking one-tensor collective through torch (``dist.all_reduce(t)``), cut down.

What the backend would otherwise redo on every call, done once:

* :class:`ViewCache`: the numpy view procgroup's collectives work on, per tensor.  Building it from a torch
  tensor (``detach().numpy()`` and the checks around it) costs about 4 µs; looking it up costs well under
  one.  A view is reused only while the tensor still has the same data pointer, dtype, shape, contiguity and
  device, so resizing, ``set_()`` or ``.data =`` simply build a new one.  The view does not own the memory (it
  is made from the data pointer), so the cache never keeps a tensor's storage alive; it is used only during a
  blocking call, while the caller's tensor (which owns that memory) is alive and validated.  Ids of dead
  tensors are forgotten when the cache is full (it is cleared; :data:`CACHE_LIMIT`).
* :func:`op_of`: torch's ``RedOpType`` as procgroup's ReduceOp through a list indexed by its value (hashing
  the pybind enum costs about 0.8 µs); :func:`reduce_op` is the general conversion.
* :class:`GatherScratch`: the list form of a blocking all_gather (``dist.all_gather``) as one planned
  ``all_gather_into_tensor`` into a scratch buffer, then one copy per output: procgroup's list form is not
  planned, and costs about 8 µs more per call at 4 B.
* :class:`DoneWork`: the Work of a blocking op, complete when created, with only the fields that differ per
  call set in ``__init__`` (the rest are class attributes); :class:`DoneWorks` hands out the same one again
  while nothing but itself refers to it (torch's ``dist.all_reduce`` only calls ``wait()`` on it and drops it),
  so a blocking call usually builds no Work at all.

Only CPU tensors of dtypes with an exact numpy equivalent are cached (not bfloat16, whose numpy view is
``uint16``, nor complex dtypes, which can carry a conjugate bit); everything else takes the general path.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import _core
from ._work import _DONE, _NO_LOCK, Work

__all__ = ["CACHE_LIMIT", "DoneWork", "DoneWorks", "GatherScratch", "ViewCache", "op_of", "reduce_op"]

#: the list-form all_gather goes through a scratch buffer up to this many bytes in all (the buffer is kept)
LIST_GATHER_LIMIT = 1 << 20

#: views kept per backend before the cache is cleared (entries of dead tensors are never looked up again)
CACHE_LIMIT = 256

#: torch dtype -> the numpy dtype of the same bytes and arithmetic
_NUMPY: Dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}

_STRIDED = torch.strided

#: (data pointer, dtype, shape, view)
_Entry = Tuple[int, torch.dtype, torch.Size, np.ndarray]


class ViewCache:
    """Per-tensor numpy views for the blocking hot path (see the module docstring)."""

    __slots__ = ("_views",)

    def __init__(self) -> None:
        self._views: Dict[int, _Entry] = {}

    def view(self, t: Any) -> Optional[np.ndarray]:
        """A numpy array over ``t``'s memory (same shape), or None when ``t`` must take the general path.

        Valid only while ``t`` is alive and unchanged: use it within the call that was handed ``t``.
        """
        e = self._views.get(id(t))
        if e is not None:
            try:
                if (
                    t.data_ptr() == e[0]
                    and t.dtype is e[1]
                    and t.shape == e[2]
                    and t.is_cpu
                    and t.is_contiguous()
                    and not t.is_neg()
                ):
                    return e[3]
            except RuntimeError:  # no storage (a sparse tensor that reuses a dead tensor's id)
                return None
        return self._build(t)

    def _build(self, t: Any) -> Optional[np.ndarray]:
        npdt = _NUMPY.get(t.dtype)
        if npdt is None or not t.is_cpu or t.layout is not _STRIDED or not t.is_contiguous() or t.is_neg():
            return None
        n = t.numel()
        ptr = t.data_ptr()
        if n == 0 or ptr == 0:
            return None
        buf = (ctypes.c_char * (n * npdt.itemsize)).from_address(ptr)
        arr = np.frombuffer(buf, dtype=npdt).reshape(tuple(t.shape))
        if len(self._views) >= CACHE_LIMIT:
            self._views.clear()
        self._views[id(t)] = (ptr, t.dtype, t.shape, arr)
        return arr

    def clear(self) -> None:
        """Forget every view."""
        self._views.clear()


class GatherScratch:
    """The list-form all_gather of numpy views as one ``all_gather_into_tensor`` (see the module docstring)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: Optional[np.ndarray] = None

    def all_gather(self, outs: List[np.ndarray], src: np.ndarray, pg: Any, timeout: Optional[float]) -> bool:
        """Gather every rank's ``src`` into ``outs`` (one per rank); False, having done nothing, when the
        outputs do not all match ``src``'s dtype and size or the total exceeds :data:`LIST_GATHER_LIMIT`
        (then the caller takes the general path, which also names any mismatch)."""
        n, dt = src.size, src.dtype
        total = n * len(outs)
        if total * dt.itemsize > LIST_GATHER_LIMIT:
            return False
        for o in outs:
            if o.dtype != dt or o.size != n:
                return False
        buf = self._buf
        if buf is None or buf.dtype != dt or buf.size != total:
            buf = self._buf = np.empty(total, dt)
        _core.collectives.all_gather_into_tensor(
            buf, src if src.ndim == 1 else src.reshape(-1), group=pg, timeout=timeout
        )
        for i, o in enumerate(outs):
            (o if o.ndim == 1 else o.reshape(-1))[:] = buf[i * n : (i + 1) * n]
        return True


#: torch's RedOpType -> procgroup's ReduceOp (None: not implemented by procgroup, the op falls through)
_OPS: Dict[Any, Any] = {
    getattr(dist.ReduceOp, n): (None if n == "PREMUL_SUM" else _core.ReduceOp.coerce(n))
    for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
}
#: the same by ``RedOpType`` value (an index: cheaper than hashing the pybind enum)
_OP_LIST: List[Any] = [None] * (max(int(k) for k in _OPS) + 1)
for _k, _v in _OPS.items():
    _OP_LIST[int(_k)] = _v


def reduce_op(op: Any) -> Optional[Any]:
    """torch's ReduceOp (a RedOpType, or the ReduceOp instance inside an options object) as procgroup's.

    None for ops procgroup does not implement (PREMUL_SUM): the caller falls through.  Raises procgroup's
    ConfigError for something that is no reduce op at all.
    """
    op = getattr(op, "op", op)  # dist.ReduceOp instance -> its RedOpType
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        return _core.ReduceOp.coerce(op)


def op_of(opts: Any) -> Any:
    """procgroup's op for ``opts.reduceOp``; None when procgroup does not serve it (or it is unknown)."""
    try:
        return _OP_LIST[opts.reduceOp.op]
    except (IndexError, TypeError):
        return None


class DoneWork(Work):
    """The Work of a blocking op: complete when created, carrying ``result`` for ``get_future()``."""

    _default_wait = 0.0
    _exc = None
    _future = None
    _source = -1
    _event = _DONE
    _lock = _NO_LOCK

    def __init__(self, op: str, result: List[Any]) -> None:
        dist.Work.__init__(self)
        self._op = op
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        """Returns True at once: the op completed before this Work was made."""
        return True


#: sys.getrefcount of a DoneWorks' Work that nobody else holds: its attribute, the local name and the argument
_UNSHARED = 3


class DoneWorks:
    """Completed Works of one op, reused: :meth:`get` returns the previous one when no one else refers to it."""

    __slots__ = ("_op", "_work")

    def __init__(self, op: str) -> None:
        self._op = op
        self._work = DoneWork(op, [])

    def get(self, result: List[Any]) -> DoneWork:
        """A completed Work carrying ``result``: the previous one when unreferenced, else a new one."""
        w = self._work
        if sys.getrefcount(w) > _UNSHARED:  # someone kept it (its future must keep its own result)
            w = self._work = DoneWork(self._op, result)
            return w
        w._result = result
        w._future = None
        return w
