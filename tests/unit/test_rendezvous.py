"""Rendezvous rules (pure decide), init-method parsing, and the executor over an in-process store."""

from __future__ import annotations

import pytest

from procgroup.deadline import Deadline
from procgroup.errors import ConfigError, RendezvousError, RendezvousTimeoutError
from procgroup.rendezvous import InitMethod, MemberInfo, decide, parse_init_method, rendezvous
from procgroup.store import HashStore

from ..conftest import run_ranks


def info(rank: int, ws: int, host: str = "h", pid: int = 0) -> MemberInfo:
    return MemberInfo(
        rank=rank,
        world_size=ws,
        hostname=host,
        host_key=host,
        addr="127.0.0.1",
        pid=pid or 1000 + rank,
        nonce=f"n{rank}-{pid}",
    )


@pytest.mark.parametrize(
    "url, expect",
    [
        (None, InitMethod("env")),
        ("env://", InitMethod("env")),
        ("env://?rank=1&world_size=4", InitMethod("env", rank=1, world_size=4)),
        ("tcp://10.0.0.1:29500", InitMethod("tcp", host="10.0.0.1", port=29500)),
        ("tcp://h1:1234?world_size=2", InitMethod("tcp", host="h1", port=1234, world_size=2)),
        ("file:///tmp/x y/rdzv", InitMethod("file", path="/tmp/x y/rdzv")),
    ],
)
def test_parse_init_method(url, expect):
    assert parse_init_method(url) == expect


@pytest.mark.parametrize(
    "url, words",
    [
        ("tcp://host", "HOST:PORT"),
        ("tcp://:29500", "HOST:PORT"),
        ("tcp://h:notaport", "HOST:PORT"),
        ("http://h:1", "not supported"),
        ("file://", "needs a path"),
        ("env://?rank=x", "not an integer"),
        ("env://?foo=1", "unknown query"),
    ],
)
def test_parse_init_method_errors_say_what_to_do(url, words):
    with pytest.raises(ConfigError, match=words):
        parse_init_method(url)


def test_decide():
    assert decide(3, [0, 1, 2], None).action == "done"
    d = decide(4, [0, 3], None)
    assert d.action == "wait" and d.missing == (1, 2)
    assert decide(2, [0, 1], "boom").action == "fail"


def test_all_join():
    store = HashStore()
    got = run_ranks(4, lambda r: rendezvous(store, info(r, 4), Deadline.after(10), where="test"))
    for members in got:
        assert [m.rank for m in members] == [0, 1, 2, 3]


def test_missing_rank_is_named():
    store = HashStore()
    with pytest.raises(RendezvousTimeoutError, match=r"missing: rank \[1\]") as ei:
        rendezvous(store, info(0, 2), Deadline.after(0.5), where="127.0.0.1:1")
    assert ei.value.missing == [1]
    assert "PROCGROUP_TIMEOUT" in str(ei.value)


def test_missing_ranks_listed_compactly():
    store = HashStore()
    with pytest.raises(RendezvousTimeoutError, match=r"2/6 ranks joined.*missing: ranks \[1, 3-5\]"):
        run_ranks(2, lambda r: rendezvous(store, info([0, 2][r], 6), Deadline.after(0.6), where="x"))


def test_duplicate_rank_fails_everyone_fast():
    store = HashStore()

    def body(i: int):
        rank = [0, 1, 1][i]
        return rendezvous(store, info(rank, 3, host=f"host{i}", pid=10 + i), Deadline.after(10), where="x")

    with pytest.raises(RendezvousError, match="duplicate rank 1"):
        run_ranks(3, body, timeout=8)


def test_world_size_mismatch():
    store = HashStore()
    rendezvous_err = []

    def body(i: int):
        try:
            rendezvous(store, info(i, 2 if i == 0 else 3), Deadline.after(10), where="x")
        except RendezvousError as e:
            rendezvous_err.append(str(e))

    run_ranks(2, body, timeout=8)
    assert len(rendezvous_err) == 2
    assert all("world-size mismatch" in e for e in rendezvous_err)


def test_rank_out_of_range_fails_others():
    store = HashStore()
    errs = []

    def body(i: int):
        try:
            rendezvous(store, info([0, 5][i], 2), Deadline.after(10), where="x")
        except RendezvousError as e:
            errs.append(str(e))

    run_ranks(2, body, timeout=8)
    assert len(errs) == 2 and all("outside [0, 2)" in e for e in errs)


def test_progress_lines_while_waiting(caplog):
    store = HashStore()
    with caplog.at_level("WARNING", logger="procgroup"):
        with pytest.raises(RendezvousTimeoutError):
            rendezvous(store, info(0, 3), Deadline.after(1.5), where="h1:29500", progress_interval=0.3)
    lines = [r.getMessage() for r in caplog.records if "joined at h1:29500" in r.getMessage()]
    assert lines, caplog.text
    assert "1/3 joined at h1:29500; waiting for ranks [1, 2]" in lines[0]
