"""Deadlines: every blocking wait in procgroup takes one.

A :class:`Deadline` is an absolute point on the monotonic clock plus the
moment it was created, so an error can say how long we waited.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Union

__all__ = ["Deadline", "as_deadline"]

_NEVER = float("inf")


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() value; inf means "never"
    start: float = field(default_factory=time.monotonic)

    @classmethod
    def after(cls, seconds: Optional[float]) -> "Deadline":
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
        return self.at != _NEVER and time.monotonic() >= self.at

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def sooner(self, seconds: Optional[float]) -> "Deadline":
        """This deadline or ``seconds`` from now, whichever comes first."""
        if seconds is None:
            return self
        return Deadline(min(self.at, time.monotonic() + seconds), self.start)


def as_deadline(timeout: Union[None, float, "Deadline"]) -> Deadline:
    if isinstance(timeout, Deadline):
        return timeout
    if hasattr(timeout, "total_seconds"):  # datetime.timedelta, as torch takes
        timeout = timeout.total_seconds()  # type: ignore[union-attr]
    return Deadline.after(timeout)
