#!/usr/bin/env python
"""Multi-host all_reduce: procgroup vs Open MPI over TCP, 3 network-namespace hosts x 2 ranks.

    sudo python benchmarks/multihost.py                         # 64 MiB, 10 iterations, 3 rounds
    sudo python benchmarks/multihost.py --sizes 1M,16M,64M --repeat 5
    sudo python benchmarks/multihost.py --mpi-configs default   # stock Open MPI settings only

The target (from the performance issue): "across 3 network-namespace hosts x 2 ranks, 64 MiB
all_reduce at least as fast as Open MPI over TCP on the same hosts".

What it does, as root:

1. hosts: ``infra/netns_up.sh`` makes the hosts (default ``pgb1..pgb3``, 10.78.0.K, a private
   prefix so the test suite's h1..h3 are never touched; ``--prefix h`` uses the shared ones under
   the test fixtures' lock).  Hosts that are already up are reused and left up.  Each host is a
   network + UTS namespace whose own name resolves to 127.0.1.1; filesystem, /dev/shm and the pid
   namespace are shared with the machine.
2. rounds (``--repeat``): in each round every system runs once, in alternating order (round 0:
   procgroup first, round 1: MPI first, ...), so that both see the same background load;
   /proc/loadavg and the CPU share other users took are recorded with every run.

   * procgroup: one ``procgroup run --nnodes 3 --node-rank K --master-addr <host1>
     --nproc-per-node 2`` per host, each started in that host with ``infra/hostexec.sh`` (per-node
     mode, the configuration tests/infra/test_launcher_multinode.py runs).  Ranks on one host use
     procgroup's shm transport, ranks on different hosts its TCP transport (the host key includes
     the network namespace); the worker records each rank's per-peer transports and the
     all_reduce algorithm procgroup selects.
   * Open MPI: ``mpirun -H host1:2,host2:2,host3:2 --mca plm_rsh_agent infra/rsh_hostexec.sh``
     from host1, mpi4py's buffer ``Allreduce(IN_PLACE, SUM)``, with ``--mca pml ob1 --mca btl
     tcp,vader,self --mca btl_tcp_if_include eth0``: between hosts only the tcp btl can reach a
     peer; within a host Open MPI's default shared-memory btl (vader) is used.  ``--mpi-configs``
     picks one or more variants (see MPI_CONFIGS), each timed in every round.

   Both use the cases of procgroup's own benchmark (src/procgroup/bench/cases.py): float32,
   every rank's result compared with the closed form before timing, per-iteration time = the
   slowest rank's, median/p90 over iterations, algbw = bytes/time, busbw = algbw * 2(n-1)/n.
3. report: per round and size the medians and ratios procgroup/MPI, then the median over rounds;
   JSON + markdown under ``--out-dir`` (default benchmarks/results/multihost/).
4. teardown, also on failure, Ctrl-C, SIGTERM (and, through a watchdog process, if this process
   is killed): every process started in the hosts, the /dev/shm segments of the runs, and the
   hosts if this run made them.

Experiments (for whoever tunes procgroup): ``--pg-stage-times`` splits procgroup's all_reduce
time into its stages; ``--pg-variant NAME=all_reduce=ALG`` times procgroup with an algorithm pinned
(select.FORCE; prototypes in benchmarks/multihost_prototypes.py) beside the default in every
round; ``--op sendrecv --hosts 2 --per-host 1`` measures one TCP hop.  ``--render JSON`` re-renders a
report.  Every run also records each system's CPU time per call (all ranks, user + sys).

The same file is the worker (``--worker procgroup|mpi``, started by the launchers).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
INFRA = REPO / "infra"
DEFAULT_OUT = HERE / "results" / "multihost"
sys.path.insert(0, str(SRC))  # run from a checkout without installing: the checkout's procgroup

SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

#: Open MPI variants.  Every one adds BASE_MCA (inter-host traffic over the tcp btl only).
BASE_MCA = [("pml", "ob1"), ("btl", "tcp,vader,self"), ("btl_tcp_if_include", "eth0"),
            ("oob_tcp_if_include", "eth0")]
MPI_CONFIGS: Dict[str, dict] = {
    "default": {"mca": [], "about": "stock Open MPI settings (tuned's decision rules; ranks bound to cores, "
                                    "busy-polling)"},
    "yield": {"mca": [("mpi_yield_when_idle", "1")],
              "about": "+ mpi_yield_when_idle=1: what Open MPI does by itself when it knows a node is "
                       "oversubscribed (here 6 ranks share 2 CPUs, which mpirun cannot see)"},
    "ring": {"mca": [("mpi_yield_when_idle", "1"), ("coll_tuned_use_dynamic_rules", "1"),
                     ("coll_tuned_allreduce_algorithm", "4")],
             "about": "+ yield + tuned allreduce algorithm 4 (ring): the fastest Open MPI variant found "
                      "for 64 MiB on these hosts"},
}
DEFAULT_MPI_CONFIGS = "default,yield,ring"

EPILOG = """\
Open MPI variants (--mpi-configs, comma-separated; all with --mca pml ob1 --mca btl tcp,vader,self
--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0):
""" + "\n".join(f"  {k:<8} {v['about']}" for k, v in MPI_CONFIGS.items()) + """

