"""Safe mode of the object collectives (issue 11 item 17): the restricted unpickler admits values, numpy
arrays, torch tensors and an allow-list, and refuses anything else naming the class."""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import os
import pickle
from types import SimpleNamespace
from typing import Any, Iterable, Optional

import numpy as np
import pytest

from procgroup.config import ENV, SafeObjects, safe_objects
from procgroup.errors import ConfigError, ProcGroupError, UnsafeObjectError
from procgroup.objects import _safe_mode
from procgroup.protocol import payload

pytestmark = pytest.mark.timeout(60)


def roundtrip(obj: Any, allowed: Optional[Iterable[str]] = ()) -> Any:
    """Encode as the object collectives do (pickle 5, out-of-band buffers), decode in safe mode."""
    total, segs = payload.dumps(obj)
    return payload.loads(payload.join(segs, total), allowed=allowed)


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


class Evil:
    """What an attacker holding the job secret would send: unpickling it runs a shell command."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


VALUES = [
    None,
    True,
    7,
    2**100,
    1.5,
    complex(1, 2),
    "text",
    b"bytes",
    bytearray(b"ba"),
    [1, [2, 3]],
    (1, "a"),
    {"k": [1, 2]},
    {1, 2},
    frozenset({3}),
    slice(1, 5, 2),
    range(3),
    Ellipsis,
    collections.OrderedDict(a=1),
    collections.defaultdict(list, a=[1]),
    collections.Counter("abca"),
    collections.deque([1, 2]),
    datetime.datetime(2026, 11, 27, 1, 2, 3),
    datetime.date(2026, 1, 1),
    datetime.timedelta(seconds=5),
    decimal.Decimal("1.25"),
    fractions.Fraction(1, 3),
    ValueError("boom"),
]


@pytest.mark.parametrize("obj", VALUES, ids=lambda o: type(o).__name__)
def test_builtin_values_round_trip(obj: Any) -> None:
    got = roundtrip(obj)
    if isinstance(obj, BaseException):
        assert type(got) is type(obj) and got.args == obj.args
    else:
        assert got == obj and type(got) is type(obj)


DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "longdouble",
    "complex64",
    "complex128",
    "clongdouble",
    "datetime64[ns]",
    "timedelta64[s]",
    "U5",
    "S3",
    [("a", "i4"), ("b", "f8")],
    "O",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numpy_arrays_of_every_dtype_round_trip(dtype: Any) -> None:
    dt = np.dtype(dtype)
    a = np.arange(12).astype(dt) if dt.kind != "V" else np.zeros(12, dt)
    if dt.kind == "O":
        a[:] = [i * 2 for i in range(12)]
    for x in (a, a.reshape(3, 4), a.reshape(3, 4).T, a[::2], a[0:0], a[3]):  # contiguous, Fortran, strided, 0-d
        got = roundtrip({"x": x})["x"]
        ref = pickle.loads(pickle.dumps(x, protocol=5))  # what plain pickle gives
        assert type(got) is type(ref)
        if dt.kind == "O":
            assert np.array_equal(got, ref)
        else:
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.tobytes() == ref.tobytes()
    assert roundtrip(dt) == dt  # the dtype itself
    assert roundtrip(dt.type) is dt.type  # and its scalar type (np.float32, ...)


def test_torch_tensors_round_trip() -> None:
    torch = pytest.importorskip("torch")
    for t in (
        torch.arange(6.0).reshape(2, 3),
        torch.ones(3, dtype=torch.bfloat16)[1:],
        torch.tensor([True, False]),
        torch.arange(4, dtype=torch.int64).reshape(2, 2).t(),
        torch.nn.Parameter(torch.ones(2)),
    ):
        got = roundtrip([t])[0]
        assert type(got) is type(t) and got.dtype == t.dtype and torch.equal(got, t)
    assert roundtrip((torch.Size([2, 3]), torch.device("cpu"), torch.float16)) == (
        torch.Size([2, 3]),
        torch.device("cpu"),
        torch.float16,
    )


def test_os_system_payload_is_refused_naming_the_class(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeObjectError) as ei:
        roundtrip([1, Evil(str(marker))])
    assert not marker.exists()  # the command never ran
    assert ei.value.name in ("posix.system", "os.system", "nt.system")
    msg = str(ei.value)
    assert ei.value.name in msg and "allowed=" in msg and "PROCGROUP_SAFE_OBJECTS_ALLOW" in msg
    assert isinstance(ei.value, ProcGroupError) and isinstance(ei.value, pickle.UnpicklingError)
    roundtrip_plain = payload.loads(payload.join(*reversed(payload.dumps([1]))))  # plain mode still works
    assert roundtrip_plain == [1]


@pytest.mark.parametrize(
    "name",
    [
        "builtins.eval",
        "builtins.exec",
        "builtins.getattr",
        "builtins.__import__",
        "builtins.open",
        "builtins.compile",
        "builtins.setattr",
        "os.system",
        "subprocess.Popen",
        "posix.system",
        "builtins.type",
        "pickle.loads",
    ],
)
def test_dangerous_globals_are_refused(name: str) -> None:
    from procgroup.protocol.safe_pickle import safe_loads

    module, attr = name.rsplit(".", 1)
    body = b"c" + module.encode() + b"\n" + attr.encode() + b"\n."  # GLOBAL opcode: a crafted stream's reference
    with pytest.raises(UnsafeObjectError, match=name.replace(".", r"\.")) as ei:
        safe_loads(body)
    assert ei.value.name == name


def test_user_classes_need_the_allow_list() -> None:
    name = f"{Point.__module__}.{Point.__qualname__}"
    with pytest.raises(UnsafeObjectError, match=name):
        roundtrip(Point(1, 2))
    assert roundtrip(Point(1, 2), allowed=[name]) == Point(1, 2)
    assert roundtrip(Point(1, 2), allowed=[f"{Point.__module__}.*"]) == Point(1, 2)
    with pytest.raises(UnsafeObjectError):  # a wildcard admits its own module only
        roundtrip(Evil("/nonexistent/x"), allowed=["procgroup.*"])


def test_torch_storage_is_loaded_with_weights_only(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    import io

    buf = io.BytesIO()
    torch.save(Evil(str(tmp_path / "pwned")), buf)
    crafted = pickle.dumps(_StorageFromBytes(buf.getvalue()), protocol=5)
    from procgroup.protocol.safe_pickle import safe_loads

    with pytest.raises(UnsafeObjectError, match="weights_only"):
        safe_loads(crafted)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(Exception):  # noqa: B017, PT011 - what plain pickle would do: run it
        torch.storage._load_from_bytes(b"not a torch file")


class _StorageFromBytes:
    """Pickles as torch.storage._load_from_bytes(data), the way a tensor's storage travels."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> Any:
        import torch.storage

        return (torch.storage._load_from_bytes, (self.data,))


