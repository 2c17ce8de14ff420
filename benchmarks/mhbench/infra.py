"""The namespace hosts, the lock, the watchdog, and everything a run must remove."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .common import INFRA, SBIN_PATH, SCRIPT, SRC
from .procs import alive, cmdline, netns_inodes, pids_in_netns, stop_pids

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
        self.env = {
            "PG_INFRA_PREFIX": self.prefix,
            "PG_INFRA_NET": self.net,
            "PG_INFRA_STATE": self.state,
            "PATH": SBIN_PATH,
        }
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
                        raise SystemExit(
                            f"multihost: {self.lock_path} is held by pid {holder} for over "
                            f"{self.lock_wait:.0f}s (--lock-wait); giving up"
                        ) from None
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
            [sys.executable, str(SCRIPT), "--_watchdog", str(self.state_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(self.lock_fd,) if self.lock_fd is not None else (),
            env={**os.environ, **self.env},
        )

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        st = {
            "names": self.names,
            "own_hosts": self.own_hosts and not self.keep_hosts,
            "env": self.env,
            "baseline": sorted(self.baseline),
            "shm_prefixes": self.shm_prefixes,
            "n": self.n,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        tmp.replace(self.state_file)

    def add_shm_prefix(self, p: str) -> None:
        self.shm_prefixes.append(p)
        self._save_state()

    # -- hosts ---------------------------------------------------------------------------------
    def script(self, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(INFRA / name), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
        )

    def hosts_up(self) -> bool:
        try:
            recorded = Path(self.state, "netns", "hosts").read_text().split()
        except OSError:
            return False
        return all(
            h in recorded and os.path.exists(f"/run/netns/{h}") and os.path.exists(f"{self.state}/uts/{h}")
            for h in self.names
        )

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
        return f"made hosts {', '.join(self.names)} ({self.net}.1-{self.n}) with infra/netns_up.sh" + (
            " (kept afterwards: --keep-hosts)" if self.keep_hosts else ""
        )

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
        rep["processes_left"] = [
            f"pid {p}: {cmdline(p)[:160]}"
            for p in sorted(pids_in_netns(netns_inodes(self.names)) - self.baseline)
            if alive(p)
        ]
        if self.own_hosts and not self.keep_hosts:
            t0 = time.monotonic()
            self.script("netns_down.sh", str(self.n))
            self.timings["netns_down_s"] = time.monotonic() - t0
            rep["hosts_removed"] = self.names
            rep["namespaces_left"] = [h for h in self.names + [f"{self.prefix}sw"] if os.path.exists(f"/run/netns/{h}")]
        else:
            rep["hosts_removed"] = []
        rep["shm_left"] = [
            n
            for n in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else [])
            if any(n.startswith(f"procgroup-{p}") for p in self.shm_prefixes)
            or any(n.startswith(f"vader_segment.{h}.") for h in self.names)
        ]
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
        subprocess.run(
            [str(INFRA / "netns_down.sh"), str(st["n"])],
            env={**os.environ, **st["env"]},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
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
    from procgroup.bench._env import child_env as bench_env

    env = bench_env()
    for k in list(env):  # nothing that tells a rank (or a nested launcher) who it is
        if k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "PET_", "TORCHELASTIC_", "HYDI_", "HYDRA_")) or (
            k.startswith("PROCGROUP_") and k not in ("PROCGROUP_TIMEOUT", "PROCGROUP_TRANSPORT")
        ):
            env.pop(k)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SRC)]
    )
    env.update(extra or {})
    return env
