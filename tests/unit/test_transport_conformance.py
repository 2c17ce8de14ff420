"""One conformance suite for every Transport: memory, shm, tcp and router (shm + tcp), ranks as threads.

Each test takes the ``world`` factory: ``world(n)`` returns one connected
transport per rank (formed concurrently, as real ranks would) and closes
them at teardown, checking that no shared memory segment was left behind.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

from procgroup.deadline import Deadline
from procgroup.errors import (
    ClosedError,
    ConfigError,
    DistTimeoutError,
    PeerFailureError,
    ProcGroupError,
    StoreTimeoutError,
)
from procgroup.protocol.frames import FLAG_MORE, encode_header
from procgroup.transport import ANY_SOURCE, LoopbackTransport, MemoryHub, RouterTransport, Transport, connect_transport
from procgroup.transport.shm import SHM_DIR, segment_prefix

KINDS = ["memory", "shm", "tcp", "router", "shm-small-ring", "tcp-small-frames"]
#: variants: rings of 4 KiB (every message wraps and streams), frames of 4 KiB (every message is multi-frame)
_VARIANT_KW = {"shm-small-ring": {"ring_size": 4096}, "tcp-small-frames": {"max_frame_size": 4096}}
TAG = 77


class DictStore:
    """Minimal thread-safe store with the duck-typed API of procgroup.store."""

    def __init__(self) -> None:
        self._d: Dict[str, bytes] = {}
        self._c = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._c:
            self._d[key] = bytes(value)
            self._c.notify_all()

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        with self._c:
            if not self._c.wait_for(lambda: key in self._d, timeout):
                raise StoreTimeoutError(f"key {key!r} not set after {timeout}s")
            return self._d[key]

    def add(self, key: str, amount: int) -> int:
        with self._c:
            v = int(self._d.get(key, b"0")) + amount
            self._d[key] = str(v).encode()
            self._c.notify_all()
            return v

    def wait(self, keys: List[str], timeout: Optional[float] = None) -> None:
        with self._c:
            if not self._c.wait_for(lambda: all(k in self._d for k in keys), timeout):
                raise StoreTimeoutError(f"keys {keys} not set after {timeout}s")

    def check(self, keys: List[str]) -> bool:
        with self._c:
            return all(k in self._d for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._c:
            return self._d.pop(key, None) is not None


def _segments(job: str) -> List[str]:
    pre = segment_prefix(job)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(pre)] if os.path.isdir(SHM_DIR) else []


def run_ranks(ts: List[Transport], fn: Callable[[Transport], Any], timeout: float = 60.0) -> List[Any]:
    """Run ``fn(transport)`` for every rank in its own thread; re-raise the first failure."""
    results: List[Any] = [None] * len(ts)
    errors: List[Optional[BaseException]] = [None] * len(ts)

    def body(i: int) -> None:
        try:
            results[i] = fn(ts[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(ts))]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for tr in ts:  # unblock the stuck ranks so the test ends
            tr.close()
        raise AssertionError(f"ranks {[i for i, t in enumerate(threads) if t.is_alive()]} hung")
    for e in errors:
        if e is not None:
            raise e
    return results


def _form(kind: str, n: int, job: str, **kw: Any) -> List[Transport]:
    if kind == "memory":
        hub = MemoryHub(n)
        return [hub.transport(r) for r in range(n)]
    store = DictStore()
    kw = {**_VARIANT_KW.get(kind, {}), **kw}
    kind = kind.split("-")[0]
    mode = {"shm": "shm", "tcp": "tcp", "router": "auto"}[kind]
    host_keys = ["h"] * n if kind != "router" else [f"h{(2 * r) // n}" for r in range(n)]
    out: List[Optional[Transport]] = [None] * n

    def make(r: int) -> None:
        out[r] = connect_transport(
            store,
            r,
            n,
            secret=b"conformance-secret",
            host_keys=host_keys,
            advertise_addr="127.0.0.1",
            job_id=job,
            deadline=Deadline.after(30),
            mode=mode,
            **kw,
        )

    errs: List[BaseException] = []

    def guarded(r: int) -> None:
        try:
            make(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errs or any(t is None for t in out):
        for t in out:
            if t is not None:
                t.close()
        raise errs[0] if errs else AssertionError("transport formation hung")
    ts: List[Transport] = out  # type: ignore[assignment]
    if kind == "router" and not isinstance(ts[0], RouterTransport):
        # one host or one rank per host: wrap, so that the dispatch layer is always exercised
        ts = [
            RouterTransport({p: t for p in range(n) if p != t.rank}, LoopbackTransport(t.rank, n), t.rank, n)
            if n > 1
            else t
            for t in ts
        ]
    return ts


@pytest.fixture(params=KINDS)
def kind(request: Any) -> str:
    return request.param


@pytest.fixture
def world(kind: str) -> Any:
    job = f"conf-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int, **kw: Any) -> List[Transport]:
        ts = _form(kind, n, job, **kw)
        made.extend(ts)
        return ts

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for t in made:
        t.close()
    assert _segments(job) == [], "shared memory segments leaked"


def dl(s: float = 30.0) -> Deadline:
    return Deadline.after(s)


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 31 + seed * 7) % 251).astype(np.uint8)


# -- basics ---------------------------------------------------------------------------------------


def test_send_recv(world: Any) -> None:
    ts = world(2)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            t.send(1, TAG, b"hello", dl())
            return None
        out = bytearray(16)
        st = t.recv(0, TAG, out, dl())
        return st, bytes(out[: st.nbytes])

    _, (st, data) = run_ranks(ts, body)
    assert (st.source, st.nbytes, data) == (0, 5, b"hello")
    assert ts[0].kind == world.kind.split("-")[0]


@pytest.mark.parametrize("post_first", [True, False], ids=["posted", "unexpected"])
def test_non_overtaking(world: Any, post_first: bool) -> None:
    ts = world(2)
    n = 40
    ready = threading.Event()

    def body(t: Transport) -> Any:
        if t.rank == 0:
            if post_first:
                ready.wait(10)
            reqs = [t.isend(1, TAG, np.full(100 + i, i, dtype=np.uint8)) for i in range(n)]
            for r in reqs:
                r.wait(dl())
            return None
        outs = [np.zeros(200, dtype=np.uint8) for _ in range(n)]
        if not post_first:
            time.sleep(0.2)  # let the messages arrive first
        reqs = [t.irecv(0, TAG, o) for o in outs]
        ready.set()
        return [(r.wait(dl()).nbytes, int(o[0])) for r, o in zip(reqs, outs)]

    _, got = run_ranks(ts, body)
    assert got == [(100 + i, i) for i in range(n)]


def test_tags_are_independent(world: Any) -> None:
    """A message with tag B is received before an earlier-sent (large) message with tag A."""
    ts = world(2)
    big = pattern(6 << 20, 1)  # larger than the default shm ring: A streams through while B waits behind it

    def body(t: Transport) -> Any:
        if t.rank == 0:
            ra = t.isend(1, 1, big)
            rb = t.isend(1, 2, b"B")
            rb.wait(dl())
            ra.wait(dl())
            return None
        ob = bytearray(1)
        t.recv(0, 2, ob, dl())
        oa = np.zeros_like(big)
        st = t.recv(0, 1, oa, dl())
        return bytes(ob), st.nbytes, bool(np.array_equal(oa, big))

    _, res = run_ranks(ts, body)
    assert res == (b"B", big.nbytes, True)


def test_any_source_returns_sender(world: Any) -> None:
    n = 4
    ts = world(n)

    def body(t: Transport) -> Any:
        if t.rank != 0:
            t.send(0, TAG, np.full(8, t.rank, dtype=np.uint8), dl())
            return None
        got = []
        for _ in range(n - 1):
            out = np.zeros(8, dtype=np.uint8)
            st = t.recv(ANY_SOURCE, TAG, out, dl())
            assert st.nbytes == 8
            assert (out == st.source).all()
            got.append(st.source)
        return sorted(got)

    assert run_ranks(ts, body)[0] == [1, 2, 3]


def test_any_source_includes_self(world: Any) -> None:
    ts = world(2)

    def body(t: Transport) -> Any:
        t.send(t.rank, TAG, bytes([t.rank]), dl())
        t.send(1 - t.rank, TAG, bytes([t.rank]), dl())
        srcs = []
        for _ in range(2):
            out = bytearray(1)
            st = t.recv(ANY_SOURCE, TAG, out, dl())
            assert out[0] == st.source
            srcs.append(st.source)
        return sorted(srcs)

    assert run_ranks(ts, body) == [[0, 1], [0, 1]]


@pytest.mark.parametrize("size", [0, 1, 3, 4095, 4097, 65537, (1 << 20) + 13])
def test_sizes(world: Any, size: int) -> None:
    ts = world(2)
    data = pattern(size, size)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            t.send(1, TAG, data, dl())
            out = np.zeros(size + 5, dtype=np.uint8)
            st = t.recv(1, TAG + 1, out, dl())
            return st.nbytes, bool(np.array_equal(out[:size], data))
        out = np.zeros(size, dtype=np.uint8)
        st = t.recv(0, TAG, out, dl())
        t.send(0, TAG + 1, out, dl())
        return st.nbytes, bool(np.array_equal(out, data))

    assert run_ranks(ts, body) == [(size, True), (size, True)]


def test_64mib(world: Any) -> None:
    ts = world(2)
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            t.send(1, TAG, data, dl(60))
            return None
        out = np.empty_like(data)
        st = t.recv(0, TAG, out, dl(60))
        return st.nbytes, bool(np.array_equal(out, data))

    assert run_ranks(ts, body, timeout=90)[1] == (64 << 20, True)


def test_message_too_big_for_buffer(world: Any) -> None:
    ts = world(2)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            t.send(1, TAG, b"x" * 100, dl())
            t.send(1, TAG, b"ok", dl())
            return None
        small = bytearray(10)
        with pytest.raises(ProcGroupError) as ei:
            t.recv(0, TAG, small, dl())
        assert not isinstance(ei.value, DistTimeoutError)
        assert "100" in str(ei.value) and "10" in str(ei.value)
        out = bytearray(10)
        st = t.recv(0, TAG, out, dl())  # the transport still works; the oversize message was consumed
        return bytes(out[: st.nbytes])

    assert run_ranks(ts, body)[1] == b"ok"


def test_timeout_then_wait_again(world: Any) -> None:
    ts = world(2)
    out = bytearray(4)
    req = ts[1].irecv(0, TAG, out)
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError) as ei:
        req.wait(Deadline.after(0.2))
    assert 0.15 <= time.monotonic() - t0 < 5
    assert "rank 0" in str(ei.value)
    assert not req.test()
    ts[0].send(1, TAG, b"late", dl())
    st = req.wait(dl())
    assert (st.source, bytes(out)) == (0, b"late")
    assert req.test() and req.wait() == st  # idempotent once complete


def test_close_fails_pending(world: Any) -> None:
    ts = world(2)
    req = ts[1].irecv(0, TAG, bytearray(4))
    errs: List[BaseException] = []

    def waiter() -> None:
        try:
            req.wait(dl(10))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    ts[1].close()
    th.join(10)
    assert not th.is_alive()
    assert len(errs) == 1 and isinstance(errs[0], ClosedError)
    with pytest.raises(ClosedError):
        req.wait(dl(1))
    with pytest.raises(ClosedError):
        ts[1].isend(0, TAG, b"x")
    with pytest.raises(ClosedError):
        ts[1].irecv(0, TAG, bytearray(1))
    ts[1].close()  # idempotent


def test_self_send(world: Any) -> None:
    ts = world(2)
    t = ts[0]
    t.send(0, TAG, b"before", dl())  # unexpected path
    out = bytearray(6)
    assert t.recv(0, TAG, out, dl()).source == 0 and bytes(out) == b"before"
    req = t.irecv(0, TAG, out)  # posted path
    t.isend(0, TAG, b"after!").wait(dl())
    assert req.wait(dl()).nbytes == 6 and bytes(out) == b"after!"


def test_test_polling(world: Any) -> None:
    ts = world(2)
    out = bytearray(3)
    req = ts[1].irecv(0, TAG, out)
    assert not req.test()
    ts[0].isend(1, TAG, b"abc")
    end = time.monotonic() + 10
    while not req.test():
        assert time.monotonic() < end
        time.sleep(0.001)
    assert req.wait() == req.wait(dl()) and bytes(out) == b"abc"


def test_mark_peer_failed(world: Any) -> None:
    ts = world(2)
    req = ts[1].irecv(0, TAG, bytearray(4))
    ts[1].mark_peer_failed(0, "declared dead by the test")
    with pytest.raises(PeerFailureError) as ei:
        req.wait(dl(5))
    assert ei.value.peer == 0 and "declared dead by the test" in str(ei.value)
    with pytest.raises(PeerFailureError):
        ts[1].isend(0, TAG, b"x").wait(dl(5))


def test_two_threads_one_rank(world: Any) -> None:
    """The API layer may wait from a worker thread while the main thread waits too."""
    ts = world(2)
    n = 200

    def body(t: Transport) -> Any:
        if t.rank == 0:
            for i in range(n):
                for tag in (1, 2):
                    t.send(1, tag, i.to_bytes(4, "little"), dl())
            return None
        got: Dict[int, List[int]] = {1: [], 2: []}

        def consume(tag: int) -> None:
            out = bytearray(4)
            for _ in range(n):
                t.recv(0, tag, out, dl())
                got[tag].append(int.from_bytes(out, "little"))

        th = threading.Thread(target=consume, args=(2,))
        th.start()
        consume(1)
        th.join(30)
        return got

    got = run_ranks(ts, body)[1]
    assert got[1] == list(range(n)) and got[2] == list(range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_pairs(world: Any, n: int) -> None:
    ts = world(n)

    def body(t: Transport) -> Any:
        r = t.rank
        outs = {p: np.zeros(1000 + p * 10 + r, dtype=np.uint8) for p in range(n)}
        rreqs = {p: t.irecv(p, TAG, outs[p]) for p in range(n)}
        sreqs = [t.isend(p, TAG, pattern(1000 + r * 10 + p, r * n + p)) for p in range(n)]
        for s in sreqs:
            s.wait(dl())
        ok = []
        for p in range(n):
            st = rreqs[p].wait(dl())
            ok.append(
                st.source == p
                and st.nbytes == 1000 + p * 10 + r
                and np.array_equal(outs[p][: st.nbytes], pattern(1000 + p * 10 + r, p * n + r))
            )
        return all(ok)

    assert run_ranks(ts, body) == [True] * n


def test_bad_arguments(world: Any) -> None:
    ts = world(2)
    with pytest.raises(ConfigError):
        ts[0].isend(5, TAG, b"x")
    with pytest.raises(ConfigError):
        ts[0].isend(1, -1, b"x")
    with pytest.raises(ConfigError):
        ts[0].irecv(1, TAG, b"read-only")


def test_abort_fails_pending_and_later(world: Any) -> None:
    ts = world(2)
    req = ts[1].irecv(0, TAG, bytearray(4))
    boom = ProcGroupError("collective mismatch detected by the watchdog")
    errs: List[BaseException] = []

    def waiter() -> None:
        try:
            req.wait(dl(10))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    ts[1].abort(boom)
    th.join(10)
    assert errs == [boom] and time.monotonic() - t0 < 2
    with pytest.raises(ProcGroupError, match="watchdog"):
        ts[1].isend(0, TAG, b"x").wait(dl(1))
    with pytest.raises(ProcGroupError, match="watchdog"):
        ts[1].irecv(ANY_SOURCE, TAG, bytearray(1)).wait(dl(1))


def test_buffers_are_released_after_completion(world: Any) -> None:
    """A completed request keeps no export of the caller's buffer (a bytearray can be resized again)."""
    ts = world(2)
    big = bytearray(pattern(300_000, 3).tobytes())

    def body(t: Transport) -> Any:
        if t.rank == 0:
            t.send(1, TAG, big, dl())
            big.extend(b"more")
            return None
        out = bytearray(300_000)
        t.recv(0, TAG, out, dl())
        out.extend(b"more")
        return len(out)

    assert run_ranks(ts, body)[1] == 300_004


