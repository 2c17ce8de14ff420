"""Transport tags and call fingerprints: how the calls of a group are told apart on the wire.

Every message of a collective carries the transport tag
``(gid << 32 | (seq mod 2**16) << 16 | fingerprint) << 16 | step`` (see
``algorithms.comm``), and every point-to-point message
``2**62 | gid << 40 | user_tag``, so collectives of different groups,
successive collectives of one group, and p2p traffic never match each
other's receives.  A p2p tag also carries a 5-bit code of the tensor's dtype at
bit ``P2P_CODE_SHIFT`` (``2**62 | gen%8 << 59 | code << 54 | gid << 40 | user_tag``), so a
float32 send never lands in an int32 receive: the receive waits, and after a
few milliseconds asks the transport for an unmatched message that differs
from it in the code bits only (:meth:`Transport.unmatched`), and raises a
ConfigError naming both dtypes (issue 11 item 15).  The 16-bit *fingerprint* hashes what every member must
agree on (op, dtype, element count, root, reduce op): ranks that call
different collectives at the same sequence number never exchange a byte, so
a mismatch cannot return garbage; it stalls, and the watchdog
(``procgroup.watchdog``) compares the members' calls through the store and
raises :class:`~procgroup.errors.CollectiveMismatchError` on every member.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict

from .errors import ConfigError

__all__ = [
    "GID_LIMIT",
    "SEQ_MASK",
    "FP_MASK",
    "P2P_TAG_LIMIT",
    "P2P_CODE_SHIFT",
    "P2P_CODE_MASK",
    "fingerprint",
    "collective_tag",
    "p2p_tag",
    "dtype_code",
    "dtype_of_code",
]

GID_LIMIT = 1 << 14
SEQ_MASK = (1 << 16) - 1
FP_MASK = (1 << 16) - 1
P2P_TAG_LIMIT = 1 << 40
_P2P_BIT = 1 << 62
#: the dtype code of a p2p tag: 5 bits above the group id (gid < 2**14 ends at bit 53) and below _P2P_BIT
P2P_CODE_SHIFT = 54
P2P_CODE_MASK = 31 << P2P_CODE_SHIFT
#: dtype names by code (0: a dtype without its own code; such dtypes are not told apart)
_DTYPE_NAMES = (
    "",
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float128",
    "complex256",
)
_DTYPE_CODES = {n: i for i, n in enumerate(_DTYPE_NAMES) if n}
_CODE_CACHE: Dict[Any, int] = {}


_FP_CACHE: Dict[tuple, int] = {}


def fingerprint(signature: tuple) -> int:
    """16-bit hash of what every member of a collective must agree on (memoised: loops repeat signatures)."""
    fp = _FP_CACHE.get(signature)
    if fp is None:
        fp = zlib.crc32(repr(signature).encode()) & FP_MASK
        if len(_FP_CACHE) >= 4096:
            _FP_CACHE.clear()
        _FP_CACHE[signature] = fp
    return fp


def collective_tag(gid: int, seq: int, fp: int) -> int:
    """The transport tag of collective ``seq`` of group ``gid`` with fingerprint ``fp`` (before steps)."""
    return (gid << 32) | ((seq & SEQ_MASK) << 16) | (fp & FP_MASK)


def p2p_tag(gid: int, tag: int, code: int = 0, gen: int = 0) -> int:
    """The transport tag of a point-to-point message of group ``gid`` (incarnation ``gen``) with dtype
    ``code``; ConfigError outside [0, 2**40).  The generation's low 3 bits sit at bits 59-61, so a message
    left unreceived by a destroyed group does not match a receive of the next group that reuses its id."""
    if not 0 <= tag < P2P_TAG_LIMIT:
        raise ConfigError(f"tag={tag} is outside [0, 2**40)")
    return _P2P_BIT | ((gen & 7) << 59) | (code << P2P_CODE_SHIFT) | (gid << 40) | tag


def dtype_code(dtype: Any) -> int:
    """The 5-bit code of a numpy dtype (or "bfloat16") in p2p tags; 0 for a dtype without its own code."""
    c = _CODE_CACHE.get(dtype)
    if c is None:
        c = _DTYPE_CODES.get(dtype if isinstance(dtype, str) else getattr(dtype, "name", str(dtype)), 0)
        if len(_CODE_CACHE) < 256:
            _CODE_CACHE[dtype] = c
    return c


def dtype_of_code(code: int) -> str:
    """The dtype name of a p2p dtype code (for messages)."""
    name = _DTYPE_NAMES[code] if 0 <= code < len(_DTYPE_NAMES) else ""
    return name or "a dtype without its own code"