Needs root (network namespaces), ip/nsenter/unshare, Open MPI's mpirun and mpi4py built against it
(without those, --mpi-configs none measures procgroup alone).  About 35 s per round at 64 MiB with
the three MPI variants on the 2-CPU dev VM.
"""


# ===================================================================================== worker


def _worker(ns: argparse.Namespace) -> int:
    """One rank of one system: run the all_reduce cases; rank 0 appends JSON lines to ns.out."""
    import resource

    import numpy as np

    from procgroup.bench._common import versions
    from procgroup.bench.cases import Case, layout, run_cases

    sizes = [int(s) for s in ns.sizes.split(",")]
    info: dict = {}
    stages: Optional[_StageTimes] = None
    if ns.worker == "procgroup":
        import procgroup as dist
        from procgroup.bench.cases import TorchStyleAdapter

        dist.init_process_group(timeout=ns.timeout)
        a = TorchStyleAdapter("procgroup", dist)
        if ns.pg_force:
            from procgroup.algorithms import select

            sys.path.insert(0, str(HERE))
            import multihost_prototypes  # prototypes a FORCE may name (benchmarks/multihost_prototypes.py)

            multihost_prototypes.register()
            select.FORCE.update(kv.split("=", 1) for kv in ns.pg_force.split(","))
        info = _procgroup_info(dist, a, sizes if ns.op == "all_reduce" else [])
        if ns.pg_stage_times:
            stages = _StageTimes()
        finish = dist.destroy_process_group
    else:
        import mpi4py
        from mpi4py import MPI

        from procgroup.bench.mpi_worker import MPIAdapter

        a = MPIAdapter(MPI)
        names = MPI.COMM_WORLD.gather(MPI.Get_processor_name(), root=0)
        info = {"mpi4py": mpi4py.__version__,
                "mpi_library": MPI.Get_library_version().strip().splitlines()[0].rstrip("\x00"),
                "rank_hosts": names}
        finish = None
    try:
        cases = [Case(ns.op, s, layout(ns.op, s, a.size), ns.warmup, ns.iters, False) for s in sizes]
        f = open(ns.out, "a", encoding="utf-8") if a.rank == 0 else None
        try:
            if f is not None:
                f.write(json.dumps({"kind": "header", "system": a.name, "world_size": a.size, "pid": os.getpid(),
                                    **versions(), **info}) + "\n")
                f.flush()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            for rec in run_cases(a, cases):
                rec.update(kind="case", system=a.name)
                assert f is not None
                f.write(json.dumps(rec) + "\n")
                f.flush()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            # CPU time of every rank (all threads) over the cases: less sensitive to other users' load than wall time
            calls = sum(1 + c.warmup + c.iters for c in cases)
            m = a.gather_rows(np.array([ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime, calls], np.float64))
            if f is not None and m is not None:
                f.write(json.dumps({"kind": "cpu", "calls_per_rank": int(calls),
                                    "user_s_by_rank": [round(x, 4) for x in m[:, 0]],
                                    "sys_s_by_rank": [round(x, 4) for x in m[:, 1]],
                                    "cpu_ms_per_call_all_ranks": round(1e3 * float(m[:, :2].sum()) / calls, 3)}) + "\n")
            if stages is not None:
                m = a.gather_rows(stages.row())
                if f is not None:
                    f.write(json.dumps({"kind": "stages", **stages.report(m)}) + "\n")
            if f is not None:
                f.write(json.dumps({"kind": "end", "system": a.name}) + "\n")
        finally:
            if f is not None:
                f.close()
    except BaseException:
        if ns.worker == "mpi":
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)  # do not leave the peers hanging in a collective
        raise
    finally:
        if finish is not None:
            finish()
    return 0


class _StageTimes:
    """--pg-stage-times: wrap procgroup's ``select.choose_*`` so that every algorithm they return is timed.

    allreduce_hierarchical asks choose_reduce / choose_all_reduce_flat / choose_broadcast for its
    three stages, so this splits its time into intra-host reduce, inter-host all_reduce (leaders
    only) and intra-host broadcast.  Times include the check, warm-up and timed calls of all sizes.
    """

    NAMES = ("choose_all_reduce", "choose_reduce", "choose_all_reduce_flat", "choose_broadcast")

    def __init__(self) -> None:
        import time as _t

        from procgroup.algorithms import select
        from procgroup.algorithms.reduction import reduce_binomial

        self.acc = {k: [0.0, 0] for k in self.NAMES}
        self.inside = False  # within a timed all_reduce: only its stages are timed
        self.algo: Dict[str, str] = {}
        for k in self.NAMES:
            orig = getattr(select, k)

            def chooser(*args, _orig=orig, _k=k, **kw):  # type: ignore[no-untyped-def]
                f = _orig(*args, **kw)
                self.algo[_k] = getattr(f, "__name__", str(f))
                if f is reduce_binomial:  # allreduce_hierarchical tests `f is reduce_binomial`: keep it intact
                    return f

                top = _k == "choose_all_reduce"
                if not top and not self.inside:
                    return f  # e.g. the harness's own broadcasts: not a stage of an all_reduce

                def timed(*a2, **kw2):  # type: ignore[no-untyped-def]
                    t0 = _t.perf_counter()
                    if top:
                        self.inside = True
                    try:
                        return f(*a2, **kw2)
                    finally:
                        if top:
                            self.inside = False
                        acc = self.acc[_k]
                        acc[0] += _t.perf_counter() - t0
                        acc[1] += 1
                timed.__name__ = getattr(f, "__name__", "timed")
                return timed
            setattr(select, k, chooser)

    def row(self):  # type: ignore[no-untyped-def]
        import numpy as np

        return np.array([v for k in self.NAMES for v in self.acc[k]], dtype=np.float64)

    def report(self, m) -> dict:  # type: ignore[no-untyped-def]
        if m is None:
            return {}
        out = {}
        for i, k in enumerate(self.NAMES):
            out[k] = {"algorithm_rank0": self.algo.get(k),
                      "mean_ms_per_call_by_rank": [round(1e3 * m[r, 2 * i] / m[r, 2 * i + 1], 3) if m[r, 2 * i + 1]
                                                   else None for r in range(m.shape[0])],
                      "calls_by_rank": [int(m[r, 2 * i + 1]) for r in range(m.shape[0])]}
        return {"stage_times": out}


def _procgroup_info(dist, a, sizes: Sequence[int]) -> dict:  # type: ignore[no-untyped-def]
    """Where every rank is, which transport reaches each of its peers, which algorithm runs (best effort)."""
    import numpy as np

    info: dict = {"procgroup": dist.__version__, "transport_mode": os.environ.get("PROCGROUP_TRANSPORT", "auto")}
    kinds = {"shm": 0, "tcp": 1, "router": 2}
    row = np.zeros(a.size, dtype=np.float64) - 1  # per peer: 0 shm, 1 tcp, 3 other; -1 self/unknown
    try:
        world = dist.group.WORLD.world
        t = world.transport
        per_peer = getattr(t, "_per_peer", None)
        for peer in range(a.size):
            if peer == a.rank:
                continue
            sub = per_peer.get(peer) if per_peer is not None else t
            row[peer] = kinds.get(getattr(sub, "kind", ""), 3)
        info["rank_hosts"] = list(world.hostnames)
        info["transport"] = getattr(t, "kind", type(t).__name__)
    except Exception as e:  # noqa: BLE001 - informational only
        info["transport_error"] = f"{type(e).__name__}: {e}"
    m = a.gather_rows(row)
    if m is not None:
        names = {0: "shm", 1: "tcp", 3: "other"}
        info["peer_transports"] = [{names[int(v)]: [p for p in range(a.size) if m[r, p] == v]
                                    for v in sorted(set(m[r].tolist()) - {-1.0})} for r in range(a.size)]
    try:
        if sizes:
            info["algorithm"] = _probe_algorithm(dist, sizes)
    except Exception as e:  # noqa: BLE001 - informational only
        info["algorithm_error"] = f"{type(e).__name__}: {e}"
    return info


def _probe_algorithm(dist, sizes: Sequence[int]) -> dict:  # type: ignore[no-untyped-def]
    """Which algorithms procgroup's selection picks: one untimed all_reduce per size with every
    ``select.choose_*`` wrapped to note its answer (the hierarchical algorithm asks again for its
    stages), then the originals restored before anything is timed."""
    import numpy as np

    from procgroup.algorithms import select

    orig = {k: getattr(select, k) for k in dir(select) if k.startswith("choose_") and callable(getattr(select, k))}
    calls: List[str] = []

    def wrap(name, f):  # type: ignore[no-untyped-def]
        def chooser(*args, **kw):  # type: ignore[no-untyped-def]
            r = f(*args, **kw)
            calls.append(f"{name}({', '.join(str(x) for x in args[1:] if isinstance(x, int))}) -> "
                         f"{getattr(r, '__name__', r)}")
            return r
        return chooser

    out = {}
    try:
        for k, f in orig.items():
            setattr(select, k, wrap(k, f))
        for s in sizes:
            calls.clear()
            dist.all_reduce(np.ones(max(1, s // 4), dtype=np.float32))
            out[str(s)] = list(calls)
    finally:
        for k, f in orig.items():
            setattr(select, k, f)
    if getattr(select, "FORCE", None):
        out["FORCE"] = dict(select.FORCE)
    return out


# ===================================================================================== /proc helpers


def _stat(pid: int) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].decode().split()


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def netns_inodes(names: Sequence[str]) -> set:
    out = set()
    for n in names:
        try:
            out.add(os.stat(f"/run/netns/{n}").st_ino)
        except OSError:
            pass
    return out


def pids_in_netns(inodes: set) -> set:
    out: set = set()
    if not inodes:
        return out
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}/ns/net").st_ino in inodes:
                    out.add(int(d))
            except OSError:
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def stop_pids(pids: Sequence[int], grace: float = 5.0) -> List[str]:
    """SIGTERM, up to ``grace`` s, SIGKILL; returns descriptions of those that needed killing or stayed."""
    pids = [p for p in pids if alive(p)]
    if not pids:
        return []
    desc = {p: cmdline(p)[:160] for p in pids}
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except OSError:
            pass
    end = time.monotonic() + grace
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 5
    while time.monotonic() < end and any(alive(p) for p in left):
        time.sleep(0.1)
    return [f"pid {p}: {desc[p]}" for p in pids]


def _cpu_ticks(pid: int) -> Optional[int]:
    st = _stat(pid)
    return None if st is None else int(st[11]) + int(st[12])  # utime + stime (clock ticks)


class OthersMeter:
    """The share of the machine's CPU that other users took while one run ran.

    procgroup.bench's BackgroundMeter counts this process's waited-for descendants as ours, which
    misses what Open MPI's orted daemons and their ranks use (so MPI runs would look loaded).  Here a
    thread samples, every 0.25 s, the CPU time of every process in the hosts' network namespaces
    (everything a run starts lives there) plus this process's own; others = all CPUs' busy time
    (/proc/stat) minus that, over wall time x CPUs.  A process's last < 0.25 s before it exits is
    missed, so the share is an upper bound by a little.
    """

    def __init__(self, inodes: set) -> None:
        import threading

        self.inodes = inodes
        self.hz = os.sysconf("SC_CLK_TCK")
        self.base: Dict[int, int] = {p: t for p in pids_in_netns(inodes) if (t := _cpu_ticks(p)) is not None}
        self.last: Dict[int, int] = dict(self.base)
        self.j0 = self._jiffies()
        self.own0 = _cpu_ticks(os.getpid()) or 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    @staticmethod
    def _jiffies() -> Optional[tuple]:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return sum(v) - v[3] - v[4], sum(v)

    def _sample(self) -> None:
        for p in pids_in_netns(self.inodes):
            t = _cpu_ticks(p)
            if t is not None:
                self.last[p] = t

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def fraction(self) -> Optional[float]:
        self._sample()
        self._stop.set()
        self._t.join()
        j1 = self._jiffies()
        if self.j0 is None or j1 is None or j1[1] == self.j0[1]:
            return None
        ours = sum(t - self.base.get(p, 0) for p, t in self.last.items())
        ours += (_cpu_ticks(os.getpid()) or 0) - self.own0
        wall = time.monotonic() - self.t0
        ncpu = (j1[1] - self.j0[1]) / self.hz / max(wall, 1e-9)
        return max(0.0, (j1[0] - self.j0[0] - ours) / self.hz) / max(wall * max(ncpu, 1.0), 1e-9)


def loadavg() -> List[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ===================================================================================== infrastructure


class Infra:
    """The namespace hosts, the lock, the watchdog, and everything this run must remove."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.n = ns.hosts
        self.prefix = ns.prefix
        shared = ns.prefix == "h"
        self.net = ns.net or ("10.77.0" if shared else "10.78.0")
        self.state = ns.state or ("/run/procgroup-infra" if shared else f"/run/procgroup-{ns.prefix}-infra")
        self.lock_path = "/run/procgroup-infra.lock" if shared else f"/run/procgroup-{ns.prefix}-infra.lock"
        self.names = [f"{ns.prefix}{i}" for i in range(1, self.n + 1)]
        self.env = {"PG_INFRA_PREFIX": self.prefix, "PG_INFRA_NET": self.net, "PG_INFRA_STATE": self.state,
                    "PATH": SBIN_PATH}
        self.own_hosts = False
        self.keep_hosts = ns.keep_hosts
        self.lock_fd: Optional[int] = None
        self.watchdog: Optional[subprocess.Popen] = None
        self.state_file: Optional[Path] = None
        self.baseline: set = set()
        self.shm_prefixes: List[str] = []
        self.timings: Dict[str, float] = {}
        self.use_lock = not ns.no_lock
        self.lock_wait = ns.lock_wait

    # -- preconditions -------------------------------------------------------------------------
    @staticmethod
    def unavailable() -> Optional[str]:
        """Why the namespace hosts cannot be made here (None: they can)."""
        if os.geteuid() != 0:
            return f"needs root (running as uid {os.geteuid()})"
        for b in ("ip", "nsenter", "unshare", "mount"):
            if shutil.which(b, path=SBIN_PATH) is None:
                return f"needs {b} (infra/install_debian.sh)"
        return None

    # -- lock + watchdog -----------------------------------------------------------------------
    def acquire(self, work: Path) -> None:
        if self.use_lock:
            self.lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            deadline = time.monotonic() + self.lock_wait
            said = False
            while True:
                try:
                    fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        holder = os.pread(self.lock_fd, 64, 0).decode(errors="replace").strip() or "?"
                        raise SystemExit(f"multihost: {self.lock_path} is held by pid {holder} for over "
                                         f"{self.lock_wait:.0f}s (--lock-wait); giving up")
                    if not said:
                        log(f"waiting for {self.lock_path} (another session uses the {self.prefix}* hosts)")
                        said = True
                    time.sleep(0.5)
            os.ftruncate(self.lock_fd, 0)
            os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode(), 0)
        self.state_file = work / "cleanup-state.json"
        self._save_state()
        # the watchdog cleans up if this process dies without doing so (SIGKILL, os._exit)
        self.watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_watchdog", str(self.state_file)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            pass_fds=(self.lock_fd,) if self.lock_fd is not None else (), env={**os.environ, **self.env})

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        st = {"names": self.names, "own_hosts": self.own_hosts and not self.keep_hosts, "env": self.env,
              "baseline": sorted(self.baseline), "shm_prefixes": self.shm_prefixes, "n": self.n}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        tmp.replace(self.state_file)

    def add_shm_prefix(self, p: str) -> None:
        self.shm_prefixes.append(p)
        self._save_state()

    # -- hosts ---------------------------------------------------------------------------------
    def script(self, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(INFRA / name), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env}, stdin=subprocess.DEVNULL)

    def hosts_up(self) -> bool:
        try:
            recorded = Path(self.state, "netns", "hosts").read_text().split()
        except OSError:
            return False
        return all(h in recorded and os.path.exists(f"/run/netns/{h}") and os.path.exists(f"{self.state}/uts/{h}")
                   for h in self.names)

    def up(self) -> str:
        if self.hosts_up():
            self.baseline = pids_in_netns(netns_inodes(self.names))
            self._save_state()
            return f"reusing hosts {', '.join(self.names)} (already up; left up afterwards)"
        self.own_hosts = True
        self._save_state()  # a half-made bring-up is undone too
        t0 = time.monotonic()
        r = self.script("netns_up.sh", str(self.n))
        self.timings["netns_up_s"] = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"infra/netns_up.sh {self.n} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
        self.baseline = pids_in_netns(netns_inodes(self.names))
        self._save_state()
        return (f"made hosts {', '.join(self.names)} ({self.net}.1-{self.n}) with infra/netns_up.sh"
                + (" (kept afterwards: --keep-hosts)" if self.keep_hosts else ""))

    def hostexec(self, host: str, *argv: str) -> List[str]:
        return [str(INFRA / "hostexec.sh"), host, *argv]

    # -- cleanup -------------------------------------------------------------------------------
    def sweep(self) -> List[str]:
        """Stop every process that appeared in the hosts since they came up (or were found up)."""
        left = pids_in_netns(netns_inodes(self.names)) - self.baseline
        return stop_pids(sorted(left))

    def remove_shm(self) -> List[str]:
        removed = []
        pres = [f"procgroup-{p}" for p in self.shm_prefixes] + [f"vader_segment.{h}." for h in self.names]
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            return removed
        for n in names:
            if any(n.startswith(p) for p in pres):
                try:
                    os.unlink(os.path.join("/dev/shm", n))
                    removed.append(n)
                except OSError:
                    pass
        return removed

    def teardown(self) -> dict:
        """Everything this run started goes; returns what was found and removed, and what is left."""
        rep: dict = {}
        rep["processes_stopped"] = self.sweep()
        rep["shm_removed"] = self.remove_shm()
        rep["processes_left"] = [f"pid {p}: {cmdline(p)[:160]}"
                                 for p in sorted(pids_in_netns(netns_inodes(self.names)) - self.baseline) if alive(p)]
        if self.own_hosts and not self.keep_hosts:
            t0 = time.monotonic()
            self.script("netns_down.sh", str(self.n))
            self.timings["netns_down_s"] = time.monotonic() - t0
            rep["hosts_removed"] = self.names
            rep["namespaces_left"] = [h for h in self.names + [f"{self.prefix}sw"] if os.path.exists(f"/run/netns/{h}")]
        else:
            rep["hosts_removed"] = []
        rep["shm_left"] = [n for n in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else [])
                           if any(n.startswith(f"procgroup-{p}") for p in self.shm_prefixes)
                           or any(n.startswith(f"vader_segment.{h}.") for h in self.names)]
        return rep

    def release(self) -> None:
        """After teardown: tell the watchdog all is done, drop the lock."""
        if self.state_file is not None:
            try:
                self.state_file.unlink()
            except OSError:
                pass
        if self.watchdog is not None:
            try:
                self.watchdog.stdin.close()  # type: ignore[union-attr]
                self.watchdog.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.watchdog.kill()
                self.watchdog.wait()
            self.watchdog = None
        if self.lock_fd is not None:
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self.lock_fd)
                self.lock_fd = None