# -- behaviour specific to the real transports ---------------------------------------------------


@pytest.fixture(params=["shm", "tcp", "router"])
def real_world(request: Any) -> Any:
    job = f"conf-{uuid.uuid4().hex[:10]}"
    made: List[Transport] = []

    def factory(n: int, **kw: Any) -> List[Transport]:
        ts = _form(request.param, n, job, **kw)
        made.extend(ts)
        return ts

    yield factory
    for t in made:
        t.close()
    assert _segments(job) == []


def test_any_source_fails_when_a_peer_fails(real_world: Any) -> None:
    ts = real_world(3)
    req = ts[0].irecv(ANY_SOURCE, TAG, bytearray(4))
    ts[0].mark_peer_failed(2, "heartbeat lost")
    with pytest.raises(PeerFailureError) as ei:
        req.wait(dl(5))
    assert ei.value.peer == 2 and "heartbeat lost" in str(ei.value)
    # a message that is already there is still delivered to a specific receive
    ts[1].send(0, TAG + 1, b"ok", dl())
    out = bytearray(2)
    assert ts[0].recv(1, TAG + 1, out, dl()).source == 1 and out == b"ok"


def test_large_any_source_across_transports(real_world: Any) -> None:
    ts = real_world(4)
    size = 5 << 20

    def body(t: Transport) -> Any:
        if t.rank in (1, 2):
            t.send(0, TAG, pattern(size, t.rank), dl())
            return None
        if t.rank == 3:
            return None
        got = {}
        for _ in range(2):
            out = np.zeros(size, dtype=np.uint8)
            st = t.recv(ANY_SOURCE, TAG, out, dl())
            got[st.source] = bool(np.array_equal(out, pattern(size, st.source)))
        return got

    assert run_ranks(ts, body)[0] == {1: True, 2: True}


