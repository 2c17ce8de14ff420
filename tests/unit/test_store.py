"""Tests for procgroup.store: TCPStore against a real StoreServer on loopback, FileStore across
processes, HashStore and PrefixStore."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import socket
import struct
import threading
import time

import pytest

from procgroup.deadline import Deadline
from procgroup.errors import (
    AuthenticationError,
    BrokenError,
    ClosedError,
    ConfigError,
    ConnectError,
    ProtocolError,
    StoreError,
    StoreTimeoutError,
)
from procgroup.netutil import bind_listener
from procgroup.protocol import store_codec as sc
from procgroup.protocol.auth import client_handshake, server_handshake
from procgroup.store import FileStore, HashStore, PrefixStore, Store, StoreServer, TCPStore

SECRET = b"test-secret-0123456789abcdef"


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def connect(server):
    """Factory for TCPStore clients of ``server``; all are closed at teardown."""
    made: list[TCPStore] = []

    def make(**kw) -> TCPStore:
        kw.setdefault("secret", SECRET)
        kw.setdefault("timeout", 10.0)
        c = TCPStore("127.0.0.1", server.port, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def raw(server):
    """Factory for raw sockets to ``server`` (optionally authenticated)."""
    socks: list[socket.socket] = []

    def make(auth: bool = True) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        socks.append(s)
        if auth:
            client_handshake(s, SECRET, Deadline.after(5))
        return s

    yield make
    for s in socks:
        s.close()


@pytest.fixture(params=["hash", "file", "tcp", "prefix"])
def store(request, tmp_path):
    """Every Store implementation, for the semantics they must share."""
    closers = []
    if request.param == "hash":
        st: Store = HashStore(timeout=10)
    elif request.param == "file":
        st = FileStore(str(tmp_path / "store"), timeout=10)
    elif request.param == "tcp":
        srv = StoreServer("127.0.0.1", 0, secret=SECRET)
        srv.start()
        closers.append(srv.close)
        st = TCPStore("127.0.0.1", srv.port, secret=SECRET, timeout=10)
    else:
        st = PrefixStore("ns", HashStore(timeout=10))
    yield st
    st.close()
    for c in closers:
        c()


def recv_until_eof(s: socket.socket, limit: float = 5.0) -> bytes:
    s.settimeout(limit)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def events_of(data: bytes) -> list:
    codec = sc.StoreCodec("client")
    codec.receive_data(data)
    evs = []
    while (ev := codec.next_event()) is not sc.NEED_DATA:
        evs.append(ev)
    return evs


# ---------------------------------------------------------------- shared semantics


def test_every_op(store):
    store.set("a", b"1")
    store.set("s", "ünïcode")
    assert store.get("a") == b"1"
    assert store.get("s") == "ünïcode".encode()
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    assert store.check(["a", "n"]) and store.check("a")
    assert not store.check(["a", "missing"])
    assert store.check([])
    store.multi_set(["m1", "m2"], [b"x", "y"])
    assert store.multi_get(["m2", "m1", "a"]) == [b"y", b"x", b"1"]
    store.wait(["a", "m1"])
    store.wait("a", timeout=1)
    base = store.num_keys()
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == base - 1
    assert not store.check("a")
    store.set("big", bytes(range(256)) * 4096)
    assert store.get("big") == bytes(range(256)) * 4096


def test_compare_set_semantics(store):
    # absent key, expected empty: set desired
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.get("k") == b"first"
    # present, expected matches: swap
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.get("k") == b"second"
    # present, mismatch: unchanged, returns current
    assert store.compare_set("k", b"wrong", b"third") == b"second"
    assert store.get("k") == b"second"
    # present, expected empty: mismatch too
    assert store.compare_set("k", b"", b"x") == b"second"
    # absent key, non-empty expected: nothing set (torch replies `expected`)
    assert store.compare_set("absent", b"exp", b"des") == b"exp"
    assert not store.check("absent")
    assert store.compare_set("k", "second", "str-ok") == b"str-ok"


def test_add_on_non_integer_is_store_error(store):
    store.set("text", b"abc")
    with pytest.raises(StoreError, match="not a decimal integer"):
        store.add("text", 1)
    assert store.add("ok", 1) == 1  # still usable


def test_wait_timeout_lists_missing_keys(store):
    store.set("present", b"1")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as ei:
        store.wait(["present", "gone1", "gone2"], timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert sorted(ei.value.missing) == ["gone1", "gone2"]
    msg = str(ei.value)
    assert "gone1" in msg and "gone2" in msg and "PROCGROUP_TIMEOUT" in msg
    assert "present" not in ei.value.missing
    assert isinstance(ei.value, TimeoutError)
    store.set("after", b"ok")  # the store is still usable
    assert store.get("after") == b"ok"


def test_get_timeout_names_key_and_elapsed(store):
    with pytest.raises(StoreTimeoutError) as ei:
        store.get("never", timeout=0.2)
    assert ei.value.missing == ["never"]
    assert "'never'" in str(ei.value)
    assert re.search(r"timed out after \d+\.\d\ds", str(ei.value))


def test_zero_timeout_is_immediate(store):
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        store.multi_get(["nope"], timeout=0)
    assert time.monotonic() - t0 < 1.0


def test_default_timeout_attribute(store):
    store.timeout = 0.2
    with pytest.raises(StoreTimeoutError):
        store.get("never")
    store.set_timeout(10)
    assert store.timeout == 10


def test_blocking_get_released_by_other_thread(store):
    # a TCPStore serialises requests on its one connection: the setter gets its own
    setter = TCPStore(store.host, store.port, secret=SECRET) if isinstance(store, TCPStore) else store

    def later():
        time.sleep(0.2)
        setter.set("late", b"value")

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    try:
        assert store.get("late", timeout=5) == b"value"
        assert time.monotonic() - t0 >= 0.15
    finally:
        t.join()
        if setter is not store:
            setter.close()


# ---------------------------------------------------------------- TCP specifics


def test_tcp_blocking_get_released_by_other_client(connect):
    a, b = connect(), connect()
    timer = threading.Timer(0.2, lambda: b.set("k", b"v"))
    timer.start()
    t0 = time.monotonic()
    assert a.get("k", timeout=5) == b"v"
    assert time.monotonic() - t0 >= 0.15
    timer.join()


def test_tcp_wait_and_multi_get_released_by_other_client(connect):
    a, b = connect(), connect()
    results = {}

    def waiter():
        a.wait(["x", "y"], timeout=5)
        results["vals"] = a.multi_get(["y", "x"], timeout=5)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    b.set("x", b"1")
    time.sleep(0.1)
    assert t.is_alive()  # y is still missing
    b.set("y", b"2")
    t.join(5)
    assert results["vals"] == [b"2", b"1"]


def test_tcp_multi_get_waits_for_missing(connect):
    a, b = connect(), connect()
    a.set("p", b"1")
    threading.Timer(0.2, lambda: b.add("q", 3)).start()
    assert a.multi_get(["p", "q"], timeout=5) == [b"1", b"3"]


def test_tcp_thread_safe_shared_client(connect):
    c = connect()

    def work():
        for _ in range(50):
            c.add("shared", 1)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert c.get("shared") == b"400"


def test_tcp_200_concurrent_clients_add(server, connect):
    n = 200
    clients = [connect() for _ in range(n)]
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    results: list[int] = []
    lock = threading.Lock()

    def work(c: TCPStore) -> None:
        try:
            barrier.wait(10)
            got = [c.add("counter", 1) for _ in range(5)]
            c.wait(["go"], timeout=10)  # 200 parked waits released by one set
            with lock:
                results.extend(got)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    main = connect()
    ts = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 10
    while main.get("counter", timeout=10) != b"1000" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.num_connections == n + 1
    main.set("go", b"1")
    for t in ts:
        t.join(10)
    assert not errors, errors[:3]
    assert sorted(results) == list(range(1, 1001))  # every add saw a distinct value
    assert not server._waiting


def test_tcp_wrong_secret_refused_while_others_work(server, connect, caplog):
    good = connect()
    good.set("k", b"v")
    caplog.set_level(logging.WARNING, logger="procgroup.store")
    with pytest.raises(AuthenticationError) as ei:
        TCPStore("127.0.0.1", server.port, secret=b"wrong-secret", timeout=5)
    assert "PROCGROUP_SECRET" in str(ei.value)
    assert f"127.0.0.1:{server.port}" in str(ei.value)
    assert good.get("k") == b"v"
    good.set("k2", b"v2")
    assert connect().get("k2") == b"v2"
    time.sleep(0.05)
    assert any("refused 127.0.0.1:" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_tcp_garbage_before_auth_is_dropped(server, connect, raw, caplog):
    good = connect()
    caplog.set_level(logging.WARNING, logger="procgroup.store")
    s = raw(auth=False)
    hello = s.recv(40)
    assert hello.startswith(b"PGAUTH01")
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 100)
    assert recv_until_eof(s) == bytes(32)  # the handshake's failure message, then EOF
    good.set("still", b"ok")
    assert good.get("still") == b"ok"
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_tcp_garbage_frame_after_auth_gets_error_and_dropped(server, connect, raw, caplog):
    good = connect()
    caplog.set_level(logging.WARNING, logger="procgroup.store")
    s = raw()
    s.sendall(b"\x00\x00\x00\x05\x42junk")
    evs = events_of(recv_until_eof(s))
    assert len(evs) == 1 and isinstance(evs[0], sc.Error)
    assert "unknown store message type 0x42" in evs[0].message
    assert good.add("c", 1) == 1
    peer = "127.0.0.1:%d" % s.getsockname()[1]
    assert any(peer in r.getMessage() and "protocol error" in r.getMessage() for r in caplog.records)


def test_tcp_oversized_header_gets_error_and_dropped(server, connect, raw):
    good = connect()
    s = raw()
    s.sendall(struct.pack(">I", 0xFFFFFFF0))  # "4 GiB frame": refused from the header alone
    evs = events_of(recv_until_eof(s))
    assert len(evs) == 1 and isinstance(evs[0], sc.Error) and "limit" in evs[0].message
    assert good.add("c", 1) == 1
    s.close()
    deadline = time.monotonic() + 5
    while server.num_connections > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.num_connections == 1  # the refused connection is gone, the good one stays


def test_tcp_truncated_frame_then_close(server, connect, raw):
    good = connect()
    s = raw()
    s.sendall(sc.encode(sc.Set("k", b"v" * 100))[:20])
    s.shutdown(socket.SHUT_WR)
    recv_until_eof(s)
    assert not good.check("k")
    good.ping()


def test_tcp_auth_timeout_drops_silent_client():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET, auth_timeout=0.2)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            t0 = time.monotonic()
            assert len(recv_until_eof(s)) == 40  # the greeting, then EOF at the auth timeout
            assert time.monotonic() - t0 < 3
    finally:
        srv.close()


def test_tcp_pipelined_requests_answered_in_order(server, connect, raw):
    other = connect()
    s = raw()
    s.sendall(
        sc.encode(sc.Set("a", b"1")) + sc.encode(sc.Wait(("b",), 5000)) + sc.encode(sc.Get("b")) + sc.encode(sc.Ping())
    )
    time.sleep(0.2)
    other.set("b", b"2")
    codec = sc.StoreCodec("client")
    got: list = []
    s.settimeout(5)
    while len(got) < 4:
        codec.receive_data(s.recv(65536))
        while (ev := codec.next_event()) is not sc.NEED_DATA:
            got.append(ev)
    assert got == [sc.Ok(), sc.Ok(), sc.Value(b"2"), sc.Ok()]


def test_tcp_client_disconnect_while_parked_cleans_up(server, raw):
    s = raw()
    s.sendall(sc.encode(sc.Wait(("never",), 60_000)))
    deadline = time.monotonic() + 5
    while not server._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "never" in server._waiting
    s.close()
    while server._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._waiting
    assert server.num_connections == 0


def test_tcp_connect_to_closed_port_fast_and_named():
    lst = bind_listener("127.0.0.1", 0)
    port = lst.getsockname()[1]
    lst.close()
    t0 = time.monotonic()
    with pytest.raises(ConnectError) as ei:
        TCPStore("127.0.0.1", port, secret=SECRET, timeout=5, connect_timeout=0.3)
    elapsed = time.monotonic() - t0
    assert elapsed < 3
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg
    assert "Connection refused" in msg
    assert "attempts" in msg and "MASTER_ADDR" in msg and "PROCGROUP_TIMEOUT" in msg
    assert "rank 0" in msg


def test_tcp_connect_retries_until_server_appears():
    port = bind_listener("127.0.0.1", 0)
    p = port.getsockname()[1]
    port.close()
    srv = StoreServer("127.0.0.1", p, secret=SECRET)
    timer = threading.Timer(0.3, srv.start)
    timer.start()
    try:
        c = TCPStore("127.0.0.1", p, secret=SECRET, timeout=5)
        c.set("up", b"1")
        c.close()
    finally:
        timer.join()
        srv.close()


def _record_connect_sleeps(monkeypatch) -> list[float]:
    """Replace the client's retry sleep with a short real one, recording the requested durations."""
    import procgroup.store.tcp as store_mod

    slept: list[float] = []
    real_sleep = time.sleep

    def fake_sleep(s: float) -> None:
        slept.append(s)
        real_sleep(min(s, 0.002))

    monkeypatch.setattr(store_mod.time, "sleep", fake_sleep)
    return slept


