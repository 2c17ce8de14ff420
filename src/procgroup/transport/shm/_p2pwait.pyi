from typing import Tuple, Union

OFF_BELL: int
OFF_SLEEP: int

def wait_head(q: memoryview, head_i: int, tail: int, spin_ns: int, yield_cpu: bool, /) -> int: ...
def put(
    data: memoryview,
    q: memoryview,
    head_i: int,
    tail_i: int,
    head: int,
    tag: int,
    payload: memoryview,
    bell: int = ...,
    chunk: int = ...,
    step: int = ...,
    /,
) -> int: ...
def take(
    data: memoryview,
    q: memoryview,
    head_i: int,
    tail: int,
    tag: int,
    out: memoryview,
    tail_i: int = ...,
    want_i: int = ...,
    /,
) -> int: ...
def stream(
    data: memoryview,
    q: memoryview,
    head_i: int,
    tail_i: int,
    want_i: int,
    tail: int,
    tag: int,
    out: memoryview,
    off: int,
    n: int,
    spin_ns: int,
    yield_cpu: bool,
    /,
) -> Union[int, Tuple[int, int, int]]: ...
def put_stream(
    data: memoryview,
    q: memoryview,
    head_i: int,
    tail_i: int,
    head: int,
    tag: int,
    payload: memoryview,
    bell: int,
    chunk: int,
    step: int,
    spin_ns: int,
    yield_cpu: bool,
    /,
) -> Union[int, Tuple[int, int, int]]: ...