def _watchdog(state_file: str) -> int:
    """Wait for the main process's pipe to close; if it left its state file behind, clean up for it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        sys.stdin.buffer.read()
    except OSError:
        pass
    try:
        st = json.loads(Path(state_file).read_text())
    except (OSError, ValueError):
        return 0
    names = st["names"]
    stop_pids(sorted(pids_in_netns(netns_inodes(names)) - set(st["baseline"])))
    pres = [f"procgroup-{p}" for p in st["shm_prefixes"]] + [f"vader_segment.{h}." for h in names]
    for n in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if any(n.startswith(p) for p in pres):
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass
    if st["own_hosts"]:
        subprocess.run([str(INFRA / "netns_down.sh"), str(st["n"])], env={**os.environ, **st["env"]},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    work = Path(state_file).parent  # this process's TemporaryDirectory, which the killed process could not remove
    if work.name.startswith("multihost-"):
        shutil.rmtree(work, ignore_errors=True)
    else:
        try:
            Path(state_file).unlink()
        except OSError:
            pass
    return 0


# ===================================================================================== runs


class Terminated(BaseException):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so that the teardown runs."""


def log(msg: str) -> None:
    sys.stderr.write(f"multihost: {msg}\n")
    sys.stderr.flush()


def child_env(extra: Optional[dict] = None) -> dict:
    from procgroup.bench.cli import child_env as bench_env

    env = bench_env()
    for k in list(env):  # nothing that tells a rank (or a nested launcher) who it is
        if k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "PET_", "TORCHELASTIC_", "HYDI_", "HYDRA_")) or \
                (k.startswith("PROCGROUP_") and k not in ("PROCGROUP_TIMEOUT", "PROCGROUP_TRANSPORT")):
            env.pop(k)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p and p != str(SRC)])
    env.update(extra or {})
    return env


