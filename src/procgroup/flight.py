"""The flight recorder's records: what a group ran, when, and how it ended (for hang reports and dumps)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["FlightRecord", "as_record", "describe_signature", "FLIGHT_RECORDS"]

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


def as_record(entry: Any) -> FlightRecord:
    """A flight recorder entry as a FlightRecord: planned calls (``ProcessGroup.run_plan``) keep a compact
    ``[seq, plan, start, end]`` list (a FlightRecord costs ~0.2 us a call there), read as running until its
    end is set and completed after; everything else is a FlightRecord already."""
    if type(entry) is list:
        seq, plan, start, end = entry
        return FlightRecord(seq, plan.op, plan.sig, start, end, "running" if end is None else "completed")
    return entry
