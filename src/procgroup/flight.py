"""The flight recorder's records: what a group ran, when, and how it ended (for hang reports and dumps)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["FlightRecord", "describe_signature", "FLIGHT_RECORDS"]

#: collectives each group remembers
FLIGHT_RECORDS = 64


def describe_signature(sig: tuple) -> str:
    """("all_reduce", "float32", 4, "SUM") -> 'all_reduce(float32, 4, SUM)'."""
    if not sig:
        return "?"
    return f"{sig[0]}({', '.join(str(x) for x in sig[1:])})"


@dataclass(slots=True)  # slots: one is made per collective, and a slotted one is ~3x cheaper
class FlightRecord:
    """One collective of a group: sequence number, op, signature, start/end (monotonic) and state."""

    seq: int
    op: str
    signature: tuple
    start: float
    end: Optional[float] = None
    state: str = "running"  # running | completed | failed

    def describe(self) -> str:
        """'seq 3 all_reduce(float32, 4, SUM) completed (0.001s)'."""
        dur = f"{(self.end or time.monotonic()) - self.start:.3f}s"
        return f"seq {self.seq} {describe_signature(self.signature)} {self.state} ({dur})"
