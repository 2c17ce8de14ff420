from typing import Any, Tuple

def read_frames(
    fds: Tuple[int, ...],
    tags: Tuple[int, ...],
    outs: Tuple[Any, ...],
    hdr: Any,
    prog: Any,
    spin_ns: int,
    slice_ns: int,
    wake_fd: int,
    hold: bool = ...,
    /,
) -> int: ...
