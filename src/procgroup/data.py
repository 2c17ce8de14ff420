"""User data -> flat numpy views, without copies.

Accepted: numpy arrays, torch CPU tensors (torch is never imported here: a
tensor is recognised by its type's module), and any object exporting the
buffer protocol (bytearray, array.array, memoryview, mmap...).

:func:`as_flat` returns a 1-D C-contiguous numpy view that shares memory
with the caller's object, plus a dtype key for the reduce kernels: a numpy
dtype, or the string ``"bfloat16"`` (the view is then ``uint16``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, Union

import numpy as np

from .errors import ConfigError, DeviceTensorError

__all__ = ["Flat", "as_flat", "is_torch_tensor", "DTypeKey", "device_error", "route_cpu_tensors", "PLAIN_DTYPES"]

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


#: the tensor types seen so far (torch.Tensor, nn.Parameter...): as_flat's check is then one set lookup
_TORCH_TYPES: set = set()


def is_torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (recognised by its type's module: torch is never imported here)."""
    t = type(obj)
    if t in _TORCH_TYPES:
        return True
    if t.__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        if len(_TORCH_TYPES) < 64:
            _TORCH_TYPES.add(t)
        return True
    return False


#: torch dtype -> numpy dtype of the same bytes and arithmetic (filled on first use: torch is not imported here)
_TORCH_NUMPY: Dict[Any, np.dtype] = {}

#: ctypes ``c_char * nbytes`` array types by size (creating one costs several µs); bounded
_BUFFER_TYPES: Dict[int, Any] = {}
BUFFER_TYPE_LIMIT = 1024

_STRIDED: Any = None
#: the numpy dtype a bfloat16 tensor is viewed as (only bfloat16 maps to it)
_BF16_VIEW = np.dtype(np.uint16)


def _torch_numpy_map() -> None:
    """Fill :data:`_TORCH_NUMPY` and :data:`_STRIDED` (torch is imported by then: the caller holds a tensor)."""
    import torch

    global _STRIDED
    _STRIDED = torch.strided
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"):
        _TORCH_NUMPY[getattr(torch, name)] = np.dtype(name)
    _TORCH_NUMPY[torch.bfloat16] = _BF16_VIEW  # carried as its bytes; the reduce kernels take the "bfloat16" key


def _torch_view(t: Any) -> Any:
    """A flat numpy array over the memory of a plain contiguous CPU tensor, or None (then the general path).

    Built from the tensor's *current* data pointer on every call, so nothing stale can be reused: a tensor
    resized, re-pointed (``set_``, ``.data =``), restrided or given another dtype simply gets a view of what it
    is now.  What is cached is only what costs (the ctypes buffer type of each size, the dtype map), and not
    ``Tensor.numpy()``, which also marks the storage as not resizable.  The array's buffer holds a reference to
    ``t``, so an async op's memory stays alive until the op is done, as with ``numpy()``.
    """
    if not _TORCH_NUMPY:
        _torch_numpy_map()
    npdt = _TORCH_NUMPY.get(t.dtype)
    if npdt is None or not t.is_cpu or t.layout is not _STRIDED or not t.is_contiguous() or t.is_neg():
        return None
    nbytes = t.numel() * npdt.itemsize
    ptr = t.data_ptr()
    if nbytes == 0 or ptr == 0:
        return None
    bt = _BUFFER_TYPES.get(nbytes)
    if bt is None:
        bt = ctypes.c_char * nbytes
        if len(_BUFFER_TYPES) >= BUFFER_TYPE_LIMIT:
            _BUFFER_TYPES.clear()
        _BUFFER_TYPES[nbytes] = bt
    buf = bt.from_address(ptr)
    buf.owner = t  # the memory's owner lives as long as the array
    return np.frombuffer(buf, npdt)


def tensor_view(x: Any) -> Any:
    """A flat numpy view of ``x`` when it is a plain contiguous CPU torch tensor whose numpy dtype also carries
    its arithmetic (every dtype but bfloat16, which travels as its bytes), else None.

    For the planned fronts of the collectives, so that a torch tensor runs the same cached plan as a numpy array
    of its dtype and size (the view is built anew on every call: see :func:`_torch_view`).
    """
    if not is_torch_tensor(x):
        return None
    a = _torch_view(x)
    return None if a is None or a.dtype is _BF16_VIEW else a


def _torch_flat(t: Any, name: str, writable: bool) -> Flat:
    arr = _torch_view(t)
    if arr is not None:
        dt = arr.dtype
        return Flat(arr, "bfloat16" if dt is _BF16_VIEW else dt, t.shape)
    if t.device.type != "cpu":
        raise device_error(t, name)
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
    dkey: DTypeKey
    if d.dtype == torch.bfloat16:
        arr = d.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        dkey = "bfloat16"
    else:
        arr = d.numpy().reshape(-1)
        dkey = arr.dtype
    return Flat(arr, dkey, shape, back)


def device_error(t: Any, name: str) -> DeviceTensorError:
    """The error of a tensor on a device: the collectives catch it and hand the call to the world's engine when
    that engine carries the device (backend="nccl"); elsewhere the caller gets it, naming the fix."""
    return DeviceTensorError(
        f"{name} is on device {t.device}; the cpu backend takes CPU tensors: move it with .cpu(), "
        "or init_process_group(backend='nccl') for CUDA tensors",
        device=t.device,
    )


_plain_torch_flat = _torch_flat


def _routed_torch_flat(t: Any, name: str, writable: bool) -> Flat:
    """:func:`_torch_flat` with CPU tensors treated as device tensors (see :func:`route_cpu_tensors`)."""
    raise device_error(t, name)


def route_cpu_tensors(on: bool) -> None:
    """Treat torch CPU tensors as device tensors in this process (``on``), or not (the default).

    For a test backend whose engine carries CPU tensors through torch's gloo (``tests/backends/torch_gloo``),
    so that the delegation path of ``backend="nccl"`` runs on a machine without a GPU.  It swaps the function
    :func:`as_flat` calls for torch tensors, so the default path pays nothing for this switch.
    """
    global _torch_flat
    _torch_flat = _routed_torch_flat if on else _plain_torch_flat


#: numpy dtypes already checked to be plain numeric (the per-call check is then one set lookup)
_PLAIN: set = set()
#: the same set, for the blocking point-to-point fast path (procgroup.p2p)
PLAIN_DTYPES = _PLAIN


def as_flat(obj: Any, name: str = "tensor", *, writable: bool = True) -> Flat:
    """A flat view of ``obj``.  ``writable``: results will be written into it."""
    if type(obj) is np.ndarray and obj.dtype in _PLAIN:
        fl = obj.flags
        if fl.c_contiguous and (fl.writeable or not writable):  # the common case, checked as below
            return Flat(obj.reshape(-1), obj.dtype, obj.shape)
    if type(obj) in _TORCH_TYPES:
        return _torch_flat(obj, name, writable)
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