def test_tcp_connect_refused_retries_stay_fast(monkeypatch):
    """ "Connection refused" (the host is up, rank 0 not listening yet) is retried every <= ~25 ms,
    not on a doubling backoff, so the clients find the store right after it opens."""
    import procgroup.store.tcp as store_mod

    lst = bind_listener("127.0.0.1", 0)
    port = lst.getsockname()[1]
    lst.close()
    slept = _record_connect_sleeps(monkeypatch)
    with pytest.raises(ConnectError):
        TCPStore("127.0.0.1", port, secret=SECRET, timeout=5, connect_timeout=0.3)
    assert len(slept) >= 10
    assert max(slept) <= store_mod._REFUSED_BACKOFF_MAX * 1.25 + 1e-9


def test_tcp_connect_other_errors_back_off(monkeypatch):
    """Any other failure (here: the name does not resolve) keeps the doubling backoff."""
    import procgroup.store.tcp as store_mod

    def no_such_host(host, port):
        raise ConfigError(f"cannot resolve {host!r}")

    monkeypatch.setattr(store_mod, "resolve", no_such_host)
    slept = _record_connect_sleeps(monkeypatch)
    with pytest.raises(ConnectError):
        TCPStore("nowhere.invalid", 1234, secret=SECRET, timeout=5, connect_timeout=0.3)
    assert max(slept) > store_mod._REFUSED_BACKOFF_MAX * 1.25  # it doubled past the refused-retry cap