def test_environment_is_parsed_with_named_errors() -> None:
    assert safe_objects({}) == SafeObjects(False, ())
    env = {ENV.SAFE_OBJECTS: "1", ENV.SAFE_OBJECTS_ALLOW: " a.B , c.* ,"}
    assert safe_objects(env) == SafeObjects(True, ("a.B", "c.*"))
    with pytest.raises(ConfigError, match=ENV.SAFE_OBJECTS):
        safe_objects({ENV.SAFE_OBJECTS: "maybe"})
    with pytest.raises(ConfigError, match=ENV.SAFE_OBJECTS_ALLOW):
        safe_objects({ENV.SAFE_OBJECTS_ALLOW: "Point"})


def test_per_call_setting_wins_over_the_environment() -> None:
    def g(enabled: bool, allowed: tuple = ()) -> Any:
        return SimpleNamespace(world=SimpleNamespace(safe_objects=SafeObjects(enabled, allowed)))

    assert _safe_mode(g(False), None, None) is None  # default: plain pickle
    assert _safe_mode(g(True, ("a.B",)), None, None) == frozenset({"a.B"})
    assert _safe_mode(g(True), False, None) is None  # safe=False wins over the environment
    assert _safe_mode(g(False), True, None) == frozenset()
    assert _safe_mode(g(False), None, ["x.Y"]) == frozenset({"x.Y"})  # allowed= alone turns it on
    assert _safe_mode(g(False, ("a.B",)), True, ["x.Y"]) == frozenset({"a.B", "x.Y"})
