"""The shm and tcp transports between real processes.

Every rank is a fresh ``python -c WORKER`` process that forms the transport
through a file store in a temporary directory, runs one scenario and prints
``RESULT <json>``.  Every test kills and reaps whatever it started and checks
that /dev/shm holds no segment of its job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from procgroup.transport.shm import SHM_DIR, segment_prefix

SRC = str(Path(__file__).resolve().parents[2] / "src")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes, /dev/shm and futexes")

WORKER = textwrap.dedent(
    r'''
    import fcntl, json, os, sys, time, urllib.parse
    import numpy as np
    from procgroup.deadline import Deadline
    from procgroup.errors import StoreTimeoutError
    from procgroup.transport import ANY_SOURCE, connect_transport

    class FileStore:
        """Store of the duck-typed procgroup API over files in a directory (polling; tests only)."""
        def __init__(self, d):
            self.d = d
        def _p(self, k):
            return os.path.join(self.d, urllib.parse.quote(k, safe=""))
        def set(self, k, v):
            tmp = self._p(k) + ".tmp%d" % os.getpid()
            with open(tmp, "wb") as f:
                f.write(bytes(v))
            os.replace(tmp, self._p(k))
        def _poll(self, keys, timeout):
            end = None if timeout is None else time.monotonic() + timeout
            delay = 0.001
            while not all(os.path.exists(self._p(k)) for k in keys):
                if end is not None and time.monotonic() >= end:
                    raise StoreTimeoutError("keys %r not set after %ss" % (keys, timeout))
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        def get(self, k, timeout=None):
            self._poll([k], timeout)
            with open(self._p(k), "rb") as f:
                return f.read()
        def wait(self, keys, timeout=None):
            self._poll(list(keys), timeout)
        def check(self, keys):
            return all(os.path.exists(self._p(k)) for k in keys)
        def add(self, k, n):
            with open(os.path.join(self.d, ".lock"), "a+b") as lk:
                fcntl.flock(lk, fcntl.LOCK_EX)
                v = 0
                if os.path.exists(self._p(k)):
                    with open(self._p(k), "rb") as f:
                        v = int(f.read())
                self.set(k, str(v + n).encode())
                return v + n

    cfg = json.loads(sys.argv[1])
    rank, ws, role = cfg["rank"], cfg["ws"], cfg["role"]
    store = FileStore(cfg["store"])
    t = connect_transport(store, rank, ws, secret=b"integration-secret", host_keys=cfg["host_keys"],
                          advertise_addr="127.0.0.1", job_id=cfg["job"], deadline=Deadline.after(60), mode=cfg["mode"])
    def dl(s=60):
        return Deadline.after(s)
    def result(**kw):
        print("RESULT " + json.dumps(kw), flush=True)
    def barrier():
        # everyone reports to rank 0, which answers everyone: afterwards all earlier messages were received
        if rank == 0:
            for _ in range(ws - 1):
                t.recv(ANY_SOURCE, 999, bytearray(1), dl())
            for p in range(1, ws):
                t.send(p, 999, b"b", dl())
        else:
            t.send(0, 999, b"b", dl())
            t.recv(0, 999, bytearray(1), dl())

    if role == "exchange":
        size = cfg["size"]
        def pat(src, dst):
            return ((np.arange(size + src, dtype=np.int64) * (src + 3) + dst) % 251).astype(np.uint8)
        outs = {p: np.zeros(size + p, dtype=np.uint8) for p in range(ws) if p != rank}
        rreqs = {p: t.irecv(p, 1, outs[p]) for p in outs}
        sreqs = [t.isend(p, 1, pat(rank, p)) for p in outs]
        for s in sreqs:
            s.wait(dl())
        ok = True
        for p, r in rreqs.items():
            st = r.wait(dl())
            ok = ok and st.source == p and st.nbytes == size + p and bool(np.array_equal(outs[p], pat(p, rank)))
        # ANY_SOURCE: everyone sends its rank to rank 0
        if rank == 0:
            srcs = []
            for _ in range(ws - 1):
                o = bytearray(4)
                st = t.recv(ANY_SOURCE, 2, o, dl())
                ok = ok and int.from_bytes(o, "little") == st.source
                srcs.append(st.source)
            ok = ok and sorted(srcs) == list(range(1, ws))
        else:
            t.send(0, 2, rank.to_bytes(4, "little"), dl())
        barrier()
        result(ok=ok, kind=t.kind)
    elif role == "victim":
        print("READY", flush=True)
        time.sleep(600)
    elif role == "waiter":
        req = t.irecv(cfg["victim"], 5, bytearray(8))
        print("READY", flush=True)
        t0 = time.monotonic()
        try:
            req.wait(dl(60))
            result(error=None)
        except Exception as e:
            result(error=type(e).__name__, peer=getattr(e, "peer", None), msg=str(e), after=time.monotonic() - t0)
    elif role == "cpu":
        barrier()
        if rank == 0:
            out = bytearray(4)
            c0, w0 = time.process_time(), time.monotonic()
            t.recv(1, 3, out, dl())
            result(cpu=time.process_time() - c0, wall=time.monotonic() - w0, data=bytes(out).decode())
        else:
            time.sleep(cfg["delay"])
            t.send(0, 3, b"late", dl())
            result(ok=True)
        barrier()
    t.close()
    '''
)


def _segments(job: str) -> List[str]:
    pre = segment_prefix(job)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(pre)] if os.path.isdir(SHM_DIR) else []


class Gang:
    """Worker processes of one test; always killed and reaped at the end."""

    def __init__(self, tmp: Path, ws: int, mode: str, host_keys: Optional[List[str]] = None) -> None:
        self.job = f"it-{uuid.uuid4().hex[:10]}"
        self.ws = ws
        self.mode = mode
        self.host_keys = host_keys or ["h"] * ws
        self.store = tmp / "store"
        self.store.mkdir()
        self.procs: Dict[int, subprocess.Popen] = {}

    def start(self, rank: int, role: str, **extra: Any) -> subprocess.Popen:
        cfg = {
            "rank": rank,
            "ws": self.ws,
            "role": role,
            "store": str(self.store),
            "job": self.job,
            "mode": self.mode,
            "host_keys": self.host_keys,
            **extra,
        }
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.procs[rank] = p
        return p

    def finish(self, rank: int, timeout: float = 60) -> Dict[str, Any]:
        p = self.procs[rank]
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"rank {rank} hung; stderr:\n{err[-3000:]}") from None
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}; stderr:\n{err[-3000:]}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"rank {rank} printed no result; stdout:\n{out}\nstderr:\n{err[-3000:]}"
        return json.loads(lines[-1][len("RESULT ") :])

    def wait_line(self, rank: int, text: str, timeout: float = 60) -> None:
        p = self.procs[rank]
        end = time.monotonic() + timeout
        assert p.stdout is not None
        while time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                raise AssertionError(
                    f"rank {rank} exited before {text!r}: {p.wait()} {p.stderr.read()[-3000:] if p.stderr else ''}"
                )
            if line.strip() == text:
                return
        raise AssertionError(f"rank {rank} did not print {text!r}")

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


@pytest.fixture
def gangs(tmp_path: Path) -> Any:
    made: List[Gang] = []

    def make(ws: int, mode: str, host_keys: Optional[List[str]] = None) -> Gang:
        d = tmp_path / f"g{len(made)}"
        d.mkdir()
        g = Gang(d, ws, mode, host_keys)
        made.append(g)
        return g

    yield make
    for g in made:
        g.cleanup()
    for g in made:
        assert _segments(g.job) == [], f"shared memory segments of {g.job} leaked"


@pytest.mark.parametrize("ws", [2, 5, 8])
@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_exchange(gangs: Any, mode: str, ws: int) -> None:
    g = gangs(ws, mode)
    for r in range(ws):
        g.start(r, "exchange", size=300_000 if ws <= 5 else 50_000)
    res = [g.finish(r, timeout=120) for r in range(ws)]
    assert all(x["ok"] for x in res), res
    assert {x["kind"] for x in res} == {mode}


def test_exchange_router_two_fake_hosts(gangs: Any) -> None:
    """Two "hosts" of two ranks: shm inside each, tcp across, ANY_SOURCE spanning both."""
    g = gangs(4, "auto", ["hostA", "hostA", "hostB", "hostB"])
    for r in range(4):
        g.start(r, "exchange", size=5 << 20)  # bigger than a ring: streams through shm
    res = [g.finish(r, timeout=120) for r in range(4)]
    assert all(x["ok"] for x in res), res
    assert {x["kind"] for x in res} == {"router"}


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_sigkilled_peer_is_named(gangs: Any, mode: str) -> None:
    g = gangs(3, mode)
    g.start(2, "victim")
    for r in (0, 1):
        g.start(r, "waiter", victim=2)
    for r in (2, 0, 1):
        g.wait_line(r, "READY")
    assert _segments(g.job) == [], "segments must be unlinked once the group has formed"
    time.sleep(0.3)  # let the waiters block in the kernel
    victim = g.procs[2]
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for r in (0, 1):
        res = g.finish(r, timeout=30)
        took = time.monotonic() - killed
        assert res["error"] == "PeerFailureError", res
        assert res["peer"] == 2, res
        assert "rank 2" in res["msg"], res
        assert took < 5.0, f"rank {r} noticed the death after {took:.2f}s"
    if mode == "shm":
        assert f"pid {victim.pid}" in res["msg"]


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_blocked_recv_uses_little_cpu(gangs: Any, mode: str) -> None:
    g = gangs(2, mode)
    g.start(0, "cpu")
    g.start(1, "cpu", delay=2.0)
    r0 = g.finish(0)
    assert g.finish(1)["ok"]
    assert r0["data"] == "late" and r0["wall"] >= 1.8
    assert r0["cpu"] < 0.2, f"a rank blocked {r0['wall']:.2f}s in recv used {r0['cpu']:.3f}s of CPU"