def test_tcp_server_gone_mid_request_is_broken_error(connect, server):
    c = connect()
    threading.Timer(0.2, server.close).start()
    with pytest.raises(BrokenError) as ei:
        c.wait(["never"], timeout=5)
    assert f"127.0.0.1:{server.port}" in str(ei.value)
    with pytest.raises(BrokenError):  # and it stays broken
        c.set("x", b"1")


def test_tcp_unresponsive_server_client_deadline(monkeypatch):
    """A server that authenticates but never answers: the client's own deadline fires, the
    connection is dropped (a late reply can never answer a later request) and re-opened on next use."""
    import procgroup.store.tcp as store_mod

    monkeypatch.setattr(store_mod, "_WAIT_GRACE", 0.2)
    lst = bind_listener("127.0.0.1", 0)
    lst.settimeout(5)
    port = lst.getsockname()[1]
    conns = []

    def accept():
        for _ in range(2):
            try:
                s, _ = lst.accept()
            except OSError:
                return
            conns.append(s)
            server_handshake(s, SECRET, Deadline.after(5))

    t = threading.Thread(target=accept)
    t.start()
    try:
        c = TCPStore("127.0.0.1", port, secret=SECRET, timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=f"127.0.0.1:{port}"):
            c.set("k", b"v")
        assert time.monotonic() - t0 < 3
        assert c._sock is None
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError) as ei:  # reconnects, then server timeout + grace
            c.wait(["w1", "w2"], timeout=0.2)
        assert 0.35 < time.monotonic() - t0 < 3
        assert ei.value.missing == ["w1", "w2"]
        assert len(conns) == 2 and c._sock is None
        c.close()
    finally:
        t.join(5)
        for s in conns:
            s.close()
        lst.close()


