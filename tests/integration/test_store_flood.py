"""Idle strangers at the store (issue 11 item 12): connections that never authenticate, up to the store's
open-files limit, must not keep genuine clients out.  The store runs in a subprocess with a low
RLIMIT_NOFILE; the strangers are plain sockets that connect and say nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procgroup.store import TCPStore

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]

HOST = textwrap.dedent(
    """
    import os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    hog = [os.open(os.devnull, os.O_RDONLY) for _ in range(int(sys.argv[1]))]  # leave few descriptors free
    from procgroup.store import StoreServer
    srv = StoreServer("127.0.0.1", 0, secret=b"genuine")
    print(srv.start(), flush=True)
    time.sleep(60)
    """
)


def _host(hog: int, auth_timeout: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PROCGROUP_STORE_AUTH_TIMEOUT=auth_timeout)
    p = subprocess.Popen(
        [sys.executable, "-c", HOST, str(hog)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _strangers(port: int, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))  # the kernel's backlog accepts even when the store cannot
        except OSError:
            s.close()
            break
        out.append(s)
    return out


@pytest.mark.parametrize("hog", [0, 48], ids=["cap", "emfile"])
def test_idle_unauthenticated_connections_do_not_keep_genuine_clients_out(hog):  # type: ignore[no-untyped-def]
    # a 30 s auth timeout: the genuine clients must get in by eviction, long before any stranger times out
    p, port = _host(hog, "30")
    idle = _strangers(port, 150)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        clients = []
        for i in range(4):
            c = TCPStore("127.0.0.1", port, secret=b"genuine", timeout=10, connect_timeout=10)
            c.set(f"k{i}", b"v%d" % i)
            clients.append(c)
        assert [c.get(f"k{i}") for i, c in enumerate(clients)] == [b"v0", b"v1", b"v2", b"v3"]
        took = time.monotonic() - t0
        assert took < 5.0, took
        for c in clients:
            c.close()
    finally:
        for s in idle:
            s.close()
        p.kill()
        _, err = p.communicate(timeout=10)
    assert "oldest first" in err, err
    assert ("no file descriptor left" if hog else "too many connections still authenticating") in err, err


def test_a_silent_connection_is_closed_after_the_auth_timeout():  # type: ignore[no-untyped-def]
    p, port = _host(0, "1")
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.settimeout(10)
        t0 = time.monotonic()
        data = b""
        while True:  # the greeting, then EOF when the store gives up on us
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - t0
        assert data.startswith(b"PGAUTH01") and 0.8 < took < 4.0, (data, took)
        s.close()
    finally:
        p.kill()
        _, err = p.communicate(timeout=10)
    assert "no handshake within 1.0s" in err, err