class _MeddlingStore(DictStore):
    """Before rank 0 learns rank 1's tcp address, strangers connect to that listener."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: List[str] = []

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        value = super().get(key, timeout)
        if key.endswith("/addr/1") and not self.outcomes:
            import json
            import socket

            from procgroup.errors import AuthenticationError
            from procgroup.protocol.auth import client_handshake

            info = json.loads(value)
            addr = (info["host"], info["port"])
            with socket.create_connection(addr, timeout=5) as s:  # garbage instead of a handshake reply
                s.sendall(b"\xff" * 200)
            with socket.create_connection(addr, timeout=5):  # connect and leave
                pass
            with socket.create_connection(addr, timeout=5) as s:  # the wrong secret
                try:
                    client_handshake(s, b"not-the-job-secret", Deadline.after(5))
                    self.outcomes.append("accepted!?")
                except AuthenticationError:
                    self.outcomes.append("rejected")
        return value


def test_tcp_listener_survives_strangers(caplog: Any) -> None:
    from procgroup.transport import TcpTransport

    store = _MeddlingStore()
    out: List[Any] = [None, None]

    def make(r: int) -> None:
        out[r] = TcpTransport(
            store,
            r,
            2,
            peers=[1 - r],
            secret=b"job-secret",
            advertise_addr="127.0.0.1",
            deadline=Deadline.after(20),
            prefix="t",
        )

    with caplog.at_level("WARNING", logger="procgroup.transport"):
        threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    ts: List[Transport] = out
    try:
        assert store.outcomes == ["rejected"]
        assert all(t is not None for t in ts)
        ts[0].send(1, TAG, b"fine", dl())
        buf = bytearray(4)
        assert ts[1].recv(0, TAG, buf, dl()).nbytes == 4 and buf == b"fine"
        assert sum("dropped an incoming connection" in r.getMessage() for r in caplog.records) >= 2
    finally:
        for t in ts:
            if t is not None:
                t.close()


def test_tcp_wrong_secret_fails_formation() -> None:
    from procgroup.errors import AuthenticationError
    from procgroup.transport import TcpTransport

    store = DictStore()
    errs: List[Any] = [None, None]

    def make(r: int) -> None:
        try:
            TcpTransport(
                store,
                r,
                2,
                peers=[1 - r],
                secret=b"secret-%d" % r,
                advertise_addr="127.0.0.1",
                deadline=Deadline.after(2),
                prefix="t",
            ).close()
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(errs[0], AuthenticationError) and "rank 1" in str(errs[0])  # rank 0 dials rank 1
    assert isinstance(errs[1], DistTimeoutError) and "[0]" in str(errs[1])


def test_tcp_garbage_after_auth_fails_the_peer(caplog: Any) -> None:
    ts = _form("tcp", 2, "garbage")
    try:
        req = ts[1].irecv(0, TAG, bytearray(4))
        with caplog.at_level("ERROR", logger="procgroup.transport"):
            ts[0]._conns[1].sock.sendall(b"\x00" * 64)  # type: ignore[attr-defined]
            with pytest.raises(PeerFailureError) as ei:
                req.wait(dl(5))
        assert ei.value.peer == 0 and "protocol error" in str(ei.value) and "127.0.0.1:" in str(ei.value)
        assert any("bad frame magic" in r.getMessage() for r in caplog.records)
    finally:
        for t in ts:
            t.close()


def test_tcp_peer_close_is_a_peer_failure() -> None:
    ts = _form("tcp", 2, "eof")
    try:
        req = ts[1].irecv(0, TAG, bytearray(4))
        ts[0].close()
        with pytest.raises(PeerFailureError) as ei:
            req.wait(dl(5))
        assert ei.value.peer == 0 and "closed the connection" in str(ei.value)
    finally:
        for t in ts:
            t.close()


def test_shm_peer_close_is_a_peer_failure_after_draining() -> None:
    job = f"conf-{uuid.uuid4().hex[:10]}"
    ts = _form("shm", 2, job)
    try:
        ts[0].send(1, TAG, b"last", dl())
        ts[0].close()
        out = bytearray(4)
        assert ts[1].recv(0, TAG, out, dl(5)).nbytes == 4 and out == b"last"  # sent before closing: delivered
        t0 = time.monotonic()
        with pytest.raises(PeerFailureError) as ei:
            ts[1].recv(0, TAG, out, dl(5))
        assert ei.value.peer == 0 and "closed its transport" in str(ei.value) and time.monotonic() - t0 < 1
    finally:
        for t in ts:
            t.close()
    assert _segments(job) == []


def test_shm_rejects_bad_ring_size() -> None:
    from procgroup.transport import ShmTransport

    with pytest.raises(ConfigError, match="power of two"):
        ShmTransport(DictStore(), 0, 1, local_ranks=[0], job_id="x", ring_size=5000)


def test_cleanup_job_segments() -> None:
    from procgroup.transport.shm import cleanup_job_segments

    job = f"conf-{uuid.uuid4().hex[:10]}"
    path = os.path.join(SHM_DIR, segment_prefix(job) + "abc-r0")
    open(path, "wb").close()
    assert cleanup_job_segments(job) == [os.path.basename(path)]
    assert _segments(job) == []


def test_connect_transport_mode_checks() -> None:
    with pytest.raises(ConfigError, match="another host"):
        connect_transport(
            DictStore(),
            0,
            2,
            secret=b"s",
            host_keys=["a", "b"],
            advertise_addr="127.0.0.1",
            job_id="x",
            deadline=dl(1),
            mode="shm",
        )
    with pytest.raises(ConfigError, match="auto, shm, tcp"):
        connect_transport(
            DictStore(),
            0,
            2,
            secret=b"s",
            host_keys=["a", "a"],
            advertise_addr="127.0.0.1",
            job_id="x",
            deadline=dl(1),
            mode="udp",
        )
    with pytest.raises(ConfigError, match="host_keys"):
        connect_transport(
            DictStore(), 0, 2, secret=b"s", host_keys=["a"], advertise_addr="127.0.0.1", job_id="x", deadline=dl(1)
        )
    t = connect_transport(
        DictStore(), 0, 1, secret=b"s", host_keys=["a"], advertise_addr="127.0.0.1", job_id="x", deadline=dl(1)
    )
    assert t.kind == "loopback"
    t.close()


def test_waiting_on_one_transport_keeps_the_other_progressing(real_world: Any) -> None:
    """Rank 0 owes rank 1 (same host) the rest of a large message while it waits on rank 2 (other host),
    and rank 2 only sends once rank 1 got everything: waits must drive every transport."""
    ts = real_world(3)
    big = pattern(12 << 20, 5)

    def body(t: Transport) -> Any:
        if t.rank == 0:
            s = t.isend(1, 1, big)  # larger than a ring: most of it is still pending here
            out = bytearray(2)
            t.recv(2, 2, out, dl())
            s.wait(dl())
            return bytes(out)
        if t.rank == 1:
            out = np.zeros_like(big)
            t.recv(0, 1, out, dl())
            t.send(2, 3, bytes([np.array_equal(out, big)]), dl())
            return None
        ok = bytearray(1)
        t.recv(1, 3, ok, dl())
        t.send(0, 2, b"ok" if ok[0] else b"no", dl())
        return None

    assert run_ranks(ts, body)[0] == b"ok"


def test_send_completes_although_the_receiver_closes_at_once(real_world: Any) -> None:
    """Every byte was handed over: a peer that receives and closes at once must not fail the send."""
    big = pattern(8 << 20, 9)
    for _ in range(3):
        ts = real_world(2)

        def body(t: Transport) -> Any:
            if t.rank == 1:
                return t.isend(0, TAG, big).wait(dl()).nbytes
            out = np.empty_like(big)
            t.recv(1, TAG, out, dl())
            t.close()
            return bool(np.array_equal(out, big))

        assert run_ranks(ts, body) == [True, big.nbytes]


# -- the tcp reader is the FrameDecoder's message view: what the decoder rejects fails the peer -----------------


def _tcp_pair_with_raw_wire() -> Any:
    ts = _form("tcp", 2, "raw")
    return ts, ts[0]._conns[1].sock  # type: ignore[attr-defined]  # rank 0's socket to rank 1: write raw frames


@pytest.mark.parametrize(
    "wire, match",
    [
        (lambda: encode_header(TAG, 100) + b"0123456789", r"closed inside a frame payload \(10/100 bytes\)"),
        (lambda: encode_header(TAG, 100)[:11], r"closed inside a frame header \(11/24 bytes\)"),
        (lambda: encode_header(TAG, 2, FLAG_MORE) + b"ab", "closed inside a multi-frame message"),
        (
            lambda: encode_header(TAG, 2, FLAG_MORE) + b"ab" + encode_header(TAG + 1, 2) + b"cd",
            f"continuation frame with tag {TAG + 1} inside a message with tag {TAG}",
        ),
    ],
    ids=["payload", "header", "multi-frame", "continuation-tag"],
)
def test_tcp_truncated_or_inconsistent_message_fails_the_peer(wire: Callable[[], bytes], match: str) -> None:
    ts, sock = _tcp_pair_with_raw_wire()
    try:
        req = ts[1].irecv(0, TAG, bytearray(100))
        import socket

        try:  # the receiver may already have failed the connection on what it read: the send or the
            sock.sendall(wire())  # half-close then meets a reset (ENOTCONN, EPIPE); its verdict is what counts
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with pytest.raises(PeerFailureError, match=match) as ei:
            req.wait(dl(5))
        assert ei.value.peer == 0 and "protocol error" in str(ei.value)
    finally:
        for t in ts:
            t.close()


def test_tcp_multi_frame_message_too_big_for_buffer_keeps_the_stream_in_sync() -> None:
    """The first frame fits the posted buffer, the whole message does not: a size error, then the next message."""
    ts = _form("tcp-small-frames", 2, "sync")
    try:

        def body(t: Transport) -> Any:
            if t.rank == 0:
                t.recv(1, TAG + 1, bytearray(2), dl())  # rank 1 posted its receive: the frames go into its buffer
                t.send(1, TAG, pattern(10000, 1), dl())
                t.send(1, TAG, pattern(9000, 2), dl())
                return None
            out = np.zeros(6000, dtype=np.uint8)
            req = t.irecv(0, TAG, out)
            t.send(0, TAG + 1, b"go", dl())
            with pytest.raises(ProcGroupError, match="message of 8192 bytes") as ei:  # at the second frame
                req.wait(dl())
            assert np.array_equal(out[:4096], pattern(4096, 1))
            assert not isinstance(ei.value, (DistTimeoutError, PeerFailureError))
            big = np.zeros(9000, dtype=np.uint8)
            st = t.recv(0, TAG, big, dl())
            return st.nbytes == 9000 and np.array_equal(big, pattern(9000, 2))

        assert run_ranks(ts, body)[1] is True
    finally:
        for t in ts:
            t.close()


def test_tcp_unexpected_multi_frame_messages_interleaved_with_posted_ones() -> None:
    """Messages of many frames that find their receive posted, between ones that arrive before it."""
    ts = _form("tcp-small-frames", 2, "mixed")
    sizes = [0, 1, 4095, 4096, 4097, 20000, 100000, 12289]
    try:

        def body(t: Transport) -> Any:
            if t.rank == 0:
                t.recv(1, TAG, bytearray(2), dl())  # rank 1 posted its receives
                for i, n in enumerate(sizes):
                    t.send(1, TAG + 1 + i, pattern(n, i), dl())
                return None
            posted = {i: np.zeros(n, dtype=np.uint8) for i, n in enumerate(sizes) if i % 2}
            reqs = {i: t.irecv(0, TAG + 1 + i, out) for i, out in posted.items()}
            t.send(0, TAG, b"go", dl())
            ok = []
            for i, n in reversed(list(enumerate(sizes))):  # the unexpected ones wait queued, in any order
                if i in reqs:
                    st = reqs[i].wait(dl())
                    out = posted[i]
                else:
                    out = np.zeros(n, dtype=np.uint8)
                    st = t.recv(0, TAG + 1 + i, out, dl())
                ok.append(st.nbytes == n and np.array_equal(out, pattern(n, i)))
            return ok

        assert run_ranks(ts, body)[1] == [True] * len(sizes)
    finally:
        for t in ts:
            t.close()