def test_tcp_closed_client_raises_closed_error(connect):
    c = connect()
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.set("a", b"b")


def test_tcp_server_error_reply_keeps_connection(connect):
    c = connect()
    c.set("t", b"nan")
    with pytest.raises(StoreError, match="127.0.0.1"):
        c.add("t", 1)
    c.ping()


def test_tcp_oversize_value_rejected_locally(connect):
    c = connect()
    with pytest.raises(ConfigError):
        c.set("k" * 5000, b"v")
    c.ping()


def test_tcp_large_values_backpressure(connect):
    a, b = connect(), connect()
    big = os.urandom(8 << 20)
    a.multi_set(["b1", "b2"], [big, big[::-1]])
    assert b.multi_get(["b1", "b2"]) == [big, big[::-1]]


def test_tcp_bad_port_config_error():
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        TCPStore("127.0.0.1", 70000, secret=SECRET)


def test_server_lifecycle():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    port = srv.start()
    assert port == srv.port > 0
    assert srv.start() == port
    srv.close()
    srv.close()
    assert srv.port == port
    with pytest.raises(ClosedError):
        srv.start()
    with pytest.raises(ConnectError):
        TCPStore("127.0.0.1", port, secret=SECRET, connect_timeout=0.2)


# ---------------------------------------------------------------- FileStore


