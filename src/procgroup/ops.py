"""Reduction operators: :class:`ReduceOp` and the in-place kernels the algorithms apply.

``reducer(op, dtype)`` validates ``op`` against ``dtype`` once, up front, and
returns a kernel ``k(dst, src)`` computing ``dst = dst op src`` in place.  The
collective algorithms only ever call that kernel, on equal-length 1-D slices
of the user's buffer and of scratch space, so they never look at dtypes.

Semantics follow torch.distributed:

* ``bool``: SUM and MAX are logical or, PRODUCT and MIN logical and.
* BAND / BOR / BXOR need an integer or bool dtype.
* MIN / MAX are not defined for complex numbers; NaN propagates through them.
* AVG needs a floating or complex dtype; the algorithms run it as a SUM and
  the caller applies :func:`finalize` (division by the group size) once.
* Integer SUM/PRODUCT wrap around on overflow (two's complement), as torch.

bfloat16 has no numpy dtype: its buffers are ``uint16`` arrays holding the
bfloat16 bit patterns (``dtype="bfloat16"``).  The kernel widens to float32
(exact), applies the op in float32 and rounds back to bfloat16 with
round-to-nearest-even, chunk by chunk through small per-thread buffers, so it
allocates nothing after the first call on a thread.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Callable, Tuple

import numpy as np

from .errors import ConfigError

__all__ = [
    "ReduceOp",
    "Reducer",
    "reducer",
    "finalize",
    "is_bfloat16",
    "bfloat16_to_float32",
    "float32_to_bfloat16",
    "BF16_CHUNK",
]

#: ``dst = dst op src``, in place, on equal-length 1-D arrays.
Reducer = Callable[[np.ndarray, np.ndarray], None]

#: Elements converted per step by the bfloat16 kernels (per-thread buffers of this size).
BF16_CHUNK = 1 << 15


class ReduceOp(enum.Enum):
    """Reduction operators, named (and numbered) as ``torch.distributed.ReduceOp``.

    ``dist.ReduceOp.SUM`` works as with torch.  :meth:`coerce` also accepts
    names (``"sum"``), torch's own ReduceOp members and their integer values.
    """

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    def __repr__(self) -> str:  # torch prints <RedOpType.SUM: 0>; keep it short
        return f"<ReduceOp.{self.name}>"

    @classmethod
    def coerce(cls, op: Any) -> "ReduceOp":
        """``op`` as a ReduceOp: a member, a name (any case), an int, or a torch ReduceOp."""
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            key = op.strip().upper()
            key = {"PROD": "PRODUCT", "MEAN": "AVG", "AVERAGE": "AVG"}.get(key, key)
            if key in cls.__members__:
                return cls.__members__[key]
        elif isinstance(op, (int, np.integer)) and not isinstance(op, bool):
            try:
                return cls(int(op))
            except ValueError:
                pass
        else:
            # torch.distributed.ReduceOp.SUM (a RedOpType) and similar enums carry a name; a torch
            # ReduceOp instance (as in AllreduceOptions.reduceOp) carries its RedOpType as ``op``
            inner = getattr(op, "op", None)
            if inner is not None and inner is not op:
                return cls.coerce(inner)
            name = getattr(op, "name", None)
            if isinstance(name, str) and name.upper() in cls.__members__:
                return cls.__members__[name.upper()]
        raise ConfigError(
            f"unknown reduce op {op!r}: use one of "
            + ", ".join(f"ReduceOp.{m}" for m in cls.__members__)
            + " (PREMUL_SUM is not supported)"
        )


#: torch.distributed's deprecated alias of ReduceOp
reduce_op = ReduceOp


# ----------------------------------------------------------------------------- dtypes
def is_bfloat16(dtype: Any) -> bool:
    """True for the string ``"bfloat16"`` (and a numpy dtype named so, e.g. ml_dtypes')."""
    if isinstance(dtype, str):
        return dtype.strip().lower() in ("bfloat16", "bf16")
    name = getattr(dtype, "name", None)
    if name is None:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            return False
    return name == "bfloat16"


def _np_dtype(dtype: Any) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise ConfigError(f"{dtype!r} is not a dtype that can be reduced: pass a numpy dtype or 'bfloat16'") from e


def _dtype_name(dtype: Any) -> str:
    return "bfloat16" if is_bfloat16(dtype) else str(np.dtype(dtype))


# ----------------------------------------------------------------------------- bfloat16 bits
_tls = threading.local()


def _bf16_buffers() -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = (
            np.empty(BF16_CHUNK, dtype=np.float32),
            np.empty(BF16_CHUNK, dtype=np.float32),
            np.empty(BF16_CHUNK, dtype=np.bool_),
        )
        _tls.bufs = bufs
    return bufs


def _widen(bits: np.ndarray, out: np.ndarray) -> None:
    """bfloat16 bit patterns (uint16) -> float32, exactly, into ``out``."""
    u = out.view(np.uint32)
    np.copyto(u, bits, casting="safe")
    np.left_shift(u, 16, out=u)


def _narrow(f: np.ndarray, out: np.ndarray, tmp: np.ndarray, nan: np.ndarray) -> None:
    """float32 -> bfloat16 bits with round-to-nearest-even, into uint16 ``out``.

    ``f`` is clobbered; ``tmp`` (float32-sized) and ``nan`` (bool) are scratch of
    the same length.  NaN becomes the canonical quiet NaN 0x7FC0 (as torch).
    """
    np.isnan(f, out=nan)
    u = f.view(np.uint32)
    t = tmp.view(np.uint32)
    # bias = 0x7FFF + lsb of the kept half: ties go to the even pattern.
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(u, t, out=u)  # cannot wrap for non-NaN inputs (max is 0xFF800000 + 0x8000)
    np.right_shift(u, 16, out=u)
    np.copyto(out, u, casting="unsafe")
    if nan.any():
        np.copyto(out, np.uint16(0x7FC0), where=nan)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """New float32 array from bfloat16 bit patterns (a uint16 array)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    out = np.empty(bits.shape, dtype=np.float32)
    _widen(bits, out)
    return out


def float32_to_bfloat16(x: Any) -> np.ndarray:
    """New uint16 array of bfloat16 bit patterns: ``x`` rounded to nearest even."""
    f = np.array(x, dtype=np.float32, copy=True).reshape(-1)
    out = np.empty(f.shape, dtype=np.uint16)
    _narrow(f, out, np.empty_like(f), np.empty(f.shape, dtype=np.bool_))
    return out


def _bf16_kernel(ufunc: np.ufunc) -> Reducer:
    def kernel(dst: np.ndarray, src: np.ndarray) -> None:
        a_all, b_all, nan_all = _bf16_buffers()
        d = dst.view(np.uint16)
        s = src.view(np.uint16)
        n = d.shape[0]
        if s.shape[0] != n:
            raise ValueError(f"reduce kernel: operands of {n} and {s.shape[0]} elements")
        for lo in range(0, n, BF16_CHUNK):
            hi = min(n, lo + BF16_CHUNK)
            k = hi - lo
            a, b, nan = a_all[:k], b_all[:k], nan_all[:k]
            _widen(d[lo:hi], a)
            _widen(s[lo:hi], b)
            ufunc(a, b, out=a)
            _narrow(a, d[lo:hi], b, nan)

    kernel.__name__ = f"bfloat16_{ufunc.__name__}"
    return kernel


# ----------------------------------------------------------------------------- kernels
def _ufunc_kernel(ufunc: np.ufunc) -> Reducer:
    def kernel(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    kernel.__name__ = ufunc.__name__
    kernel.ufunc = ufunc  # type: ignore[attr-defined]  # for callers that combine two inputs into a third buffer
    return kernel


_BOOL_UFUNCS = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # divided once by finalize()
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _check(op: ReduceOp, dtype: Any) -> Tuple[str, np.ufunc]:
    """(kind, ufunc) for op x dtype, or ConfigError.  kind: 'bf16' | numpy kind char."""
    if is_bfloat16(dtype):
        kind = "bf16"
        name = "bfloat16"
    else:
        dt = _np_dtype(dtype)
        kind = dt.kind
        name = str(dt)
        if kind not in "biufc":
            raise ConfigError(
                f"{op.name} is not defined for {name}: reductions need a bool, integer, floating or complex tensor"
            )
    if op in _BITWISE and kind not in "biu":
        raise ConfigError(f"{op.name} is not defined for {name}; use an integer or bool tensor")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise ConfigError(
            f"{op.name} is not defined for {name}: complex numbers are not ordered; reduce .real/.abs() instead"
        )
    if op is ReduceOp.AVG and kind in "biu":
        raise ConfigError(
            f"AVG is not defined for {name}: AVG needs a floating or complex dtype "
            "(convert to float, or use SUM and divide yourself)"
        )
    if kind == "b":
        return kind, _BOOL_UFUNCS[op]
    return kind, _UFUNCS[op]


#: (ReduceOp, dtype key) -> kernel: validating and building a kernel costs ~20 us, a lookup ~0.1 us
_KERNELS: dict = {}


def reducer(op: Any, dtype: Any) -> Reducer:
    """The in-place kernel ``k(dst, src): dst = dst op src`` for ``op`` on ``dtype``.

    ``dtype`` is a numpy dtype (or anything ``np.dtype`` takes) or ``"bfloat16"``
    (buffers are then uint16 arrays of bfloat16 bits).  Raises
    :class:`~procgroup.errors.ConfigError` when the op is not defined for the dtype.
    For AVG the kernel sums; apply :func:`finalize` to the result.

    Kernels are cached per (op, dtype): the per-call cost of a small collective matters.
    """
    rop = op if type(op) is ReduceOp else ReduceOp.coerce(op)
    try:
        k = _KERNELS.get((rop, dtype))
    except TypeError:  # an unhashable dtype spec
        k = None
    if k is not None:
        return k
    kind, ufunc = _check(rop, dtype)
    k = _bf16_kernel(ufunc) if kind == "bf16" else _ufunc_kernel(ufunc)
    try:
        if len(_KERNELS) < 1024:
            _KERNELS[(rop, dtype)] = k
    except TypeError:
        pass
    return k


def finalize(op: Any, buf: np.ndarray, group_size: int, dtype: Any = None) -> None:
    """Finish a reduction in place: for AVG divide the SUM by ``group_size``; else nothing.

    A ``uint16`` buffer under AVG is bfloat16 bits (integer AVG is rejected by
    :func:`reducer`), so ``dtype`` is only needed to be explicit.
    """
    if op is not ReduceOp.AVG:
        rop = op if type(op) is ReduceOp else ReduceOp.coerce(op)
        if rop is not ReduceOp.AVG:
            return
    rop = ReduceOp.AVG
    if group_size < 1:
        raise ConfigError(f"group_size must be >= 1, got {group_size}")
    bf16 = is_bfloat16(dtype) if dtype is not None else buf.dtype == np.uint16
    if bf16:
        d = buf.reshape(-1).view(np.uint16)
        if group_size == 1:
            return
        a_all, b_all, nan_all = _bf16_buffers()
        div = np.float32(group_size)
        for lo in range(0, d.shape[0], BF16_CHUNK):
            hi = min(d.shape[0], lo + BF16_CHUNK)
            k = hi - lo
            a = a_all[:k]
            _widen(d[lo:hi], a)
            np.divide(a, div, out=a)
            _narrow(a, d[lo:hi], b_all[:k], nan_all[:k])
        return
    _check(rop, buf.dtype if dtype is None else dtype)  # AVG on integers: ConfigError
    if group_size == 1:
        return
    np.divide(buf, group_size, out=buf)
