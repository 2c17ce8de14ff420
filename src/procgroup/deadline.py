"""Deadlines: every blocking wait in procgroup takes one.

A :class:`Deadline` is an absolute point on the monotonic clock plus the
moment it was created, so an error can say how long we waited.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from .config import to_seconds

__all__ = ["Deadline", "as_deadline", "wait_seconds"]

_NEVER = float("inf")


class Deadline:
    """An absolute monotonic time ``at`` (inf: never) and the moment ``start`` it was set.

    Immutable by convention (a plain slotted class: every collective makes one, and a frozen dataclass's
    ``__init__`` costs about 1 us, a tenth of a small collective).
    """

    __slots__ = ("at", "start")

    def __init__(self, at: float, start: Optional[float] = None) -> None:
        self.at = at  # time.monotonic() value; inf means "never"
        self.start = time.monotonic() if start is None else start

    def __repr__(self) -> str:
        return f"Deadline(at={self.at!r}, start={self.start!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return (self.at, self.start) == (other.at, other.start)

    def __hash__(self) -> int:
        return hash((self.at, self.start))

    @classmethod
    def after(cls, seconds: Optional[float]) -> "Deadline":
        """``seconds`` from now (None: never; negative counts as 0)."""
        now = time.monotonic()
        if seconds is None:
            return cls(_NEVER, now)
        return cls(now + max(0.0, float(seconds)), now)

    @property
    def timeout(self) -> Optional[float]:
        """The full length of this deadline (None: never)."""
        return None if self.at == _NEVER else self.at - self.start

    def remaining(self) -> float:
        """Seconds left, >= 0 (inf when never)."""
        if self.at == _NEVER:
            return _NEVER
        return max(0.0, self.at - time.monotonic())

    def remaining_or_none(self, cap: Optional[float] = None) -> Optional[float]:
        """For APIs taking ``timeout=None`` for "forever"; optionally capped."""
        r = self.remaining()
        if r == _NEVER:
            return cap
        return r if cap is None else min(r, cap)

    def expired(self) -> bool:
        """True once the deadline has passed (never for a deadline of None)."""
        return self.at != _NEVER and time.monotonic() >= self.at

    def elapsed(self) -> float:
        """Seconds since the deadline was set."""
        return time.monotonic() - self.start

    def sooner(self, seconds: Optional[float]) -> "Deadline":
        """This deadline or ``seconds`` from now, whichever comes first."""
        if seconds is None:
            return self
        return Deadline(min(self.at, time.monotonic() + seconds), self.start)


def wait_seconds(timeout: Any, name: str = "timeout") -> Optional[float]:
    """A wait's ``timeout`` (seconds or a ``datetime.timedelta``, as torch takes) as seconds.

    None stays None (the caller's default); 0 means "do not block" (a poll); anything else goes through
    :func:`procgroup.config.to_seconds`, so a negative or non-numeric value is a ConfigError naming ``name``.
    """
    if timeout is None:
        return None
    if timeout == 0 and isinstance(timeout, (int, float)):
        return 0.0
    return to_seconds(timeout, name)


def as_deadline(timeout: Union[None, float, "Deadline"]) -> Deadline:
    """``timeout`` as a Deadline: a Deadline as is, else that many seconds (a timedelta too) from now."""
    if isinstance(timeout, Deadline):
        return timeout
    return Deadline.after(wait_seconds(timeout))