def _filestore_child(path: str, n: int) -> None:
    st = FileStore(path, timeout=20)
    st.wait(["parent_ready"])
    for _ in range(n):
        st.add("counter", 1)
    st.set("child_done", b"1")
    assert st.get("parent_value") == b"from-parent"
    st.close()


def test_filestore_across_processes(tmp_path):
    path = str(tmp_path / "fs")
    st = FileStore("file://" + path, timeout=20)
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_filestore_child, args=(path, 100))
    p.start()
    try:
        st.set("parent_value", b"from-parent")
        st.set("parent_ready", b"1")
        for _ in range(100):
            st.add("counter", 1)
        st.wait(["child_done"], timeout=20)
        assert st.get("counter") == b"200"
        p.join(20)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        st.close()


def test_filestore_two_instances_see_each_other(tmp_path):
    a = FileStore(str(tmp_path / "fs"), timeout=5)
    b = FileStore(str(tmp_path / "fs"), timeout=5)
    threading.Timer(0.1, lambda: b.set("k", b"v")).start()
    assert a.get("k", timeout=5) == b"v"
    assert a.delete_key("k") and not b.check("k")
    a.close()
    b.close()


def test_filestore_rejects_foreign_file(tmp_path):
    p = tmp_path / "notastore"
    p.write_bytes(b"hello world, not a store")
    with pytest.raises(ConfigError, match="not a procgroup FileStore"):
        FileStore(str(p))


def test_filestore_repairs_partial_tail(tmp_path):
    p = str(tmp_path / "fs")
    a = FileStore(p)
    a.set("k", b"v")
    a.close()
    with open(p, "ab") as f:
        f.write(b"S\x00\x00\x00\x05ab")  # a writer died mid-record
    b = FileStore(p)
    assert b.get("k") == b"v"
    b.set("k2", b"v2")
    c = FileStore(p)
    assert c.multi_get(["k", "k2"]) == [b"v", b"v2"]
    b.close()
    c.close()


