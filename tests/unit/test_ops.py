"""ReduceOp, reducer kernels (every op x dtype), bfloat16 bit conversion, AVG finalize."""

from __future__ import annotations

import enum
import math
import tracemalloc
import zlib

import numpy as np
import pytest

from procgroup.errors import ConfigError
from procgroup.ops import (
    BF16_CHUNK,
    ReduceOp,
    bfloat16_to_float32,
    finalize,
    float32_to_bfloat16,
    is_bfloat16,
    reducer,
)

OPS = list(ReduceOp)
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = INT_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES + ["bool", "bfloat16"]


# ----------------------------------------------------------------------------- ReduceOp
def test_reduceop_names_and_torch_values():
    assert [m.name for m in ReduceOp] == ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    # torch.distributed.ReduceOp.RedOpType numbering
    assert (ReduceOp.SUM.value, ReduceOp.AVG.value, ReduceOp.PRODUCT.value, ReduceOp.BXOR.value) == (0, 1, 2, 7)
    assert ReduceOp.SUM is not ReduceOp.MAX and ReduceOp["MIN"] is ReduceOp.MIN


class _TorchLike(enum.Enum):  # what torch.distributed.ReduceOp.SUM looks like: an enum member with .name
    SUM = 0
    BXOR = 7
    PREMUL_SUM = 8


@pytest.mark.parametrize(
    "given, want",
    [
        (ReduceOp.MAX, ReduceOp.MAX),
        ("sum", ReduceOp.SUM),
        ("BOR", ReduceOp.BOR),
        (" avg ", ReduceOp.AVG),
        ("prod", ReduceOp.PRODUCT),
        (4, ReduceOp.MAX),
        (np.int64(2), ReduceOp.PRODUCT),
        (_TorchLike.SUM, ReduceOp.SUM),
        (_TorchLike.BXOR, ReduceOp.BXOR),
    ],
)
def test_coerce(given, want):
    assert ReduceOp.coerce(given) is want


@pytest.mark.parametrize("bad", ["median", 99, -1, True, None, 1.5, _TorchLike.PREMUL_SUM])
def test_coerce_rejects(bad):
    with pytest.raises(ConfigError, match="unknown reduce op"):
        ReduceOp.coerce(bad)


def test_reducer_rejects_unknown_op():
    with pytest.raises(ConfigError):
        reducer("median", np.float32)


# ----------------------------------------------------------------------------- validity table
def _valid(op: ReduceOp, dt: str) -> bool:
    if dt in INT_DTYPES:
        return op is not ReduceOp.AVG
    if dt == "bool":
        return op is not ReduceOp.AVG
    if dt in FLOAT_DTYPES or dt == "bfloat16":
        return op not in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
    if dt in COMPLEX_DTYPES:
        return op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG)
    raise AssertionError(dt)


TABLE = [(op, dt) for op in OPS for dt in ALL_DTYPES]


def _wrap(v: int, dt: np.dtype) -> int:
    bits = dt.itemsize * 8
    v &= (1 << bits) - 1
    if dt.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def _inputs(dt: str, op: ReduceOp):
    """Two arrays with values that exercise the op (incl. integer wrap-around)."""
    rng = np.random.default_rng(zlib.crc32(f"{dt}-{op.name}".encode()))
    if dt == "bool":
        a = np.array([0, 0, 1, 1] * 4, dtype=bool)
        b = np.array([0, 1, 0, 1] * 4, dtype=bool)
        return a, b
    if dt in INT_DTYPES:
        d = np.dtype(dt)
        info = np.iinfo(d)
        if op is ReduceOp.PRODUCT:
            lo, hi = (-12, 12) if d.kind == "i" else (0, 24)
        else:
            lo, hi = int(info.min), int(info.max)
        a = rng.integers(lo, hi, 16, endpoint=True, dtype=np.int64 if d.kind == "i" else np.uint64).astype(d)
        b = rng.integers(lo, hi, 16, endpoint=True, dtype=np.int64 if d.kind == "i" else np.uint64).astype(d)
        a[0], b[0] = info.max, info.max  # SUM/PRODUCT overflow wraps
        a[1], b[1] = info.min, info.max
        return a, b
    if dt in COMPLEX_DTYPES:
        d = np.dtype(dt)
        a = (rng.standard_normal(16) + 1j * rng.standard_normal(16)).astype(d)
        b = (rng.standard_normal(16) + 1j * rng.standard_normal(16)).astype(d)
        return a, b
    if dt == "bfloat16":
        a = float32_to_bfloat16(rng.standard_normal(16) * 8)
        b = float32_to_bfloat16(rng.standard_normal(16) * 8)
        return a, b
    d = np.dtype(dt)
    a = (rng.standard_normal(16) * 8).astype(d)
    b = (rng.standard_normal(16) * 8).astype(d)
    return a, b


