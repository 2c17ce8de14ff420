"""Issue 11 items 7, 15 and 17 with real processes: object collectives whose object cannot be pickled,
point-to-point with mismatched dtypes, and the safe mode of object collectives."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from procgroup.netutil import free_port

from .harness import Result, collect, worker_env

pytestmark = pytest.mark.timeout(90)


def _run_ranks(
    tmp_path: Path, body: str, n: int, extra: Optional[Dict[str, str]] = None, timeout: float = 60
) -> List[Result]:
    """Start ``n`` ranks of ``body`` (env:// contract, PROCGROUP_TIMEOUT=10); wait, killing all on timeout."""
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(body))
    port = free_port()
    env = {"PROCGROUP_TIMEOUT": "10", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **(extra or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, str(path)],
            env=worker_env(r, n, port, "ab" * 16, env),
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(n)
    ]
    return collect(procs, timeout)


def _records(results: List[Result]) -> List[List[dict]]:
    """Each rank's JSON lines (one per case); the whole output in the assertion when a rank failed."""
    report = "\n".join(f"--- rank {i} rc={r.returncode}\n{r.stdout}\n{r.stderr}" for i, r in enumerate(results))
    assert all(r.returncode == 0 for r in results), report
    return [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")] for r in results]


# -- item 7: an object that cannot be pickled --------------------------------------------------------------
PICKLING = """
import json, threading, time
import numpy as np
import procgroup as dist

dist.init_process_group("cpu")
r, n = dist.get_rank(), dist.get_world_size()
BAD = threading.Lock()

def case(name, fn):
    t0 = time.monotonic()
    te = False
    try:
        fn()
        err, msg = None, ""
    except Exception as e:
        err, msg, te = type(e).__name__, str(e), isinstance(e, TypeError)
    dt = time.monotonic() - t0
    x = np.ones(2, np.int64)
    dist.all_reduce(x)  # the group must still be in step
    print(json.dumps({"case": name, "err": err, "msg": msg, "s": dt, "sum": x.tolist(),
                      "typeerror": te}), flush=True)

def agather():
    out = [None] * n
    dist.all_gather_object(out, BAD if r == 1 else r)

def gather():
    out = [None] * n if r == 0 else None
    dist.gather_object(BAD if r == 1 else r, out, dst=0)

def bcast():
    lst = [BAD] if r == 1 else [None]
    dist.broadcast_object_list(lst, src=1)

def scatter():
    out = [None]
    dist.scatter_object_list(out, [0, BAD, 2][:n] if r == 0 else None, src=0)

def p2p():
    if r == 0:
        dist.send_object_list([BAD], dst=1)
    elif r == 1:
        dist.recv_object_list([None], src=0)
    else:
        raise dist.ObjectPicklingError("not involved", ranks=[0])

for name, fn in [("all_gather_object", agather), ("gather_object", gather), ("broadcast_object_list", bcast),
                 ("scatter_object_list", scatter), ("send_object_list", p2p)]:
    case(name, fn)
dist.destroy_process_group()
"""


def test_unpicklable_object_raises_on_every_member_and_group_stays_in_step(tmp_path: Path) -> None:
    n = 3
    recs = _records(_run_ranks(tmp_path, PICKLING, n))
    for rank, rs in enumerate(recs):
        assert [x["case"] for x in rs] == [
            "all_gather_object",
            "gather_object",
            "broadcast_object_list",
            "scatter_object_list",
            "send_object_list",
        ]
        for x in rs:
            where = f"rank {rank} {x['case']}: {x}"
            assert x["err"] == "ObjectPicklingError", where
            assert x["typeerror"], where
            assert x["sum"] == [n, n], where  # the next all_reduce is right: the group is in step
            assert x["s"] < 5.0, where  # at once, not at the 10 s deadline
            if x["msg"] != "not involved":
                assert "could not pickle" in x["msg"] and "_thread.lock" in x["msg"], where
                assert "rank 1" in x["msg"] or x["case"] in ("scatter_object_list", "send_object_list"), where
        coll = {x["case"]: x["msg"] for x in rs}
        assert "(seq " in coll["all_gather_object"] and "all_gather_object" in coll["all_gather_object"]


# -- item 17: safe mode ------------------------------------------------------------------------------------
SAFE = """
import json, os, sys, time
import numpy as np
import procgroup as dist

MARK = sys.argv[1] if len(sys.argv) > 1 else os.environ["MARK"]

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARK}.{dist.get_rank()}",))

dist.init_process_group("cpu")
r, n = dist.get_rank(), dist.get_world_size()

def case(name, fn):
    t0 = time.monotonic()
    err, msg, res = None, "", None
    try:
        res = fn()
    except Exception as e:
        err, msg = type(e).__name__, str(e)
    dt = time.monotonic() - t0
    x = np.ones(2, np.int64)
    dist.all_reduce(x)
    print(json.dumps({"case": name, "err": err, "msg": msg, "s": dt, "sum": x.tolist(), "res": res}), flush=True)

def env_mode():  # PROCGROUP_SAFE_OBJECTS=1: the attacker's object is refused everywhere
    out = [None] * n
    dist.all_gather_object(out, Evil() if r == 1 else np.arange(3, dtype=np.float32))

def arrays_pass():  # numpy arrays and builtins go through safe mode
    out = [None] * n
    dist.all_gather_object(out, {"rank": r, "a": np.full(2, r, np.float64)})
    return [[o["rank"], o["a"].tolist()] for o in out]

def per_call():  # safe=True on one call, the environment turned off with safe=False elsewhere
    if r == 1:
        dist.send_object_list([Evil()], dst=0)
    elif r == 0:
        dist.recv_object_list([None], src=1, safe=True)

for name in os.environ["CASES"].split(","):
    case(name, globals()[name])
dist.destroy_process_group()
"""


def test_safe_mode_refuses_code_and_admits_arrays(tmp_path: Path) -> None:
    mark = tmp_path / "pwned"
    env = {"PROCGROUP_SAFE_OBJECTS": "1", "MARK": str(mark), "CASES": "env_mode,arrays_pass,per_call"}
    recs = _records(_run_ranks(tmp_path, SAFE, 2, env))
    assert not list(tmp_path.glob("pwned*")), "the attacker's command ran"
    for rank, rs in enumerate(recs):
        by = {x["case"]: x for x in rs}
        env_mode = by["env_mode"]
        assert env_mode["err"] == "UnsafeObjectError", env_mode
        assert "system" in env_mode["msg"] and "from rank 1" in env_mode["msg"] and "(seq " in env_mode["msg"]
        assert env_mode["s"] < 5.0 and env_mode["sum"] == [2, 2], env_mode  # at once; the group stays in step
        assert by["arrays_pass"]["err"] is None and by["arrays_pass"]["res"] == [[0, [0.0, 0.0]], [1, [1.0, 1.0]]]
        assert by["per_call"]["err"] == ("UnsafeObjectError" if rank == 0 else None), by["per_call"]


def test_safe_mode_per_call_without_the_environment(tmp_path: Path) -> None:
    mark = tmp_path / "pwned"
    recs = _records(_run_ranks(tmp_path, SAFE, 2, {"MARK": str(mark), "CASES": "per_call,arrays_pass"}))
    assert not list(tmp_path.glob("pwned*")), "the attacker's command ran"
    x = recs[0][0]
    assert x["err"] == "UnsafeObjectError", x
    assert "recv_object_list on rank 0" in x["msg"] and "from rank 1" in x["msg"] and "system" in x["msg"], x
    assert all(r[1]["err"] is None and r[1]["sum"] == [2, 2] for r in recs), recs


# -- item 15: point-to-point between tensors of different dtypes -------------------------------------------
DTYPE_P2P = """
import json, time
import numpy as np
import procgroup as dist

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
PAIRS = [(a, b) for a in DTYPES for b in DTYPES]

dist.init_process_group("cpu")
r = dist.get_rank()
if r == 0:
    keep = [np.ones(4, a) for a, _ in PAIRS]
    works = [dist.isend(x, dst=1, tag=i) for i, x in enumerate(keep)]
    for w in works:
        w.wait()
elif r == 1:
    for i, (a, b) in enumerate(PAIRS):
        out = np.zeros(4, b)
        t0 = time.monotonic()
        try:
            dist.recv(out, src=0, tag=i)
            err, msg = None, ""
        except Exception as e:
            err, msg = type(e).__name__, str(e)
        named = f"as {a}" in msg and f"({b})" in msg and "rank 0" in msg and f"tag {i}" in msg
        print(json.dumps({"send": a, "recv": b, "err": err, "named": named, "s": round(time.monotonic() - t0, 5),
                          "ones": bool((out == 1).all()), "msg": msg if i == 1 else ""}), flush=True)
x = np.ones(2, np.int64)
dist.all_reduce(x)
print(json.dumps({"sum": x.tolist()}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_p2p_dtype_mismatch_is_an_error_on_the_receiver(tmp_path: Path, transport: str) -> None:
    recs = _records(_run_ranks(tmp_path, DTYPE_P2P, 2, {"PROCGROUP_TRANSPORT": transport}))
    assert recs[0][-1]["sum"] == [2, 2] and recs[1][-1]["sum"] == [2, 2]
    rows = recs[1][:-1]
    assert len(rows) == 14 * 14
    for x in rows:
        if x["send"] == x["recv"]:
            assert x["err"] is None and x["ones"], x
        else:
            assert x["err"] == "ConfigError" and x["named"], x  # names both dtypes, the sender and the tag
            assert x["s"] < 2.0, x  # a few milliseconds, not the 10 s deadline
    assert "recv" in rows[1]["msg"] and "dtype mismatch" in rows[1]["msg"], rows[1]
