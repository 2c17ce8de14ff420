"""User data -> flat numpy views, without copies.

Accepted: numpy arrays, torch CPU tensors (torch is never imported here: a
tensor is recognised by its type's module), and any object exporting the
buffer protocol (bytearray, array.array, memoryview, mmap...).

:func:`as_flat` returns a 1-D C-contiguous numpy view that shares memory
with the caller's object, plus a dtype key for the reduce kernels: a numpy
dtype, or the string ``"bfloat16"`` (the view is then ``uint16``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from .errors import ConfigError

__all__ = ["Flat", "as_flat", "is_torch_tensor", "DTypeKey"]

DTypeKey = Union[np.dtype, str]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1 us, and this is on every call
class Flat:
    array: np.ndarray  # 1-D, C-contiguous, shares memory with the user's object
    dtype: DTypeKey  # numpy dtype or "bfloat16"
    shape: tuple  # the user's shape, for messages
    #: None, or (for a non-contiguous writable input) a callable copying ``array`` back into the user's object;
    #: collectives call it once the op has written its result, before the caller (or its Work) sees it
    back: Any = None

    @property
    def numel(self) -> int:
        return int(self.array.size)

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def is_torch_tensor(obj: Any) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous")


def _torch_flat(t: Any, name: str, writable: bool) -> Flat:
    if t.device.type != "cpu":
        raise ConfigError(
            f"{name} is on device {t.device}; the cpu backend takes CPU tensors: move it with .cpu(), "
            "or init_process_group(backend='nccl') for CUDA tensors"
        )
    import torch  # already imported by the caller, since they hold a tensor

    back = None
    if not t.is_contiguous():
        orig = t
        t = t.contiguous()
        if writable:  # as torch's gloo: run on a contiguous copy, copy the result back when the op completes
            copy = t

            def back() -> None:
                with torch.no_grad():
                    orig.copy_(copy)

    shape = tuple(t.shape)
    d = t.detach()
    if d.is_conj():
        d = d.resolve_conj()
    if d.dtype == torch.bfloat16:
        arr = d.view(torch.int16).numpy().view(np.uint16)
        return Flat(arr.reshape(-1), "bfloat16", shape, back)
    arr = d.numpy()
    return Flat(arr.reshape(-1), arr.dtype, shape, back)


#: numpy dtypes already checked to be plain numeric (the per-call check is then one set lookup)
_PLAIN: set = set()


def as_flat(obj: Any, name: str = "tensor", *, writable: bool = True) -> Flat:
    """A flat view of ``obj``.  ``writable``: results will be written into it."""
    if type(obj) is np.ndarray and obj.dtype in _PLAIN:
        fl = obj.flags
        if fl.c_contiguous and (fl.writeable or not writable):  # the common case, checked as below
            return Flat(obj.reshape(-1), obj.dtype, obj.shape)
    if isinstance(obj, np.ndarray):
        arr = obj
    elif is_torch_tensor(obj):
        return _torch_flat(obj, name, writable)
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise ConfigError(
                f"{name} of type {type(obj).__name__} is not a numpy array, a torch tensor or a buffer; "
                "pass np.asarray(x) or a bytearray"
            ) from None
        arr = np.asarray(mv)
        if mv.ndim == 0 and mv.format == "B" and mv.nbytes > 0:
            arr = np.frombuffer(mv, dtype=np.uint8)
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise ConfigError(
            f"{name} has dtype {arr.dtype}, which is not a plain numeric dtype; "
            "use the *_object collectives for Python objects"
        )
    if writable and not arr.flags.writeable:
        raise ConfigError(f"{name} is read-only; results are written into it, so pass a writable array (np.array(x))")
    back = None
    if not arr.flags.c_contiguous:
        orig = arr
        arr = np.ascontiguousarray(arr)
        if writable:  # as torch's gloo: run on a contiguous copy, copy the result back when the op completes
            copy = arr

            def back() -> None:
                np.copyto(orig, copy)

    if len(_PLAIN) < 64:
        _PLAIN.add(arr.dtype)
    return Flat(arr.reshape(-1), arr.dtype, tuple(arr.shape), back)


def after(fn: Any, flats: Any) -> Any:
    """``fn``, or (when any of ``flats`` is a copy of a non-contiguous input) ``fn`` then the copies back."""
    backs = [f.back for f in flats if f.back is not None]
    if not backs:
        return fn

    def run(*a: Any) -> Any:
        r = fn(*a)
        for b in backs:
            b()
        return r

    return run