def _reference(op: ReduceOp, dt: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-by-element in Python arithmetic (not the numpy ufuncs the kernels use)."""
    if dt == "bool":
        f = {
            ReduceOp.SUM: lambda x, y: x or y,
            ReduceOp.MAX: lambda x, y: x or y,
            ReduceOp.BOR: lambda x, y: x or y,
            ReduceOp.PRODUCT: lambda x, y: x and y,
            ReduceOp.MIN: lambda x, y: x and y,
            ReduceOp.BAND: lambda x, y: x and y,
            ReduceOp.BXOR: lambda x, y: x != y,
        }[op]
        return np.array([f(bool(x), bool(y)) for x, y in zip(a, b)], dtype=bool)
    if dt in INT_DTYPES:
        d = np.dtype(dt)
        f = {
            ReduceOp.SUM: lambda x, y: x + y,
            ReduceOp.PRODUCT: lambda x, y: x * y,
            ReduceOp.MIN: min,
            ReduceOp.MAX: max,
            ReduceOp.BAND: lambda x, y: x & y,
            ReduceOp.BOR: lambda x, y: x | y,
            ReduceOp.BXOR: lambda x, y: x ^ y,
        }[op]
        return np.array([_wrap(f(int(x), int(y)), d) for x, y in zip(a, b)], dtype=d)
    if dt == "bfloat16":
        fa, fb = _bf16_decode(a).astype(np.float32), _bf16_decode(b).astype(np.float32)
        f = {
            ReduceOp.SUM: lambda x, y: x + y,
            ReduceOp.AVG: lambda x, y: x + y,
            ReduceOp.PRODUCT: lambda x, y: x * y,
            ReduceOp.MIN: min,
            ReduceOp.MAX: max,
        }[op]
        exact = np.array([f(x, y) for x, y in zip(fa, fb)], dtype=np.float32)
        return np.array([_bf16_round_ref(float(v)) for v in exact], dtype=np.uint16)
    f = {
        ReduceOp.SUM: lambda x, y: x + y,
        ReduceOp.AVG: lambda x, y: x + y,
        ReduceOp.PRODUCT: lambda x, y: x * y,
        ReduceOp.MIN: min,
        ReduceOp.MAX: max,
    }[op]
    return np.array([f(x, y) for x, y in zip(a, b)], dtype=a.dtype)


@pytest.mark.parametrize("op, dt", TABLE, ids=[f"{o.name}-{d}" for o, d in TABLE])
def test_op_dtype_table(op, dt):
    dtype = "bfloat16" if dt == "bfloat16" else np.dtype(dt)
    if not _valid(op, dt):
        with pytest.raises(ConfigError) as ei:
            reducer(op, dtype)
        msg = str(ei.value)
        assert op.name in msg and dt in msg
        return
    k = reducer(op, dtype)
    a, b = _inputs(dt, op)
    want = _reference(op, dt, a, b)
    dst, src = a.copy(), b.copy()
    assert k(dst, src) is None
    np.testing.assert_array_equal(src, b)  # src untouched
    if dt in COMPLEX_DTYPES:  # complex multiply is several roundings; the reference is per-element Python
        np.testing.assert_allclose(dst, want, rtol=1e-6 if dt == "complex64" else 1e-14)
    elif dt in FLOAT_DTYPES:
        np.testing.assert_array_equal(dst, want)  # one IEEE op: exact
    else:
        assert dst.tobytes() == want.tobytes(), (dst, want)


@pytest.mark.parametrize(
    "op, dt, text",
    [
        (ReduceOp.BAND, "float32", "BAND is not defined for float32; use an integer or bool tensor"),
        (ReduceOp.BXOR, "float16", "BXOR is not defined for float16; use an integer or bool tensor"),
        (ReduceOp.BOR, "bfloat16", "BOR is not defined for bfloat16; use an integer or bool tensor"),
        (ReduceOp.BAND, "complex64", "use an integer or bool tensor"),
        (ReduceOp.MIN, "complex64", "not ordered"),
        (ReduceOp.MAX, "complex128", "not ordered"),
        (ReduceOp.AVG, "int32", "AVG needs a floating or complex dtype"),
        (ReduceOp.AVG, "uint8", "AVG needs a floating or complex dtype"),
        (ReduceOp.AVG, "bool", "AVG needs a floating or complex dtype"),
    ],
)
def test_error_messages(op, dt, text):
    with pytest.raises(ConfigError) as ei:
        reducer(op, dt if dt == "bfloat16" else np.dtype(dt))
    assert text in str(ei.value)


@pytest.mark.parametrize("dt", [object, "U4", "datetime64[s]", "V8"])
def test_non_numeric_dtypes_rejected(dt):
    with pytest.raises(ConfigError, match="reductions need"):
        reducer(ReduceOp.SUM, dt)


def test_bad_dtype_object():
    with pytest.raises(ConfigError):
        reducer(ReduceOp.SUM, "no-such-dtype")


def test_dtype_spellings():
    assert is_bfloat16("bfloat16") and is_bfloat16("BF16") and not is_bfloat16(np.uint16)
    k = reducer("sum", "int32")  # anything np.dtype takes
    a = np.array([1, 2], np.int32)
    k(a, np.array([3, 4], np.int32))
    assert a.tolist() == [4, 6]


def test_bool_semantics_like_torch():
    t, f = np.array([True, True, False, False]), np.array([True, False, True, False])
    out = {}
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BXOR):
        d = t.copy()
        reducer(op, np.bool_)(d, f)
        out[op] = d.tolist()
    assert out[ReduceOp.SUM] == [True, True, True, False]  # logical or
    assert out[ReduceOp.MAX] == [True, True, True, False]
    assert out[ReduceOp.PRODUCT] == [True, False, False, False]  # logical and
    assert out[ReduceOp.MIN] == [True, False, False, False]
    assert out[ReduceOp.BXOR] == [False, True, True, False]


def test_float_min_max_propagate_nan():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    reducer(ReduceOp.MAX, np.float32)(a, np.array([np.nan, 2.0, 1.0], np.float32))
    assert np.isnan(a[0]) and np.isnan(a[1]) and a[2] == 3.0


def test_kernels_on_slices_and_empty():
    k = reducer(ReduceOp.SUM, np.int64)
    a = np.arange(10, dtype=np.int64)
    k(a[2:5], np.array([10, 10, 10], np.int64))
    assert a.tolist() == [0, 1, 12, 13, 14, 5, 6, 7, 8, 9]
    k(a[:0], a[:0])
    kb = reducer(ReduceOp.SUM, "bfloat16")
    e = np.empty(0, np.uint16)
    kb(e, e)


# ----------------------------------------------------------------------------- bfloat16 bits
def _bf16_value(bits: int) -> float:
    """Exact value of a bfloat16 pattern, by the IEEE formula; exponent 0xFF decodes as if unbounded."""
    s = -1.0 if bits & 0x8000 else 1.0
    e = (bits >> 7) & 0xFF
    m = bits & 0x7F
    if e == 0:
        return s * math.ldexp(m / 128.0, -126)
    return s * math.ldexp(1.0 + m / 128.0, e - 127)


def _bf16_decode(bits: np.ndarray) -> np.ndarray:
    out = []
    for b in bits.tolist():
        e, m = (b >> 7) & 0xFF, b & 0x7F
        if e == 0xFF:
            out.append(float("nan") if m else math.copysign(math.inf, -1.0 if b & 0x8000 else 1.0))
        else:
            out.append(_bf16_value(b))
    return np.array(out, dtype=np.float64)


def _bf16_round_ref(x: float) -> int:
    """Round-to-nearest-even to bfloat16 by comparing exact distances to the two neighbours."""
    if math.isnan(x):
        return 0x7FC0
    if math.isinf(x):
        return 0xFF80 if x < 0 else 0x7F80
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    ax = abs(x)
    f32 = int(np.array([ax], np.float32).view(np.uint32)[0])  # ax is a float32 value
    lo = f32 >> 16
    hi = lo + 1
    dlo = ax - _bf16_value(lo)
    dhi = _bf16_value(hi) - ax
    assert dlo >= 0 and dhi > 0
    if dlo < dhi or (dlo == dhi and lo % 2 == 0):
        pick = lo
    else:
        pick = hi
    return sign | pick


def test_bf16_widen_all_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bfloat16_to_float32(bits)
    assert f.dtype == np.float32
    want = _bf16_decode(bits)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(f), nan)
    assert np.array_equal(f[~nan].astype(np.float64), want[~nan])
    # signed zero survives
    assert np.signbit(f[0x8000]) and f[0x8000] == 0


def test_bf16_roundtrip_all_patterns():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    back = float32_to_bfloat16(bfloat16_to_float32(bits))
    nan = ((bits >> 7) & 0xFF == 0xFF) & (bits & 0x7F != 0)
    assert np.array_equal(back[~nan], bits[~nan])
    assert np.all(back[nan] == 0x7FC0)


def test_bf16_round_to_nearest_even():
    rng = np.random.default_rng(1)
    edge = np.array(
        [
            0.0,
            -0.0,
            1.0,
            1.0 + 2.0**-8,  # tie -> even (1.0)
            1.0 + 3 * 2.0**-8,  # tie -> even (1 + 2^-6)
            -(1.0 + 2.0**-8),
            1.0 + 2.0**-8 + 2.0**-20,  # just above the tie -> up
            3.3895313892515355e38,  # bf16 max
            3.3970e38,  # above the midpoint (3.39618e38) to 2^128 -> inf
            3.3950e38,  # below it -> max
            np.finfo(np.float32).max,
            np.finfo(np.float32).tiny,
            1e-40,  # float32 subnormal
            -1e-45,
            np.inf,
            -np.inf,
        ],
        dtype=np.float32,
    )
    spread = rng.standard_normal(3000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 3000)
    x = np.concatenate([edge, spread]).astype(np.float32)
    got = float32_to_bfloat16(x)
    want = np.array([_bf16_round_ref(float(v)) for v in x], dtype=np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    assert got[3] == 0x3F80 and got[4] == 0x3F82 and got[8] == 0x7F80 and got[9] == 0x7F7F


def test_bf16_nan_inputs_canonical():
    x = np.array([np.nan, -np.nan], np.float32)
    x.view(np.uint32)[1] = 0xFFFFFFFF  # would wrap around if rounded naively
    assert float32_to_bfloat16(x).tolist() == [0x7FC0, 0x7FC0]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG])
def test_bf16_reduction_matches_float32_then_round(op):
    """Across several conversion chunks, and on an unaligned slice."""
    rng = np.random.default_rng(op.value)
    n = 2 * BF16_CHUNK + 123
    a = float32_to_bfloat16(rng.standard_normal(n) * 100)
    b = float32_to_bfloat16(rng.standard_normal(n) * 100)
    b[:5] = float32_to_bfloat16(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0]))
    fa, fb = bfloat16_to_float32(a), bfloat16_to_float32(b)
    f = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
    }[op]
    exact = f(fa, fb)
    idx = np.r_[0:600, n - 300 : n, BF16_CHUNK - 200 : BF16_CHUNK + 200]
    want_sample = np.array([_bf16_round_ref(float(exact[i])) for i in idx], dtype=np.uint16)
    dst = a.copy()
    reducer(op, "bfloat16")(dst, b)
    assert np.array_equal(dst[idx], want_sample)
    # the whole array against the (separately verified) vector rounding
    assert np.array_equal(dst, float32_to_bfloat16(exact))
    np.testing.assert_array_equal(b, b.copy())
    # slices that start mid-chunk
    dst2 = a.copy()
    reducer(op, "bfloat16")(dst2[7:], b[7:])
    assert np.array_equal(dst2[7:], dst[7:]) and np.array_equal(dst2[:7], a[:7])


def test_kernels_do_not_allocate_for_large_arrays():
    n = 1 << 20
    a32, b32 = np.ones(n, np.float32), np.ones(n, np.float32)
    abf, bbf = float32_to_bfloat16(np.ones(n)), float32_to_bfloat16(np.ones(n))
    k32, kbf = reducer(ReduceOp.SUM, np.float32), reducer(ReduceOp.SUM, "bfloat16")
    kbf(abf[:10].copy(), bbf[:10])  # per-thread conversion buffers are created on first use
    tracemalloc.start()
    try:
        k32(a32, b32)
        kbf(abf, bbf)
        finalize(ReduceOp.AVG, abf, 2, dtype="bfloat16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak  # far below one 4 MiB temporary
    assert np.all(a32 == 2) and np.all(abf == 0x3F80)  # (1 + 1) / 2 == 1.0


# ----------------------------------------------------------------------------- finalize
@pytest.mark.parametrize("dt", ["float16", "float32", "float64", "complex64", "complex128"])
def test_finalize_avg(dt):
    buf = (np.arange(12) * 3).astype(dt)
    if np.dtype(dt).kind == "c":
        buf += 6j
    want = buf.astype(np.complex128 if np.dtype(dt).kind == "c" else np.float64) / 3
    finalize(ReduceOp.AVG, buf, 3)
    assert buf.dtype == np.dtype(dt)
    np.testing.assert_allclose(buf, want, rtol=1e-3 if dt == "float16" else 1e-6)


def test_finalize_avg_bfloat16():
    x = np.array([3.0, 6.0, 1.0, -9.0, 100.0, np.inf], np.float32)
    buf = float32_to_bfloat16(x)
    finalize(ReduceOp.AVG, buf, 3, dtype="bfloat16")
    want = [_bf16_round_ref(float(np.float32(v) / np.float32(3))) for v in x]
    assert buf.tolist() == want
    # uint16 under AVG can only be bfloat16 (integer AVG is rejected), so dtype is optional
    buf2 = float32_to_bfloat16(x)
    finalize(ReduceOp.AVG, buf2, 3)
    assert buf2.tolist() == want


def test_finalize_noop_for_other_ops_and_size_one():
    a = np.arange(5, dtype=np.float32)
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT, "min"):
        finalize(op, a, 4)
    assert a.tolist() == [0, 1, 2, 3, 4]
    finalize(ReduceOp.AVG, a, 1)
    assert a.tolist() == [0, 1, 2, 3, 4]
    i = np.arange(5, dtype=np.int32)
    finalize(ReduceOp.SUM, i, 4)
    assert i.tolist() == [0, 1, 2, 3, 4]


def test_finalize_avg_rejects_integers_and_bad_size():
    with pytest.raises(ConfigError, match="AVG"):
        finalize(ReduceOp.AVG, np.arange(4, dtype=np.int32), 2)
    with pytest.raises(ConfigError):
        finalize(ReduceOp.AVG, np.ones(4, np.float32), 0)
