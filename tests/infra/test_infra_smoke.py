"""The test infrastructure itself: namespace hosts, the 127.0.1.1 trap, Slurm and sshd.

These pin down what the per-process-mode tests rely on, so that when one of those fails the
smoke tests say whether the infrastructure or procgroup is to blame.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .fixtures import NetnsHosts, SlurmCluster, SshHosts
from .launch import SCRIPTS, clean_env, launch, new_tag, related_pids

pytestmark = [pytest.mark.infra, pytest.mark.timeout(120, method="signal")]

REACH = str(SCRIPTS / "reach.py")
PORT = 5999


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit status {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    return r.stdout


def test_hosts_have_distinct_hostnames(netns_hosts: NetnsHosts):
    names = [_ok(netns_hosts.run(h, "hostname")).strip() for h in netns_hosts.names]
    assert names == list(netns_hosts.names)
    assert len(set(names)) == len(names)


def test_own_name_resolves_to_127_0_1_1(netns_hosts: NetnsHosts):
    """The trap: on every host its own name resolves to 127.0.1.1 (Debian's /etc/hosts self entry)."""
    for h in netns_hosts.names:
        name, addr = _ok(netns_hosts.run(h, sys.executable, REACH, "self")).split()
        assert (name, addr) == (h, "127.0.1.1")
        if shutil.which("hostname"):
            r = netns_hosts.run(h, "hostname", "-i")
            if r.returncode == 0:  # `hostname -i` as users would check it
                assert r.stdout.split() == ["127.0.1.1"], r.stdout


def test_hosts_reach_each_other_by_name(netns_hosts: NetnsHosts):
    """Each host serves its name on PORT; every other host connects to it by name and gets that name."""
    hosts = netns_hosts.names
    servers = [
        subprocess.Popen(
            netns_hosts.cmd(h, sys.executable, REACH, "serve", str(PORT), str(len(hosts) - 1)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h in hosts
    ]
    try:
        for s in servers:
            assert s.stdout.readline().strip() == "ready", s.stderr.read()  # type: ignore[union-attr]
        for src in hosts:
            for dst in hosts:
                if src == dst:
                    continue
                addr, reply = _ok(netns_hosts.run(src, sys.executable, REACH, "connect", dst, str(PORT))).split()
                assert (addr, reply) == (netns_hosts.addrs[dst], dst), f"{src} -> {dst}"
        for s in servers:
            assert s.wait(30) == 0, s.stderr.read()  # type: ignore[union-attr]
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
                s.wait()


def test_hosts_are_isolated_from_the_root_namespace(netns_hosts: NetnsHosts):
    """The hosts' subnet is not reachable from the machine itself (tests must run clients on a host)."""
    r = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True)
    assert "10.77.0." not in r.stdout


def test_launch_finds_and_kills_what_a_launch_leaves_behind(netns_hosts: NetnsHosts):
    """The leftover check the launcher tests rely on: a daemonized process on a host is found and killed."""
    tag = new_tag()
    sleeper = f"setsid {sys.executable} -c 'import time; time.sleep(300)' {tag} </dev/null >/dev/null 2>&1 &"
    cmd = netns_hosts.cmd(netns_hosts.names[1], "sh", "-c", sleeper)
    r = launch(cmd, env=clean_env(), timeout=30, tag=None, netns=netns_hosts.names, grace=2)
    assert r.returncode == 0, r.report()
    assert len(r.leftovers) == 1 and tag in r.leftovers[0], r.report()
    assert not related_pids(None, tag, set(), set()), "the leftover was not killed"


def test_slurm_places_two_tasks_per_node(slurm_cluster: SlurmCluster):
    r = subprocess.run(
        slurm_cluster.cmd("srun", "-N3", "-n6", "sh", "-c", 'echo "$SLURM_PROCID $(hostname)"'),
        capture_output=True,
        text=True,
        timeout=60,
        env=slurm_cluster.env(clean_env()),
    )
    got = sorted(tuple(line.split()) for line in _ok(r).splitlines())
    assert got == sorted((str(i), f"h{i // 2 + 1}") for i in range(6))


def test_ssh_between_hosts(sshd_hosts: SshHosts):
    for src in sshd_hosts.hosts.names:
        for dst in sshd_hosts.hosts.names:
            r = subprocess.run(
                sshd_hosts.cmd(src, dst, "hostname"),
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            assert _ok(r).strip() == dst, f"ssh {src} -> {dst}"
