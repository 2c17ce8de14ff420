"""The CPU of one bound phase between hosts, against the bare system calls (pass 17).

Three tcp transports in one process (``tests/unit/test_transport_conformance._form``, loopback).  Each iteration,
ranks 1 and 2 send rank 0 a message of N bytes first; then rank 0 runs one phase (``Comm.phases``: send N bytes to
each of them and receive theirs, which are already in its sockets) and gives the connections back, and is timed;
ranks 1 and 2 then drain rank 0's messages.  ``FLOOR=1`` times the least that phase can be instead: a blocking
``sendmsg`` of header and payload to each and one ``read_frames`` of both, the roles taken once.  Prints the mean
wall time and the thread's CPU per phase.  Run from the checkout: ``python benchmarks/results/pass17/phase_micro.py``
(``N=1000`` for small messages).
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))

from procgroup.algorithms.comm import Comm  # noqa: E402
from procgroup.deadline import Deadline  # noqa: E402
from procgroup.protocol.frames import HEADER, MAGIC, VERSION  # noqa: E402
from procgroup.transport import _tcp_read  # noqa: E402
from tests.unit.test_transport_conformance import _form  # noqa: E402

N, IT, FLOOR = int(os.environ.get("N", 87382)), int(os.environ.get("IT", 2000)), bool(os.environ.get("FLOOR"))
ts = _form("tcp", 3, f"micro{time.monotonic_ns()}")
try:
    comms = [Comm(ts[r], [0, 1, 2], r, 1 << 20, Deadline.after(600)) for r in range(3)]
    ph = comms[0].phases([1, 2], [1, 2])
    assert ph is not None, "no bound phases (the compiled _tcpwait not built?)"
    t0_conns = [ts[0]._conns[1], ts[0]._conns[2]]
    if FLOOR:
        for c in t0_conns:
            assert ts[0]._take(c)
    sb = [np.ones(N, np.uint8), np.ones(N, np.uint8)]
    rb = [np.zeros(N, np.uint8), np.zeros(N, np.uint8)]
    drain = {r: np.zeros(N, np.uint8) for r in (1, 2)}
    wall = cpu = 0.0
    timed = 0
    for k in range(IT):
        tag0 = ((1 << 20) + k) << 16
        for c in comms:
            c.tag = tag0
        for r in (1, 2):
            ts[r].isend(0, tag0 | 5, sb[0]).wait(Deadline.after(5))
        time.sleep(0.0002)
        t0, c0 = time.perf_counter(), time.thread_time()
        if FLOOR:
            for c, v in zip(t0_conns, sb):
                c.sock.sendmsg((HEADER.pack(MAGIC, VERSION, 0, 0, tag0 | 5, v.nbytes), v))
            prog = np.zeros(10, np.int64)
            fds, read = tuple(c.fd for c in t0_conns), _tcp_read.read_frames()
            code = read(fds, (tag0 | 5,) * 2, tuple(rb), bytearray(48), prog, 0, 10**9, ts[0]._wake_r)
            pend = [] if code == 0 else None
        else:
            try:
                pend = ph.run(5, sb, rb)
            finally:
                ph.end()
        t1, c1 = time.perf_counter(), time.thread_time()
        if pend is None:  # not claimed (the watcher read a message first): the usual path, not timed
            for j, r in enumerate((1, 2)):
                ts[0].irecv(r, tag0 | 5, rb[j]).wait(Deadline.after(5))
                ts[0].isend(r, tag0 | 5, sb[j]).wait(Deadline.after(5))
        else:
            assert not pend
            wall, cpu, timed = wall + t1 - t0, cpu + c1 - c0, timed + 1
        for r in (1, 2):
            ts[r].irecv(0, tag0 | 5, drain[r]).wait(Deadline.after(5))
    what = "floor" if FLOOR else "phase"
    print(f"{what} N={N}: {wall / timed * 1e6:.1f} us wall, {cpu / timed * 1e6:.1f} us CPU ({IT - timed} not claimed)")
    if FLOOR:
        for c in t0_conns:
            ts[0]._give(c)
finally:
    for t in ts:
        t.close()
