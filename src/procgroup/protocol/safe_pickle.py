"""Safe mode of the object collectives: an unpickler that rebuilds data, never runs code (issue 11 item 17).

Plain ``pickle.loads`` calls whatever callable the stream names (``os.system``, ``builtins.eval``...), so
a peer's object collective can run code on every rank.  :class:`RestrictedUnpickler` resolves a global
only when it is on an allow-list:

* value types of ``builtins`` (``int``, ``str``, ``dict``, ``set``, ``slice``...) and the builtin
  exception classes -- never ``eval``, ``exec``, ``getattr``, ``__import__``, ``open`` and the like;
* ``collections`` containers, ``datetime`` values, ``decimal.Decimal``, ``fractions.Fraction``;
* numpy arrays (every dtype, structured and object arrays included: an object array's items pass the
  same check), dtypes and scalar types;
* torch tensors and parameters, ``torch.Size``, ``torch.device`` and the ``torch.<dtype>`` names.  A
  tensor's storage travels as ``torch.save`` bytes, which this loader opens with
  ``torch.load(..., weights_only=True)`` -- torch's own restricted unpickler -- never plain ``torch.load``;
* the caller's allow-list: ``"module.Qualname"`` entries, or ``"module.*"`` for every name of a module.

Anything else raises :class:`~procgroup.errors.UnsafeObjectError` naming the class and the setting that
admits it.  Sans-IO: bytes in, objects out.
"""

from __future__ import annotations

import builtins
import io
import pickle
import sys
from typing import Any, Callable, FrozenSet, Iterable, Optional

from ..errors import UnsafeObjectError

__all__ = ["RestrictedUnpickler", "safe_loads", "SAFE_BUILTINS", "allow_list"]

#: names of ``builtins`` that only build values (the exception classes are admitted besides these)
SAFE_BUILTINS = frozenset(
    {
        "bool",
        "int",
        "float",
        "complex",
        "str",
        "bytes",
        "bytearray",
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "slice",
        "range",
        "object",
        "Ellipsis",
        "NotImplemented",
    }
)

_SAFE_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.deque",
        "collections.Counter",
        "copyreg._reconstructor",  # (cls, base, state): both classes pass this same check
        "datetime.date",
        "datetime.time",
        "datetime.datetime",
        "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal",
        "fractions.Fraction",
        # numpy 1.x (numpy.core) and 2.x (numpy._core): array and scalar reconstruction
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy.core.numeric._frombuffer",
        "numpy._core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
        "numpy._core.numeric._frombuffer",
        # torch tensors (their storage: see _torch_storage_from_bytes)
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch.Size",
        "torch.device",
    }
)


def allow_list(names: Optional[Iterable[str]]) -> FrozenSet[str]:
    """The user's allow-list as a frozenset of ``"module.Qualname"`` / ``"module.*"`` strings (blanks dropped)."""
    return frozenset(n.strip() for n in (names or ()) if n and n.strip())


def _torch_storage_from_bytes(b: bytes) -> Any:
    """``torch.storage._load_from_bytes`` with torch's restricted unpickler (it would use plain torch.load)."""
    import torch

    try:
        return torch.load(io.BytesIO(b), weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeObjectError(
            f"safe mode refused a torch storage: torch.load(weights_only=True) rejected it ({e}); "
            "turn safe mode off (safe=False) only if you trust the sender",
            name="torch.storage._load_from_bytes",
        ) from e


def _numpy_type(module: str, name: str) -> bool:
    """``numpy.<scalar type>`` (e.g. numpy.float32) or ``numpy.dtypes.<X>DType``, without importing numpy."""
    np = sys.modules.get("numpy")
    if np is None or module not in ("numpy", "numpy.dtypes"):
        return False
    obj = getattr(np if module == "numpy" else getattr(np, "dtypes", None), name, None)
    return isinstance(obj, type) and (issubclass(obj, np.generic) or issubclass(obj, np.dtype))


def _torch_dtype(module: str, name: str) -> bool:
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler whose ``find_class`` admits only the allow-list (see the module docstring)."""

    def __init__(self, file: Any, *, allowed: Iterable[str] = (), buffers: Any = None) -> None:
        super().__init__(file, buffers=buffers)
        self.allowed = allow_list(allowed)

    def admits(self, module: str, name: str) -> bool:
        """Whether global ``module.name`` may be loaded."""
        full = f"{module}.{name}"
        if full in self.allowed or f"{module}.*" in self.allowed or full in _SAFE_GLOBALS:
            return True
        if module == "builtins":
            if name in SAFE_BUILTINS:
                return True
            obj = getattr(builtins, name, None)
            return isinstance(obj, type) and issubclass(obj, BaseException)
        return _numpy_type(module, name) or _torch_dtype(module, name)

    def find_class(self, module: str, name: str) -> Any:
        """Resolve an allowed global; UnsafeObjectError naming any other."""
        if module == "torch.storage" and name == "_load_from_bytes":
            return _torch_storage_from_bytes
        if not self.admits(module, name):
            raise UnsafeObjectError(
                f"safe mode refused to unpickle {module}.{name}: it is not a builtin value type, numpy array "
                f"or torch tensor. If you trust the sender, allow it with allowed=[{module + '.' + name!r}] "
                f"(or PROCGROUP_SAFE_OBJECTS_ALLOW={module}.{name}); or turn safe mode off (safe=False)",
                name=f"{module}.{name}",
            )
        return super().find_class(module, name)


def safe_loads(body: Any, *, allowed: Iterable[str] = (), buffers: Any = None) -> Any:
    """``pickle.loads`` through :class:`RestrictedUnpickler` (``buffers``: the out-of-band buffers)."""
    loader: Callable[[], Any] = RestrictedUnpickler(io.BytesIO(body), allowed=allowed, buffers=buffers).load
    return loader()