class Runner:
    def __init__(self, ns: argparse.Namespace, infra: Infra, work: Path) -> None:
        self.ns = ns
        self.infra = infra
        self.work = work
        self.session = secrets.token_hex(4)
        self.count = 0
        self.procs: List[subprocess.Popen] = []
        infra.add_shm_prefix(f"mhb-{self.session}")

    def _worker_args(self, system: str, out: Path, force: str = "") -> List[str]:
        return [str(Path(__file__).resolve()), "--worker", system, "--out", str(out),
                "--op", self.ns.op, "--sizes", ",".join(str(s) for s in self.ns.size_list), "--iters", str(self.ns.iters),
                "--warmup", str(self.ns.warmup), "--timeout", str(self.ns.timeout),
                *(["--pg-force", force] if system == "procgroup" and force else []),
                *(["--pg-stage-times"] if system == "procgroup" and self.ns.pg_stage_times else [])]

    def _start(self, cmd: List[str], env: dict, logf) -> subprocess.Popen:  # type: ignore[no-untyped-def]
        p = subprocess.Popen(cmd, env=env, cwd=str(self.work), stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            live = [p for p in self.procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except OSError:
                    pass
            end = time.monotonic() + 5
            while time.monotonic() < end and any(p.poll() is None for p in live):
                time.sleep(0.1)
        self.procs = []

    def commands(self, system: str, config: Optional[str], out: Path) -> tuple[List[List[str]], dict]:
        ns, names, per = self.ns, self.infra.names, self.ns.per_host
        py = sys.executable
        if system == "procgroup":
            force = ns.pg_force if config is None else ns.variants[config]
            port = str(ns.port + self.count % 500)
            run_id = f"mhb-{self.session}-{self.count}"
            env = child_env({**self.infra.env, "PROCGROUP_SECRET": secrets.token_hex(16),
                             "PROCGROUP_TIMEOUT": str(ns.timeout)})
            if ns.transport != "auto":
                env["PROCGROUP_TRANSPORT"] = ns.transport
            cmds = [self.infra.hostexec(h, py, "-m", "procgroup", "run", "--nnodes", str(len(names)),
                                        "--node-rank", str(i), "--master-addr", names[0], "--master-port", port,
                                        "--nproc-per-node", str(per), "--run-id", run_id,
                                        *self._worker_args("procgroup", out, force))
                    for i, h in enumerate(names)]
            return cmds, env
        assert config is not None
        mca = BASE_MCA + MPI_CONFIGS[config]["mca"] + [tuple(kv.split("=", 1)) for kv in ns.mpi_mca]
        env = child_env({**self.infra.env})
        fwd = ["PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"]
        cmd = self.infra.hostexec(
            names[0], shutil.which("mpirun") or "mpirun", "--allow-run-as-root",
            "-H", ",".join(f"{h}:{per}" for h in names), "--mca", "plm_rsh_agent", str(INFRA / "rsh_hostexec.sh"),
            *[a for k, v in mca for a in ("--mca", k, v)], *[a for v in fwd for a in ("-x", v)],
            py, *self._worker_args("mpi", out))
        return [cmd], env

    def run(self, system: str, config: Optional[str], rnd: int) -> dict:
        self.count += 1
        label = "procgroup" if system == "procgroup" and config is None else f"{system}-{config}"
        out = self.work / f"{label}-r{rnd}.jsonl"
        logp = self.work / f"{label}-r{rnd}.log"
        cmds, env = self.commands(system, config, out)
        info: dict = {"system": label, "round": rnd, "commands": cmds, "status": "failed", "records": [],
                      "loadavg_before": loadavg()}
        if config is not None:
            info["mpi_config" if system == "mpi" else "pg_variant"] = config
        meter = OthersMeter(netns_inodes(self.infra.names))
        t0 = time.monotonic()
        with open(logp, "w") as logf:
            procs = [self._start(c, env, logf) for c in cmds]
            end = t0 + self.ns.run_timeout
            try:
                while any(p.poll() is None for p in procs):
                    if time.monotonic() > end:
                        info["error"] = f"did not finish within {self.ns.run_timeout:.0f}s (--run-timeout); killed"
                        break
                    # one node's launcher failing brings the others down by itself; give them a moment
                    time.sleep(0.2)
            finally:
                self.kill_all()
        info["wall_s"] = time.monotonic() - t0
        info["background_cpu"] = meter.fraction()
        info["loadavg_after"] = loadavg()
        info["returncodes"] = [p.returncode for p in procs]
        left = self.infra.sweep()
        if left:
            info["leftover_processes_stopped"] = left
        recs = []
        if out.exists():
            for line in out.read_text().splitlines():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
        info["header"] = next((r for r in recs if r.get("kind") == "header"), None)
        cpu = next((r for r in recs if r.get("kind") == "cpu"), None)
        if cpu:
            info["cpu"] = {k: v for k, v in cpu.items() if k != "kind"}
        st = next((r for r in recs if r.get("kind") == "stages"), None)
        if st:
            info["stage_times"] = st.get("stage_times")
        for r in recs:
            if r.get("kind") == "case":
                r = {k: v for k, v in r.items() if k != "kind"}
                r.update(system=label, round=rnd, background_cpu=info["background_cpu"],
                         loadavg_before=info["loadavg_before"])
                info["records"].append(r)
        ended = any(r.get("kind") == "end" for r in recs)
        if all(rc == 0 for rc in info["returncodes"]) and ended and "error" not in info:
            info["status"] = "ok"
        else:
            info.setdefault("error", f"exit status(es) {info['returncodes']}")
            tail = logp.read_text(errors="replace")[-4000:] if logp.exists() else ""
            info["log_tail"] = tail
            log(f"{label} round {rnd} FAILED ({info['error']}); last output:\n{tail}")
        bad = [r for r in info["records"] if "error" in r]
        if bad:
            info["status"] = "failed"
            info.setdefault("error", bad[0]["error"])
        return info


# ===================================================================================== report


def fmt_size(n: int) -> str:
    from procgroup.bench.cases import fmt_size as f

    return f(n)


def summarize(runs: List[dict], systems: List[str], sizes: List[int], n: int, op: str = "all_reduce") -> dict:
    from procgroup.bench.cases import busbw_factor
    from procgroup.bench.report import combine_rounds

    by_sys: Dict[str, List[dict]] = {s: [] for s in systems}
    for r in runs:
        by_sys.setdefault(r["system"], []).extend(r["records"])
    combined = {s: {int(c["bytes"]): c for c in combine_rounds(recs) if "bytes" in c} for s, recs in by_sys.items()}
    per_round: Dict[tuple, dict] = {}
    for r in runs:
        for rec in r["records"]:
            per_round[(r["system"], r["round"], int(rec.get("bytes", 0)))] = rec
    nrounds = 1 + max((r["round"] for r in runs), default=0)
    rows = []
    for s in sizes:
        pg = combined.get("procgroup", {}).get(s)
        for other in systems[1:]:
            o = combined.get(other, {}).get(s)
            ratios = []
            for k in range(nrounds):
                a, b = per_round.get(("procgroup", k, s)), per_round.get((other, k, s))
                if a and b and "median_s" in a and "median_s" in b:
                    ratios.append(a["median_s"] / b["median_s"])
            rows.append({"bytes": s, "other": other,
                         "procgroup_median_s": pg.get("median_s") if pg else None,
                         "other_median_s": o.get("median_s") if o else None,
                         "ratio_of_medians": (pg["median_s"] / o["median_s"]) if pg and o and "median_s" in pg
                         and "median_s" in o else None,
                         "ratio_rounds": ratios,
                         "ratio_median_of_rounds": statistics.median(ratios) if ratios else None})
    return {"combined": {s: list(v.values()) for s, v in combined.items()}, "ratios": rows,
            "busbw_factor": busbw_factor(op, n)}


def _ms(v: Optional[float]) -> str:
    if v is None:
        return "-"
    ms = v * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}"


def _cell(rec: Optional[dict]) -> str:
    if rec is None:
        return "-"
    if "error" in rec:
        return "FAILED"
    return f"{_ms(rec['median_s'])} ({_ms(rec['p90_s'])})"


def markdown(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    systems, sizes = cfg["systems"], cfg["sizes"]
    src = m.get("procgroup_source", {})
    n = cfg["world_size"]
    op = cfg.get("op_name", "all_reduce")
    from procgroup.bench.cases import busbw_factor

    lines = [f"### {op} across {cfg['hosts']} hosts x {cfg['per_host']} ranks: procgroup vs Open MPI over TCP", "",
             f"`{' '.join(result['argv'])}`, {result['created']}; hosts {', '.join(cfg['host_names'])} "
             f"(network namespaces on one {m['cpu_count']}-CPU machine, {m['cpu_model']}); "
             f"procgroup {m['procgroup']} at {src.get('git_commit', '?')[:10]}"
             f"{' + uncommitted changes in ' + ', '.join(src['git_uncommitted']) if src.get('git_uncommitted') else ''}; "
             f"Python {m['python']}, numpy {m['numpy']}, mpi4py {m['mpi4py']}, {m['mpirun']}.", "",
             f"float32 SUM, {cfg['iters']} timed iterations after {cfg['warmup']} warm-up per run; time = slowest "
             f"rank per iteration, median (p90) in ms; result checked against the closed form on every rank; "
             f"busbw = algbw x {busbw_factor(op, n):.3f} (nccl-tests' factor for {op})"
             f"{'; sendrecv: one way, half a ping-pong between ranks 0 and 1' if op == 'sendrecv' else ''}.  "
             f"procgroup: {cfg['procgroup_launch']}.  "
             f"Open MPI: {cfg['mpi_launch']}", ""]
    for c in cfg.get("mpi_configs", []):
        lines.append(f"* `mpi-{c}`: {MPI_CONFIGS[c]['about']}; extra MCA: "
                     f"{' '.join(f'{k}={v}' for k, v in MPI_CONFIGS[c]['mca']) or '(none)'}")
    if cfg.get("pg_force"):
        lines.append(f"* procgroup algorithms pinned (experiment): select.FORCE {cfg['pg_force']}")
    for v, spec in (cfg.get("pg_variants") or {}).items():
        lines.append(f"* `procgroup-{v}` (experiment): procgroup with select.FORCE {spec}")
    if cfg.get("mpi_mca"):
        lines.append(f"* extra MCA on every MPI run: {' '.join(cfg['mpi_mca'])}")
    lines += ["", "#### per round", ""]
    head = "| round | size | order | loadavg 1/5/15 at round start* | other users' CPU** |"
    sep = "|---:|---:|---|---|---:|"
    for s in systems:
        head += f" {s} ms |"
        sep += "---:|"
    for s in systems[1:]:
        head += f" ratio vs {s} |"
        sep += "---:|"
    lines += [head, sep]
    by = {(r["system"], r["round"]): r for r in result["runs"]}
    for rnd in range(cfg["repeat"]):
        order = result["round_order"][rnd]
        first = by.get((order[0], rnd), {})
        la = first.get("loadavg_before") or []
        bgs = [by[(s, rnd)].get("background_cpu") for s in systems if (s, rnd) in by]
        bgs = [b for b in bgs if b is not None]
        for size in sizes:
            recs = {s: next((x for x in by.get((s, rnd), {}).get("records", []) if x.get("bytes") == size), None)
                    for s in systems}
            row = (f"| {rnd} | {fmt_size(size)} | {'pg first' if order[0] == 'procgroup' else 'MPI first'} | "
                   f"{'/'.join(f'{x:.2f}' for x in la)} | "
                   f"{'-' if not bgs else f'{100 * min(bgs):.0f}-{100 * max(bgs):.0f}%'} |")
            for s in systems:
                row += f" {_cell(recs[s]) if (s, rnd) in by and by[(s, rnd)]['status'] == 'ok' else 'FAILED'} |"
            for s in systems[1:]:
                a, b = recs.get("procgroup"), recs.get(s)
                ok = a and b and "median_s" in a and "median_s" in b
                row += f" {a['median_s'] / b['median_s']:.2f} |" if ok else " - |"
            lines.append(row)
    lines += ["", "\\* /proc/loadavg counts runnable threads of everyone, this benchmark's own ranks and launchers "
                  "included (the 1-minute average still carries the previous run).  \\*\\* the share of the CPUs "
                  "that processes outside the benchmark took during each system's run (min-max over the round's "
                  "runs): /proc/stat busy time minus the CPU time of every process in the hosts' namespaces.",
              "", f"#### median over {cfg['repeat']} round(s)", "",
              "| system | size | median ms | p90 ms | algbw GB/s | busbw GB/s | procgroup / this (per-round range) "
              "| CPU ms per call, all ranks |",
              "|---|---:|---:|---:|---:|---:|---|---:|"]
    cpu_by = {}
    for r in result["runs"]:
        if r.get("cpu"):
            cpu_by.setdefault(r["system"], []).append(r["cpu"]["cpu_ms_per_call_all_ranks"])
    comb = result["summary"]["combined"]
    for size in sizes:
        for s in systems:
            rec = next((x for x in comb.get(s, []) if x.get("bytes") == size), None)
            if rec is None or "median_s" not in rec:
                lines.append(f"| {s} | {fmt_size(size)} | FAILED | | | | | |")
                continue
            rr = next((x for x in result["summary"]["ratios"] if x["bytes"] == size and x["other"] == s), None)
            ratio = "-"
            if rr and rr["ratio_of_medians"] is not None:
                ratio = f"{rr['ratio_of_medians']:.2f}"
                if rr["ratio_rounds"]:
                    ratio += f" ({min(rr['ratio_rounds']):.2f}-{max(rr['ratio_rounds']):.2f})"
            cpu = (f"{statistics.median(cpu_by[s]):.0f}" if len(sizes) == 1 and cpu_by.get(s) else
                   ("(all sizes)" if cpu_by.get(s) else "-"))
            lines.append(f"| {s} | {fmt_size(size)} | {_ms(rec['median_s'])} | {_ms(rec['p90_s'])} | "
                         f"{rec['algbw_GBps']:.3f} | {rec['busbw_GBps']:.3f} | {ratio} | {cpu} |")
    if result.get("verdict"):
        lines += ["", f"**Target** ({result['verdict']['target']}): {result['verdict']['text']}"]
    pg_hdr = result.get("procgroup_header") or {}
    if pg_hdr.get("algorithm"):
        lines += ["", "procgroup's algorithm choices (rank 0, from select.choose_*): " + "; ".join(
            f"{fmt_size(int(k))}: {' / '.join(v)}" for k, v in pg_hdr["algorithm"].items() if k.isdigit())]
    if pg_hdr.get("peer_transports"):
        pt = pg_hdr["peer_transports"]
        lines.append("procgroup's transports (rank: peers): " + "; ".join(
            f"{r}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for r, d in enumerate(pt)))
    for r in result["runs"]:
        if r.get("stage_times"):
            st = r["stage_times"]
            lines.append(f"{r['system']} stage times, round {r['round']} (mean ms per call by rank 0..{n - 1}): " + "; ".join(
                f"{k.replace('choose_', '')} [{v['algorithm_rank0']}]: "
                + " ".join("-" if x is None else f"{x:.1f}" for x in v["mean_ms_per_call_by_rank"])
                for k, v in st.items()))
    td = result.get("teardown", {})
    lines += ["", f"Teardown: {len(td.get('processes_stopped', []))} process(es) had to be stopped, "
                  f"{len(td.get('shm_removed', []))} /dev/shm segment(s) removed; left: processes "
                  f"{len(td.get('processes_left', []))}, namespaces {len(td.get('namespaces_left', []))}, "
                  f"segments {len(td.get('shm_left', []))}."]
    for note in result.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n".join(lines) + "\n"


def verdict(result: dict) -> Optional[dict]:
    """The issue's target at 64 MiB: procgroup time <= Open MPI's (ratio <= 1), against each MPI variant."""
    target = 64 << 20
    if result["config"].get("op_name", "all_reduce") != "all_reduce" or result["config"].get("world_size") != 6:
        return None
    rows = [r for r in result["summary"]["ratios"] if r["bytes"] == target and r["ratio_of_medians"] is not None]
    if not rows:
        return None
    parts = []
    runs = {(x["system"], x["round"]): x for x in result["runs"]}
    for r in rows:
        if not r["other"].startswith("mpi"):
            continue
        ok = r["ratio_of_medians"] <= 1.0  # median over rounds of each system's median
        rng = f" (rounds {min(r['ratio_rounds']):.2f}-{max(r['ratio_rounds']):.2f})" if r["ratio_rounds"] else ""
        # the round in which the other users' load was lowest for both runs: the fairest single comparison
        calm = []
        for k in range(result["config"]["repeat"]):
            a, b = runs.get(("procgroup", k)), runs.get((r["other"], k))
            if a and b and a["status"] == b["status"] == "ok" and a.get("background_cpu") is not None \
                    and b.get("background_cpu") is not None:
                ra = next((x for x in a["records"] if x.get("bytes") == target), None)
                rb = next((x for x in b["records"] if x.get("bytes") == target), None)
                if ra and rb:
                    calm.append((max(a["background_cpu"], b["background_cpu"]), k, ra["median_s"] / rb["median_s"]))
        least = ""
        if calm:
            bg, k, ratio = min(calm)
            r["least_loaded_round"] = {"round": k, "others_cpu_max": bg, "ratio": ratio}
            least = f"; least-loaded round ({k}, others' CPU <= {100 * bg:.0f}%): {ratio:.2f}x"
        calm_ok = r.get("least_loaded_round", {}).get("ratio", r["ratio_of_medians"]) <= 1.0
        word = "met" if ok and calm_ok else ("borderline" if ok or calm_ok else "MISSED")
        r["status"] = word
        parts.append(f"vs {r['other']}: {r['ratio_of_medians']:.2f}x{rng}{least} -> {word}")
    return {"target": "64 MiB all_reduce, 3 hosts x 2 ranks, procgroup time <= Open MPI over TCP",
            "text": "; ".join(parts), "rows": rows}


def finish_report(result: dict) -> str:
    """Fill in the summary, the headers and the verdict of ``result``; returns the markdown."""
    cfg = result["config"]
    result["summary"] = summarize(result["runs"], cfg["systems"], cfg["sizes"], cfg["world_size"],
                                  cfg.get("op_name", "all_reduce"))
    result["procgroup_header"] = next((r["header"] for r in result["runs"] if r["system"] == "procgroup" and r["header"]),
                                      None)
    result["mpi_headers"] = {r["system"]: r["header"] for r in result["runs"] if r["system"].startswith("mpi") and r["header"]}
    result["verdict"] = verdict(result)
    # every record that has a time passed the closed-form check on every rank
    result["all_checked"] = all(rec.get("checked") for r in result["runs"] for rec in r["records"])
    return markdown(result)


def render(path: Path) -> int:
    result = json.loads(path.read_text())
    md = finish_report(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(md)
    print(md, flush=True)
    return 0


# ===================================================================================== main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/multihost.py",
        description="all_reduce across network-namespace hosts (default 3 hosts x 2 ranks): procgroup (procgroup run "
                    "per node) vs Open MPI (mpirun, mpi4py) over TCP, interleaved rounds, JSON + markdown report.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64M", help="comma-separated per-rank buffer sizes, e.g. 64M or 1M,16M,64M "
                                                  "(binary units; default 64M)")
    p.add_argument("--op", default="all_reduce", choices=("all_reduce", "broadcast", "reduce", "all_gather",
                                                            "reduce_scatter", "all_to_all", "sendrecv"),
                   help="the collective (default all_reduce; sendrecv = ping-pong between ranks 0 and 1, e.g. with "
                        "--per-host 1 to measure one TCP hop)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size and run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per size and run (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; systems alternate who goes first (default 3)")
    p.add_argument("--mpi-configs", default=DEFAULT_MPI_CONFIGS,
                   help=f"Open MPI variants to time, comma-separated from {','.join(MPI_CONFIGS)}, or 'none' "
                        f"(default {DEFAULT_MPI_CONFIGS})")
    p.add_argument("--mpi-mca", action="append", default=[], metavar="KEY=VALUE",
                   help="extra --mca for every MPI run (repeatable)")
    p.add_argument("--transport", choices=("auto", "tcp"), default="auto",
                   help="procgroup's PROCGROUP_TRANSPORT: auto = shm within a host, tcp across (default); "
                        "tcp = tcp everywhere")
    p.add_argument("--hosts", type=int, default=3, help="namespace hosts (default 3)")
    p.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--prefix", default="pgb",
                   help="host-name prefix: hosts PREFIX1..N (default pgb, private to this benchmark; 'h' = the test "
                        "suite's h1..h3, taken under its lock /run/procgroup-infra.lock)")
    p.add_argument("--net", default=None, help="first three octets of the hosts' subnet (default 10.78.0; 10.77.0 for h)")
    p.add_argument("--state", default=None, help="infra state directory (default /run/procgroup-PREFIX-infra; "
                                                 "/run/procgroup-infra for h)")
    p.add_argument("--keep-hosts", action="store_true", help="leave hosts this run made up (a later run reuses them)")
    p.add_argument("--no-lock", action="store_true",
                   help="do not take the hosts' lock (the caller holds it, e.g. a pytest session)")
    p.add_argument("--lock-wait", type=float, default=600.0, help="seconds to wait for the hosts' lock (default 600)")
    p.add_argument("--port", type=int, default=29500, help="procgroup's --master-port base (default 29500)")
    p.add_argument("--timeout", type=float, default=120.0, help="procgroup's collective/init timeout, s (default 120)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="wall-clock limit of one run, s (default 300)")
    p.add_argument("--pg-force", default="", metavar="COLL=ALG,...",
                   help="experiments: pin procgroup algorithms through procgroup.algorithms.select.FORCE in every rank, "
                        "e.g. all_reduce=ring (flat ring over all ranks instead of the hierarchical all_reduce), or a "
                        "prototype of benchmarks/multihost_prototypes.py: all_reduce=multileader")
    p.add_argument("--pg-variant", action="append", default=[], metavar="NAME=COLL=ALG[,COLL=ALG]",
                   help="experiments: also time procgroup with these algorithms pinned, as system procgroup-NAME, in "
                        "every round (repeatable), e.g. --pg-variant ml=all_reduce=multileader")
    p.add_argument("--pg-stage-times", action="store_true",
                   help="experiments: time the stages of procgroup's all_reduce in every rank (intra-host reduce, "
                        "inter-host all_reduce, intra-host broadcast) and report them")
    p.add_argument("--calm", type=float, default=None, metavar="FRACTION",
                   help="before each round wait until the CPUs are at most this busy (e.g. 0.3), for up to "
                        "--calm-wait s (the machine is shared)")
    p.add_argument("--calm-wait", type=float, default=300.0, metavar="SECONDS", help="see --calm (default 300)")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT), help=f"where JSON + markdown go (default {DEFAULT_OUT})")
    p.add_argument("--name", default=None, help="file name stem (default multihost-<UTC timestamp>)")
    p.add_argument("--render", metavar="JSON", help="only rewrite the markdown report (and the summary in the JSON) "
                                                   "of an earlier run's JSON file; starts nothing, needs no root")
    # internal modes
    p.add_argument("--worker", choices=("procgroup", "mpi"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--_watchdog", dest="watchdog", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.watchdog:
        return _watchdog(ns.watchdog)
    if ns.worker:
        return _worker(ns)
    if ns.render:
        return render(Path(ns.render))

    from procgroup.bench.cases import parse_size

    try:
        ns.size_list = [parse_size(s) for s in ns.sizes.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    n = ns.hosts * ns.per_host
    if not ns.size_list or any(s < 4 for s in ns.size_list):
        p.error("--sizes: give sizes of at least 4 bytes (one float32)")
    if ns.iters < 1 or ns.warmup < 0 or ns.repeat < 1 or ns.hosts < 2 or ns.per_host < 1:
        p.error("--iters/--repeat >= 1, --warmup >= 0, --hosts >= 2, --per-host >= 1")
    configs = [c.strip() for c in ns.mpi_configs.split(",") if c.strip() and c.strip() != "none"]
    bad = [c for c in configs if c not in MPI_CONFIGS]
    if bad:
        p.error(f"--mpi-configs: unknown {bad}; choose from {','.join(MPI_CONFIGS)} or none")
    ns.variants = {}
    for v in ns.pg_variant:
        name, _, spec = v.partition("=")
        if not name.isidentifier() or "=" not in spec:
            p.error(f"--pg-variant {v!r}: write NAME=COLL=ALG, e.g. ml=all_reduce=multileader")
        ns.variants[name] = spec
    if any("=" not in kv for kv in ns.mpi_mca):
        p.error("--mpi-mca takes KEY=VALUE")
    why = Infra.unavailable()
    if why:
        log(f"cannot run: {why}")
        return 2
    notes: List[str] = []
    if configs:
        from procgroup.bench.cli import mpi_unavailable

        why = mpi_unavailable() or (None if shutil.which("orted") else "orted is not on PATH")
        if why:
            log(f"cannot run the Open MPI side: {why} (use --mpi-configs none to time procgroup alone)")
            return 2

    from procgroup.bench.cli import machine_info

    def on_signal(signum, frame):  # type: ignore[no-untyped-def]
        raise Terminated(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C tears down too, even when started from a shell that ignores SIGINT in background jobs
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    systems = ["procgroup"] + [f"procgroup-{v}" for v in ns.variants] + [f"mpi-{c}" for c in configs]
    started = datetime.datetime.now(datetime.timezone.utc)
    result: dict = {
        "tool": "benchmarks/multihost.py",
        "created": started.isoformat(timespec="seconds"),
        "argv": ["benchmarks/multihost.py", *(sys.argv[1:] if argv is None else argv)],
        "config": {"sizes": ns.size_list, "iters": ns.iters, "warmup": ns.warmup, "repeat": ns.repeat,
                   "hosts": ns.hosts, "per_host": ns.per_host, "world_size": n, "systems": systems,
                   "mpi_configs": configs, "mpi_mca": ns.mpi_mca, "procgroup_transport": ns.transport,
                   "mpi_base_mca": [f"{k}={v}" for k, v in BASE_MCA], "op": f"{ns.op} float32" + (" SUM" if "reduce" in ns.op else ""),
                   "op_name": ns.op,
                   "pg_force": ns.pg_force, "pg_variants": ns.variants, "pg_stage_times": ns.pg_stage_times, "calm": ns.calm},
        "machine": machine_info(),
        "notes": notes,
        "runs": [],
        "round_order": [],
    }
    infra = Infra(ns)
    cfg = result["config"]
    cfg["host_names"] = infra.names
    cfg["procgroup_launch"] = (f"one `procgroup run --nnodes {ns.hosts} --node-rank K --master-addr {infra.names[0]} "
                               f"--nproc-per-node {ns.per_host}` per host via infra/hostexec.sh; shm within a host, "
                               f"TCP across (PROCGROUP_TRANSPORT={ns.transport})")
    cfg["mpi_launch"] = (f"`mpirun -H {','.join(f'{h}:{ns.per_host}' for h in infra.names)} --mca plm_rsh_agent "
                         f"infra/rsh_hostexec.sh {' '.join(f'--mca {k} {v}' for k, v in BASE_MCA)}` from "
                         f"{infra.names[0]}: tcp btl between hosts, vader (shared memory) within a host.")
    rc = 1
    runner: Optional[Runner] = None
    with tempfile.TemporaryDirectory(prefix="multihost-") as td:
        work = Path(td)
        os.chmod(work, 0o755)
        try:
            infra.acquire(work)
            msg = infra.up()
            log(msg)
            notes.append(msg)
            runner = Runner(ns, infra, work)
            t_all = time.monotonic()
            for rnd in range(ns.repeat):
                order = systems if rnd % 2 == 0 else systems[1:] + systems[:1]
                result["round_order"].append(order)
                if ns.calm is not None:
                    from procgroup.bench.cli import wait_calm

                    result.setdefault("calm", []).append(wait_calm(ns.calm, ns.calm_wait, False))
                log(f"round {rnd + 1}/{ns.repeat}: loadavg {' '.join(f'{x:.2f}' for x in loadavg())}; order "
                    f"{', '.join(order)}")
                for s in order:
                    kind, _, conf = s.partition("-")
                    r = runner.run(kind, conf or None, rnd)
                    result["runs"].append(r)
                    if r["status"] == "ok":
                        meds = ", ".join(f"{fmt_size(x['bytes'])} {x['median_s'] * 1e3:.1f} ms (p90 "
                                         f"{x['p90_s'] * 1e3:.1f})" for x in r["records"])
                        log(f"  {s:<12} {meds}   [{r['wall_s']:.1f}s wall, load {r['loadavg_before'][0]:.2f}, "
                            f"others' CPU {100 * (r['background_cpu'] or 0):.0f}%"
                            + (f", CPU {r['cpu']['cpu_ms_per_call_all_ranks']:.0f} ms/call all ranks" if r.get("cpu") else "")
                            + "]")
            result["wall_s"] = time.monotonic() - t_all
            rc = 0 if all(r["status"] == "ok" for r in result["runs"]) else 1
        except (KeyboardInterrupt, Terminated) as e:
            log(f"interrupted ({type(e).__name__} {e}); tearing down")
            notes.append(f"interrupted: {type(e).__name__} {e}")
            rc = 130
        except Exception as e:  # noqa: BLE001 - reported, then the teardown runs
            log(f"error: {type(e).__name__}: {e}")
            notes.append(f"error: {type(e).__name__}: {e}")
            rc = 1
        finally:
            # teardown must not be cut short by a second Ctrl-C or SIGTERM
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            if runner is not None:
                runner.kill_all()
            result["teardown"] = infra.teardown()
            infra.release()
            result["infra_timings"] = infra.timings
            for s, h in old.items():
                signal.signal(s, h)
    td_rep = result["teardown"]
    log(f"teardown: {len(td_rep['processes_stopped'])} process(es) stopped, {len(td_rep['shm_removed'])} /dev/shm "
        f"segment(s) removed, hosts removed: {', '.join(td_rep['hosts_removed']) or 'none (not ours)'}")
    if td_rep.get("processes_left") or td_rep.get("namespaces_left") or td_rep.get("shm_left"):
        log(f"teardown left something behind: {json.dumps(td_rep)}")
        rc = rc or 1
    if not result["runs"]:
        return rc
    result["machine"]["loadavg_end"] = loadavg()
    md = finish_report(result)
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = ns.name or f"multihost-{started.strftime('%Y%m%dT%H%M%SZ')}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(md)
    print(md, flush=True)
    log(f"wrote {out_dir / (stem + '.json')} and {out_dir / (stem + '.md')}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
