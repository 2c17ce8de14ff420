"""Session fixtures that bring up real test infrastructure with the scripts in infra/ (registered in tests/conftest.py).

* ``netns_hosts``   3 hosts h1..h3 (network + UTS namespaces, 10.77.0.1-3, own name -> 127.0.1.1)
* ``slurm_cluster`` slurmctld on h1 and one slurmd per host (CPUs=2 each: srun -N3 -n6 -> 2 per node)
* ``sshd_hosts``    sshd on port 22 in every host, root key auth, client wrapper ``ssh``

Each skips -- with the reason shown by ``pytest -ra`` -- when not root, when ``ip netns add`` is
refused, or when a binary is missing (infra/install_debian.sh installs them all).  A failure to
bring up infrastructure that should work is an error, not a skip.

Teardown: every fixture registers its ``*_down.sh`` before it calls ``*_up.sh``, so a half-made
bring-up is undone too, also when tests fail.  Should pytest itself die (pytest-timeout's thread
method calls ``os._exit``; SIGKILL), a watchdog process started with the first fixture notices its
stdin pipe closing and runs infra/down_all.sh.  A lock (/run/procgroup-infra.lock) keeps two test
sessions on one machine from fighting over h1..h3; the watchdog holds it while it cleans up.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pytest

from .launch import INFRA

NHOSTS = 3
CPUS_PER_NODE = 2
STATE = Path(os.environ.get("PG_INFRA_STATE", "/run/procgroup-infra"))
LOCK = Path("/run/procgroup-infra.lock")
LOCK_WAIT_S = float(os.environ.get("PG_INFRA_LOCK_WAIT", "60"))
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

#: (what, seconds) of every bring-up and tear-down, printed in the terminal summary
TIMINGS: List[Tuple[str, float]] = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest hook signature
    if TIMINGS:
        terminalreporter.write_line("infra timings: " + ", ".join(f"{w} {s:.2f}s" for w, s in TIMINGS))


# ------------------------------------------------------------------------------------ helpers


def which(name: str) -> Optional[str]:
    return shutil.which(name, path=SBIN_PATH)


def require_binaries(*names: str, why: str) -> None:
    missing = [n for n in names if which(n) is None]
    if missing:
        pytest.skip(f"infra: {why} needs {', '.join(missing)} (not found; install with infra/install_debian.sh)")


def require_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"infra: {why} needs root (running as uid {os.geteuid()})")


def _script(
    name: str, *args: str, timeout: float = 120, env: Optional[Mapping[str, str]] = None
) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PATH"] = SBIN_PATH
    e.update(env or {})
    return subprocess.run(
        [str(INFRA / name), *args], capture_output=True, text=True, timeout=timeout, env=e, stdin=subprocess.DEVNULL
    )


def _timed(what: str, name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = _script(name, *args, **kw)
    TIMINGS.append((what, time.monotonic() - t0))
    return r


def _bring_up(what: str, name: str, *args: str, **kw) -> None:
    r = _timed(f"{what} up", name, *args, **kw)
    if r.returncode != 0:
        pytest.fail(
            f"infra: infra/{name} {' '.join(args)} failed with exit status {r.returncode}\n"
            f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}",
            pytrace=False,
        )


def _tear_down(what: str, name: str, *args: str) -> None:
    r = _timed(f"{what} down", name, *args, timeout=120)
    if r.returncode != 0:  # the down scripts always exit 0; say so loudly if one did not
        print(f"infra: infra/{name} exited with {r.returncode}: {r.stderr}", file=sys.stderr)


# ------------------------------------------------------------------------------------ guard


class _Guard:
    """The session lock plus a watchdog that runs infra/down_all.sh if this process dies."""

    def __init__(self) -> None:
        self.fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
                    os.close(self.fd)
                    pytest.skip(
                        f"infra: another test session (pid {holder}) has held {LOCK} for over "
                        f"{LOCK_WAIT_S:.0f}s; set PG_INFRA_LOCK_WAIT to wait longer"
                    )
                time.sleep(0.5)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        self.watchdog: Optional[subprocess.Popen] = subprocess.Popen(
            ["sh", "-c", 'read _ignored; exec "$0" "$1"', str(INFRA / "down_all.sh"), str(NHOSTS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=(self.fd,),
            env={**os.environ, "PATH": SBIN_PATH},
        )

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
            self.watchdog.stdin.close()  # type: ignore[union-attr]
            self.watchdog = None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


@pytest.fixture(scope="session")
def infra_guard(request):
    require_root("the test infrastructure")
    guard = _Guard()
    request.addfinalizer(guard.close)
    return guard


# ------------------------------------------------------------------------------------ hosts


@dataclass(frozen=True)
class NetnsHosts:
    """The namespace hosts: ``names`` h1..hN, ``addrs`` name -> 10.77.0.K."""

    names: Tuple[str, ...]
    addrs: Dict[str, str]
    hostexec: Path

    def cmd(self, host: str, *argv: str) -> List[str]:
        """argv that runs ``argv`` on ``host``."""
        return [str(self.hostexec), host, *argv]

    def run(
        self,
        host: str,
        *argv: str,
        timeout: float = 30,
        env: Optional[Mapping[str, str]] = None,
        input: Optional[str] = None,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.cmd(host, *argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=None if env is None else dict(env),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )


def _probe_netns() -> Optional[str]:
    """None when this process may do what netns_up.sh and hostexec.sh do, else what was refused.

    Creates a throw-away network namespace, enters it and makes UTS and mount namespaces there
    (containers without CAP_SYS_ADMIN refuse one of these).
    """
    name = f"pgprobe{os.getpid()}"
    ip = which("ip") or "ip"
    r = subprocess.run([ip, "netns", "add", name], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"`ip netns add` is refused: {r.stderr.strip() or f'exit status {r.returncode}'}"
    try:
        r = subprocess.run(
            [
                which("nsenter") or "nsenter",
                f"--net=/run/netns/{name}",
                which("unshare") or "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            return f"entering a network namespace with new UTS and mount namespaces is refused: {r.stderr.strip()}"
    finally:
        subprocess.run([ip, "netns", "del", name], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="session")
def netns_hosts(request, infra_guard) -> NetnsHosts:
    require_binaries("ip", "nsenter", "unshare", "mount", why="netns_hosts")
    refused = _probe_netns()
    if refused:
        pytest.skip(f"infra: netns_hosts: {refused}")
    request.addfinalizer(lambda: _tear_down("netns", "netns_down.sh", str(NHOSTS)))
    _bring_up("netns", "netns_up.sh", str(NHOSTS))
    names = tuple(f"h{i}" for i in range(1, NHOSTS + 1))
    return NetnsHosts(names, {h: f"10.77.0.{i}" for i, h in enumerate(names, 1)}, INFRA / "hostexec.sh")


# ------------------------------------------------------------------------------------ slurm


@dataclass(frozen=True)
class SlurmCluster:
    """slurmctld on ``hosts.names[0]``, one slurmd per host with ``cpus_per_node`` CPUs."""

    hosts: NetnsHosts
    conf: Path
    cpus_per_node: int

    def cmd(self, *argv: str) -> List[str]:
        """argv that runs a Slurm client command (srun, sinfo, ...) on the first host."""
        return self.hosts.cmd(self.hosts.names[0], *argv)

    def env(self, base: Mapping[str, str]) -> Dict[str, str]:
        return {**base, "SLURM_CONF": str(self.conf)}


@pytest.fixture(scope="session")
def slurm_cluster(request, netns_hosts: NetnsHosts) -> SlurmCluster:
    require_binaries(
        "munged",
        "munge",
        "unmunge",
        "slurmctld",
        "slurmd",
        "slurmstepd",
        "srun",
        "sinfo",
        "runuser",
        why="slurm_cluster",
    )
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        pytest.skip("infra: slurm_cluster needs the 'munge' user (install the munge package: infra/install_debian.sh)")
    request.addfinalizer(lambda: _tear_down("slurm", "slurm_down.sh"))
    _bring_up("slurm", "slurm_up.sh", env={"CPUS": str(CPUS_PER_NODE)})
    return SlurmCluster(netns_hosts, STATE / "slurm" / "slurm.conf", CPUS_PER_NODE)


# ------------------------------------------------------------------------------------ sshd


@dataclass(frozen=True)
class SshHosts:
    """sshd on port 22 in every host; ``ssh`` is a wrapper (``ssh -F config``) usable as an rsh agent."""

    hosts: NetnsHosts
    ssh: Path
    config: Path

    def cmd(self, from_host: str, to_host: str, *argv: str) -> List[str]:
        return self.hosts.cmd(from_host, str(self.ssh), to_host, *argv)


@pytest.fixture(scope="session")
def sshd_hosts(request, netns_hosts: NetnsHosts) -> SshHosts:
    require_binaries("sshd", "ssh", "ssh-keygen", why="sshd_hosts")
    request.addfinalizer(lambda: _tear_down("ssh", "ssh_down.sh"))
    _bring_up("ssh", "ssh_up.sh")
    return SshHosts(netns_hosts, STATE / "ssh" / "ssh", STATE / "ssh" / "ssh_config")


def python_for_hosts() -> str:
    """The interpreter the ranks run: this one (the hosts share the filesystem)."""
    return sys.executable


def host_list(hosts: Sequence[str], slots: int) -> str:
    return ",".join(f"{h}:{slots}" for h in hosts)
