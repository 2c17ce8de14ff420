"""Bad inputs that need real processes: each asserts the error TYPE and that the message names the fix.

Single-process bad inputs (roots out of range, sending to self, bad buffers, ops a dtype does not have,
calls before init, double init, bad init_method URLs, an unreachable master, a port in use, missing
RANK/WORLD_SIZE) are in ``tests/unit/test_bad_inputs_unit.py``.

Wrong job secret, what happens (``test_wrong_secret``): the rank with the other PROCGROUP_SECRET fails at
once with AuthenticationError ("every rank must use the same PROCGROUP_SECRET"); the store never admits
it, so the ranks with the right secret cannot tell it from a rank that never started: they wait for it
and fail at their init deadline with RendezvousTimeoutError naming it as missing.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from procgroup.deadline import Deadline
from procgroup.netutil import free_port
from procgroup.protocol.auth import client_handshake

from .harness import ROOT, collect, kill_all, worker_env

BAD = Path(__file__).with_name("fault_workers") / "bad_inputs.py"


def spawn(
    n: int,
    args: Sequence[str],
    env: Optional[Dict[str, str]] = None,
    per_rank: Optional[Dict[int, Dict[str, str]]] = None,
    ranks: Optional[Sequence[int]] = None,
    port: Optional[int] = None,
    secret: Optional[str] = None,
) -> List[subprocess.Popen]:
    port = port or free_port()
    secret = secret or secrets.token_hex(16)
    procs = []
    for i, r in enumerate(range(n) if ranks is None else ranks):
        e = dict(env or {})
        e.update((per_rank or {}).get(i, {}))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(BAD), *args],
                env=worker_env(r, n, port, secret, e),
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def finish(procs: List[subprocess.Popen], timeout: float = 60.0):
    outs = [(r.returncode, r.stdout, r.stderr) for r in collect(procs, timeout)]
    text = "\n".join(f"--- process {i} rc={rc}\n{so}\n{se[-3000:]}" for i, (rc, so, se) in enumerate(outs))
    results: List[Dict[str, str]] = []
    for _, so, _ in outs:
        m = re.search(r"^RESULT (\S+) type=(\w+) after=([\d.]+) msg=(.*)$", so, re.M)
        results.append({"rank": m.group(1), "type": m.group(2), "after": m.group(3), "msg": m.group(4)} if m else {})
    return results, text, outs


# -------------------------------------------------------------------------------- mismatched calls
@pytest.mark.parametrize(
    "kind, transport, sides",
    [
        ("dtype", "shm", ["all_reduce(float32, 4, SUM)", "all_reduce(float64, 4, SUM)"]),
        ("count", "tcp", ["all_reduce(int64, 4, SUM)", "all_reduce(int64, 8, SUM)"]),
        ("shape", "shm", ["all_gather(float32, 4)", "all_gather(float32, 6)"]),
    ],
)
@pytest.mark.timeout(60)
def test_mismatch_across_ranks(kind: str, transport: str, sides: List[str]) -> None:
    """3 ranks, the last calls with another dtype / element count / shape: every rank raises CollectiveMismatchError."""
    results, text, _ = finish(spawn(3, ["mismatch", kind], env={"PROCGROUP_TRANSPORT": transport}), 45)
    for res in results:
        assert res.get("type") == "CollectiveMismatchError", text
        assert float(res["after"]) < 10.0, text
        assert "Every member of a group must call the same collectives in the same order" in res["msg"], text
        for s in sides:
            assert s in res["msg"], text
    # every rank reports the same finding (the first detector's), which shows the odd rank's call; the
    # majority side lists the members whose state the detector had seen by then (rank [0], or ranks [0, 1])
    assert len({res["msg"].split(": collective mismatch", 1)[1] for res in results}) == 1, text
    assert "rank [2] called" in results[0]["msg"], text


# -------------------------------------------------------------------------------- group formation
@pytest.mark.timeout(60)
def test_world_size_mismatch() -> None:
    """Rank 1 says WORLD_SIZE=3, the others 2: every rank fails at once, told to set the same WORLD_SIZE."""
    procs = spawn(2, ["init_only"], env={"TEST_INIT_TIMEOUT": "20"}, per_rank={1: {"WORLD_SIZE": "3"}})
    results, text, _ = finish(procs, 40)
    for res in results:
        assert res.get("type") == "RendezvousError", text
        assert "world-size mismatch" in res["msg"] and "set the same WORLD_SIZE on every rank" in res["msg"], text
        assert float(res["after"]) < 10.0, text  # not at the 20 s deadline


@pytest.mark.timeout(60)
def test_duplicate_rank() -> None:
    """Two processes with RANK=1: every process fails at once, told that each needs a distinct RANK."""
    results, text, _ = finish(spawn(3, ["init_only"], env={"TEST_INIT_TIMEOUT": "20"}, ranks=[0, 1, 1]), 40)
    for res in results:
        assert res.get("type") == "RendezvousError", text
        assert "duplicate rank 1" in res["msg"] and "every process needs a distinct RANK in 0..2" in res["msg"], text
        assert float(res["after"]) < 10.0, text


@pytest.mark.timeout(60)
def test_wrong_secret() -> None:
    """Rank 2 has another PROCGROUP_SECRET: it fails at once (AuthenticationError, use the same secret);
    ranks 0 and 1 cannot distinguish it from a rank that never came and time out naming it missing."""
    procs = spawn(
        3, ["init_only"], env={"TEST_INIT_TIMEOUT": "4"}, per_rank={2: {"PROCGROUP_SECRET": "not-the-job-secret"}}
    )
    results, text, _ = finish(procs, 40)
    bad = results[2]
    assert bad.get("type") == "AuthenticationError", text
    assert "every rank must use the same PROCGROUP_SECRET" in bad["msg"], text
    assert float(bad["after"]) < 3.0, text
    for res in results[:2]:
        assert res.get("type") == "RendezvousTimeoutError", text
        assert "missing: rank [2]" in res["msg"] and "PROCGROUP_TIMEOUT" in res["msg"], text
    # the store host logged the refused connection, with the reason
    assert "store server: refused" in text or "did not prove the job secret" in text, text


# -------------------------------------------------------------------------------- garbage on the wire
def _send_raw(port: int, data: bytes, hold: float = 0.0) -> Optional[bytes]:
    """Connect to 127.0.0.1:port, send ``data``, read whatever comes back until EOF (at most 3 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        try:
            s.sendall(data)
        except OSError:
            return None
        if hold:
            time.sleep(hold)
        got = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                got += b
        except OSError:
            pass
        return got


def _authed(port: int, secret: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    client_handshake(s, secret.encode(), Deadline.after(5))
    return s


def _drain_closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the server closes ``s`` within ``timeout`` (after maybe sending an ERROR frame)."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_garbage_to_store_and_transport_ports(tmp_path) -> None:
    """Garbage, oversized length headers and stalled handshakes sent by raw sockets while a 3-rank job runs.

    Transport: rank 2's TCP listener is open only while the group forms (it closes once every lower rank
    has connected), so rank 1 holds back its dial to rank 2 while the test sends: random bytes, a frame
    header announcing 2**62 bytes, an authenticated connection with a bogus rank identification, and a
    connection that stalls inside the handshake.  Store: while the formed job waits, random bytes, an
    authenticated 0xFFFFFFFF length header, an authenticated 64 MiB header with no body (left open), an
    unknown message type, and an idle unauthenticated connection (left open).  Afterwards the job runs
    collectives, new_group and object collectives, all of which succeed.
    """
    secret = secrets.token_hex(16)
    port = free_port()
    go = tmp_path
    procs = spawn(3, ["garbage"], env={"PROCGROUP_TRANSPORT": "tcp", "GO_DIR": str(go)}, port=port, secret=secret)
    held: List[socket.socket] = []
    rng = random.Random(1234)
    try:
        # rank 2 prints its listening port; rank 1 waits for "dial"
        tport = None
        dl = time.monotonic() + 40
        for line in procs[2].stdout:  # type: ignore[union-attr]
            m = re.match(r"LISTEN 2 (\d+)", line)
            if m:
                tport = int(m.group(1))
                break
            assert time.monotonic() < dl
        assert tport, "rank 2 did not report its transport port"
        # --- the transport listener during formation
        assert _send_raw(tport, bytes(rng.getrandbits(8) for _ in range(4096))) is not None
        assert _send_raw(tport, struct.pack("<HBBIQQ", 0x4750, 1, 0, 0, 5, 1 << 62)) is not None
        with _authed(tport, secret) as s:  # the secret, but not a rank of this job
            s.sendall(struct.pack("<4sHHIII", b"PGTC", 1, 0, 77, 2, 999))
            s.settimeout(5)
            assert s.recv(1) in (b"\x02", b"")  # rejected
        stall = socket.create_connection(("127.0.0.1", tport), timeout=5)
        stall.sendall(b"\x00" * 10)  # a third of a handshake reply, then nothing
        held.append(stall)
        (go / "dial").touch()
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            while line.startswith("LISTEN"):
                line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("FORMED"), line
        with pytest.raises(OSError):  # the listener is gone once the group has formed
            socket.create_connection(("127.0.0.1", tport), timeout=2).close()
        # --- the store port while the job runs
        assert _send_raw(port, bytes(rng.getrandbits(8) for _ in range(65536))) is not None
        s = _authed(port, secret)
        s.sendall(b"\xff\xff\xff\xff" + b"\x01" * 100)
        assert _drain_closed(s), "the store kept a connection that announced a 4 GiB frame"
        s = _authed(port, secret)
        s.sendall(struct.pack(">IB", 5, 0x42) + b"junk")
        assert _drain_closed(s), "the store kept a connection that sent an unknown message type"
        s = _authed(port, secret)
        s.sendall(struct.pack(">I", 64 << 20) + b"\x01partial")  # legal size, body never completed
        held.append(s)
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(idle)
        (go / "run").touch()
        results, text, outs = finish(procs, 60)
    finally:
        for s in held:
            s.close()
        kill_all(procs)
    if os.environ.get("SHOW_GARBAGE_LOG"):
        print(text)
    for rc, _, _ in outs:
        assert rc == 0, text
    for res in results:
        assert res.get("type") == "OK", text
    # each refusal was logged with its reason, by the rank that refused it
    assert "store server: refused" in text and "client did not prove the job secret" in text, text
    assert "store frame header announces 4294967295 bytes; the limit is 67108864" in text, text
    assert "unknown store message type 0x42" in text, text
    assert "rank 2: dropped an incoming connection" in text, text
    assert "connection claims to be rank 77 of 999 dialing rank 2" in text, text