def test_filestore_write_that_cannot_be_logged_leaves_no_trace(tmp_path):
    """A key over the size limit is refused (ConfigError) before anything is logged, and the store's view
    stays what the file holds: the state machine's change is undone."""
    p = str(tmp_path / "fs")
    a = FileStore(p, timeout=0.2)
    a.set("k", b"1")
    long_key = "x" * (sc.MAX_KEY_LEN + 1)
    with pytest.raises(ConfigError, match="byte limit"):
        a.set(long_key, b"v")
    with pytest.raises(ConfigError, match="byte limit"):
        a.multi_set(["ok", long_key], [b"1", b"2"])
    with pytest.raises(ConfigError, match="byte limit"):
        a.add(long_key, 1)
    assert a.compare_set(long_key, b"nope", b"v") == b"nope"  # stores nothing, so nothing to refuse
    assert not a.check([long_key]) and not a.check(["ok"]) and a.num_keys() == 1
    assert a.add("k", 2) == 3
    b = FileStore(p)
    assert b.num_keys() == 1 and b.get("k") == b"3"
    a.close()
    b.close()


def test_filestore_add_and_compare_set_log_only_changes(tmp_path):
    p = str(tmp_path / "fs")
    a = FileStore(p)
    a.set("t", b"text")
    size = os.path.getsize(p)
    with pytest.raises(StoreError, match="not a decimal integer"):
        a.add("t", 1)
    assert a.compare_set("t", b"other", b"x") == b"text"
    assert a.compare_set("t", b"text", b"text") == b"text"  # same value: nothing to append
    assert os.path.getsize(p) == size
    assert a.compare_set("t", b"text", b"new") == b"new"
    b = FileStore(p)
    assert b.get("t") == b"new"
    a.close()
    b.close()


def test_filestore_closed(tmp_path):
    st = FileStore(str(tmp_path / "fs"))
    st.close()
    with pytest.raises(ClosedError):
        st.set("a", b"b")


def test_filestore_bad_directory(tmp_path):
    with pytest.raises(ConfigError, match="cannot open"):
        FileStore(str(tmp_path / "no" / "such" / "dir" / "fs"))


# ---------------------------------------------------------------- HashStore / PrefixStore


def test_hashstore_ranks_as_threads():
    st = HashStore(timeout=5)
    world = 8
    out = [None] * world

    def rank(r: int) -> None:
        st.set(f"rank/{r}", str(r))
        st.add("joined", 1)
        st.wait([f"rank/{i}" for i in range(world)])
        out[r] = st.multi_get([f"rank/{i}" for i in range(world)])

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert all(o == [str(i).encode() for i in range(world)] for o in out)
    assert st.get("joined") == b"8"


def test_hashstore_close_wakes_waiters():
    st = HashStore(timeout=10)
    err = []

    def waiter():
        try:
            st.get("never")
        except ClosedError as e:
            err.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    st.close()
    t.join(5)
    assert len(err) == 1


def test_prefixstore_isolation():
    base = HashStore(timeout=5)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"A")
    b.set("k", b"B")
    assert a.get("k") == b"A" and b.get("k") == b"B"
    assert base.get("a/k") == b"A"
    assert a.add("n", 2) == 2 and b.add("n", 5) == 5
    assert a.delete_key("k") and b.check("k") and not a.check("k")
    nested = PrefixStore("inner", a)
    nested.set("x", b"1")
    assert base.get("a/inner/x") == b"1"
    with pytest.raises(StoreTimeoutError) as ei:
        a.wait(["k", "n"], timeout=0.1)
    assert ei.value.missing == ["k"]  # reported in the caller's namespace
    assert a.num_keys() == base.num_keys()
    a.timeout = 3
    assert base.timeout == 3
    a.close()
    with pytest.raises(ClosedError):
        a.get("n")
    assert b.get("n") == b"5"  # the underlying store is not closed


def test_prefixstore_over_tcp(connect):
    c = connect()
    p = PrefixStore("job1", c)
    p.set("x", b"1")
    assert c.get("job1/x") == b"1"
    with pytest.raises(StoreTimeoutError) as ei:
        p.get("y", timeout=0.1)
    assert ei.value.missing == ["y"]


def test_protocol_error_type_exported():
    # clients see malformed replies as ProtocolError (a ProcGroupError)
    assert issubclass(ProtocolError, RuntimeError)
