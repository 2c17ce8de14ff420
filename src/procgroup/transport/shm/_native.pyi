# Type stub of the optional compiled arena fast path (_native.c); see arena.py.
from typing import Any, List, Sequence

SLOT_HDR: int

class Slots:
    count: int
    def __init__(
        self,
        mappings: Sequence[Any],
        offsets0: Sequence[int],
        offsets1: Sequence[int],
        me: int,
        max_bytes: int,
        sleep_off: int,
        spin_ns: int,
        yield_cpu: bool,
    ) -> None: ...
    def exchange(self, data: Any, check: int) -> int: ...
    def exchange_reduce(self, buf: Any, check: int, op: int, type: int, reduce: bool) -> int: ...
    def reduce(self, buf: Any, op: int, type: int) -> None: ...
    def arrived(self) -> bool: ...
    def missing(self) -> List[int]: ...
    def release(self) -> None: ...
