"""Tests for the sans-IO store state machine (procgroup.protocol.store_state): every request, the wake
lists, torch's add / compare_set edge cases, and waits parked as data and satisfied later."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from procgroup.protocol import store_codec as sc
from procgroup.protocol.store_state import (
    I64_MAX,
    I64_MIN,
    Outcome,
    Park,
    StoreState,
    compare_set,
    timeout_reply,
)


def state_with(**kv: bytes) -> StoreState:
    s = StoreState()
    for k, v in kv.items():
        assert s.apply(sc.Set(k, v)) == Outcome(sc.Ok(), (k,))
    return s


# ---------------------------------------------------------------- one request at a time


def test_set_get_overwrite():
    s = StoreState()
    assert s.apply(sc.Get("k")) == Outcome(sc.Timeout(("k",)), ())
    assert s.apply(sc.Set("k", b"v1")) == Outcome(sc.Ok(), ("k",))
    assert s.apply(sc.Get("k")) == Outcome(sc.Value(b"v1"), ())
    assert s.apply(sc.Set("k", b"v2")) == Outcome(sc.Ok(), ("k",))  # an overwrite wakes too
    assert s.apply(sc.Get("k")).reply == sc.Value(b"v2")
    assert s.apply(sc.Set("e", b"")).reply == sc.Ok()
    assert s.apply(sc.Get("e")).reply == sc.Value(b"")  # an empty value is a present key
    assert len(s) == 2 and s.get("k") == b"v2" and s.get("nope") is None


def test_add_counts_in_ascii_decimal():
    s = StoreState()
    assert s.apply(sc.Add("n", 5)) == Outcome(sc.Int(5), ("n",))  # absent counts as 0
    assert s.apply(sc.Add("n", -7)) == Outcome(sc.Int(-2), ("n",))
    assert s.get("n") == b"-2"
    assert s.apply(sc.Add("n", 0)) == Outcome(sc.Int(-2), ("n",))
    s.apply(sc.Set("m", b"41"))
    assert s.apply(sc.Add("m", 1)).reply == sc.Int(42)
    assert s.apply(sc.Get("m")).reply == sc.Value(b"42")


@pytest.mark.parametrize("held", [b"abc", b"1.5", b" 1", b"", b"--1", b"0x10"])
def test_add_to_a_non_integer_is_an_error_reply_and_changes_nothing(held):
    s = state_with(k=held)
    out = s.apply(sc.Add("k", 1))
    assert isinstance(out.reply, sc.Error) and out.wake == ()
    assert out.reply.message == f"add('k'): the key holds {held!r}, which is not a decimal integer"
    assert s.get("k") == held


def test_add_error_message_truncates_a_long_value():
    s = state_with(k=b"x" * 100)
    msg = s.apply(sc.Add("k", 1)).reply
    assert isinstance(msg, sc.Error) and repr(b"x" * 40) in msg.message and repr(b"x" * 41) not in msg.message


@pytest.mark.parametrize(
    "start,amount,ok",
    [
        (I64_MAX - 1, 1, True),
        (I64_MAX, 1, False),
        (I64_MIN + 1, -1, True),
        (I64_MIN, -1, False),
        (None, I64_MAX, True),
        (None, I64_MIN, True),
    ],
)
def test_add_overflow_bounds(start, amount, ok):
    s = StoreState() if start is None else state_with(c=str(start).encode())
    out = s.apply(sc.Add("c", amount))
    if ok:
        assert out == Outcome(sc.Int((start or 0) + amount), ("c",))
    else:
        assert out == Outcome(sc.Error(f"add('c', {amount}) overflows a signed 64-bit counter"), ())
        assert s.get("c") == str(start).encode()


def test_compare_set_torch_semantics():
    s = StoreState()
    # absent key, non-empty expected: nothing is stored, the reply is `expected`
    assert s.apply(sc.CompareSet("k", b"x", b"y")) == Outcome(sc.Value(b"x"), ())
    assert s.get("k") is None
    # absent key, empty expected: set to desired
    assert s.apply(sc.CompareSet("k", b"", b"first")) == Outcome(sc.Value(b"first"), ("k",))
    # present and equal: set to desired
    assert s.apply(sc.CompareSet("k", b"first", b"second")) == Outcome(sc.Value(b"second"), ("k",))
    # present and different: unchanged, the reply is the current value
    assert s.apply(sc.CompareSet("k", b"first", b"third")) == Outcome(sc.Value(b"second"), ())
    # present, expected empty but the value is not: unchanged
    assert s.apply(sc.CompareSet("k", b"", b"z")) == Outcome(sc.Value(b"second"), ())
    assert s.get("k") == b"second"


def test_compare_set_on_an_empty_value():
    s = state_with(k=b"")
    assert s.apply(sc.CompareSet("k", b"", b"now")) == Outcome(sc.Value(b"now"), ("k",))


def test_compare_set_helper():
    assert compare_set(None, b"", b"d") == (b"d", b"d")
    assert compare_set(None, b"e", b"d") == (None, b"e")
    assert compare_set(b"e", b"e", b"d") == (b"d", b"d")
    cur = b"c"
    new, reply = compare_set(cur, b"e", b"d")
    assert new is cur and reply == b"c"


def test_check_multi_get_multi_set():
    s = StoreState()
    assert s.apply(sc.Check(())).reply == sc.Bool(True)
    assert s.apply(sc.Check(("a", "b"))) == Outcome(sc.Bool(False), ())
    assert s.apply(sc.MultiSet(("a", "b", "a"), (b"1", b"2", b"3"))) == Outcome(sc.Ok(), ("a", "b", "a"))
    assert s.get("a") == b"3"  # later pairs win
    assert s.apply(sc.Check(("a", "b"))).reply == sc.Bool(True)
    assert s.apply(sc.MultiGet(("b", "a", "b"))).reply == sc.Values((b"2", b"3", b"2"))
    # missing keys: distinct, in request order
    assert s.apply(sc.MultiGet(("z", "a", "y", "z"))) == Outcome(sc.Timeout(("z", "y")), ())
    assert s.apply(sc.MultiGet(())).reply == sc.Values(())


def test_delete_num_keys_ping():
    s = state_with(a=b"1", b=b"2")
    assert s.apply(sc.NumKeys()) == Outcome(sc.Int(2), ())
    assert s.apply(sc.DeleteKey("a")) == Outcome(sc.Bool(True), ())  # a delete wakes nobody
    assert s.apply(sc.DeleteKey("a")) == Outcome(sc.Bool(False), ())
    assert s.apply(sc.NumKeys()).reply == sc.Int(1)
    assert s.apply(sc.Get("a")).reply == sc.Timeout(("a",))
    assert s.apply(sc.Ping()) == Outcome(sc.Ok(), ())


def test_not_a_request():
    with pytest.raises(TypeError, match="not a store request"):
        StoreState().apply(sc.Ok())  # type: ignore[arg-type]  # the point of the test


# ---------------------------------------------------------------- waits as data


def test_wait_present_keys_is_ok_at_once():
    s = state_with(a=b"1")
    assert s.apply(sc.Wait(("a",), 1000), now=5.0) == Outcome(sc.Ok(), ())
    assert s.apply(sc.Wait((), 0)).reply == sc.Ok()


def test_wait_zero_timeout_is_a_timeout_reply():
    s = state_with(b=b"1")
    assert s.apply(sc.Wait(("c", "b", "a", "c"), 0)) == Outcome(sc.Timeout(("c", "a")), ())


def test_wait_parks_with_a_deadline_from_now():
    s = state_with(b=b"1")
    out = s.apply(sc.Wait(("c", "b", "a", "c"), 1500), now=100.0)
    assert out == Outcome(Park(("c", "b", "a", "c"), ("c", "a"), 101.5), ())
    assert s.apply(sc.Wait(("x",)), now=100.0).reply == Park(("x",), ("x",), None)  # NO_TIMEOUT: forever
    assert s.apply(sc.Wait(("x",), sc.NO_TIMEOUT - 1), now=0.0).reply.deadline == (sc.NO_TIMEOUT - 1) / 1000.0


def test_timeout_reply_lists_what_is_still_missing_in_order():
    assert timeout_reply(("c", "b", "a", "c"), {"a", "c"}) == sc.Timeout(("c", "a"))
    assert timeout_reply(("a",), frozenset()) == sc.Timeout(())


class Shell:
    """The smallest I/O shell: parks waits by key and wakes them by the returned keys (as StoreServer)."""

    def __init__(self) -> None:
        self.state = StoreState()
        self.parked: dict[int, tuple[Park, set[str]]] = {}
        self.answers: dict[int, sc.Response] = {}
        self.now = 0.0

    def call(self, who: int, ev: sc.Request) -> object:
        out = self.state.apply(ev, self.now)
        for k in out.wake:
            for w, (_park, missing) in list(self.parked.items()):
                missing.discard(k)
                if not missing:
                    del self.parked[w]
                    self.answers[w] = sc.Ok()
        if isinstance(out.reply, Park):
            self.parked[who] = (out.reply, set(out.reply.missing))
        return out.reply

    def tick(self, now: float) -> None:
        self.now = now
        for w, (park, missing) in list(self.parked.items()):
            if park.deadline is not None and park.deadline <= now:
                del self.parked[w]
                self.answers[w] = timeout_reply(park.keys, missing)


def test_waits_satisfied_later_by_every_kind_of_write():
    sh = Shell()
    assert isinstance(sh.call(1, sc.Wait(("a", "b", "c", "d"), 10_000)), Park)
    assert isinstance(sh.call(2, sc.Wait(("a",))), Park)
    sh.call(9, sc.Set("a", b"1"))
    assert sh.answers == {2: sc.Ok()}  # waiter 1 still needs b, c, d
    sh.call(9, sc.Add("b", 1))
    sh.call(9, sc.CompareSet("c", b"nope", b"x"))  # stores nothing: wakes nothing
    assert 1 in sh.parked and sh.parked[1][1] == {"c", "d"}
    sh.call(9, sc.CompareSet("c", b"", b"x"))
    sh.call(9, sc.DeleteKey("a"))  # deleting a counted key does not un-count it
    sh.call(9, sc.MultiSet(("d", "e"), (b"1", b"2")))
    assert sh.answers == {2: sc.Ok(), 1: sc.Ok()} and not sh.parked


def test_parked_wait_times_out_with_the_keys_still_missing():
    sh = Shell()
    sh.now = 10.0
    park = sh.call(1, sc.Wait(("x", "y", "z"), 2000))
    assert park == Park(("x", "y", "z"), ("x", "y", "z"), 12.0)
    sh.call(9, sc.Set("y", b"1"))
    sh.tick(11.999)
    assert not sh.answers
    sh.tick(12.0)
    assert sh.answers == {1: sc.Timeout(("x", "z"))}


# ---------------------------------------------------------------- properties

_KEYS = st.sampled_from(["a", "b", "c", "ключ"])
_VALS = st.sampled_from([b"", b"0", b"7", b"-3", b"x", b"9223372036854775807"])
_REQS = st.one_of(
    st.builds(sc.Set, _KEYS, _VALS),
    st.builds(sc.Get, _KEYS),
    st.builds(sc.Add, _KEYS, st.integers(I64_MIN, I64_MAX)),
    st.builds(sc.CompareSet, _KEYS, _VALS, _VALS),
    st.builds(sc.Wait, st.lists(_KEYS, max_size=4).map(tuple), st.sampled_from([0, 5, sc.NO_TIMEOUT])),
    st.builds(sc.Check, st.lists(_KEYS, max_size=4).map(tuple)),
    st.builds(sc.MultiGet, st.lists(_KEYS, max_size=4).map(tuple)),
    st.lists(st.tuples(_KEYS, _VALS), max_size=4).map(
        lambda kv: sc.MultiSet(tuple(k for k, _ in kv), tuple(v for _, v in kv))
    ),
    st.builds(sc.DeleteKey, _KEYS),
    st.just(sc.NumKeys()),
    st.just(sc.Ping()),
)


@settings(max_examples=300, deadline=None)
@given(reqs=st.lists(_REQS, max_size=30))
def test_every_outcome_is_consistent(reqs):
    """Woken keys are named by the request and exist afterwards; a reply encodes; only WAIT parks."""
    s = StoreState()
    for ev in reqs:
        before = dict(s.data)
        out = s.apply(ev, now=1.0)
        named = set(getattr(ev, "keys", ())) | ({ev.key} if hasattr(ev, "key") else set())
        assert set(out.wake) <= named
        assert all(s.get(k) is not None for k in out.wake)
        if isinstance(out.reply, Park):
            assert isinstance(ev, sc.Wait) and ev.timeout_ms != 0
            assert all(s.get(k) is None for k in out.reply.missing)
        else:
            sc.StoreCodec("server").send(out.reply)
        if isinstance(out.reply, sc.Error) or isinstance(
            ev, (sc.Get, sc.Wait, sc.Check, sc.MultiGet, sc.NumKeys, sc.Ping)
        ):
            assert s.data == before  # reads and refused writes change nothing
        assert s.apply(sc.NumKeys()).reply == sc.Int(len(s.data))
