"""Tests for procgroup.netutil (loopback only)."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from procgroup import netutil
from procgroup.config import ENV
from procgroup.errors import ConfigError, PortInUseError


@pytest.fixture
def listener():
    s = netutil.bind_listener("127.0.0.1", 0)
    yield s
    s.close()


def test_bind_listener_port0_listens(listener):
    host, port = listener.getsockname()[:2]
    assert host == "127.0.0.1" and port > 0
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_bind_twice_names_addr_port_and_pid(listener):
    port = listener.getsockname()[1]
    with pytest.raises(PortInUseError) as ei:
        netutil.bind_listener("127.0.0.1", port)
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg
    assert f"pid {os.getpid()}" in msg
    assert "MASTER_PORT" in msg and "--standalone" in msg
    assert isinstance(ei.value, ConfigError)


def test_port_holder(listener):
    port = listener.getsockname()[1]
    holder = netutil.port_holder(port)
    assert holder is not None and holder.startswith(f"pid {os.getpid()} (")
    listener.close()
    assert netutil.port_holder(port) is None


def test_free_port_is_bindable():
    p = netutil.free_port()
    s = netutil.bind_listener("127.0.0.1", p)
    s.close()


def test_local_addr_towards_loopback():
    assert netutil.local_addr_towards("127.0.0.1", 29500) == "127.0.0.1"


def test_local_addr_towards_remote_is_not_loopback():
    try:
        addr = netutil.local_addr_towards("192.0.2.123", 29500)  # TEST-NET-1: routed, never contacted
    except ConfigError:
        pytest.skip("no non-loopback interface on this host")
    assert not ipaddress.ip_address(addr).is_loopback


def test_is_loopback_and_resolve():
    assert netutil.is_loopback("127.0.0.1")
    assert netutil.is_loopback("localhost")
    assert netutil.is_loopback("::1")
    assert not netutil.is_loopback("192.0.2.1")
    assert "127.0.0.1" in netutil.resolve("localhost", 80)
    assert netutil.resolve("10.1.2.3", 80) == ["10.1.2.3"]


def test_resolve_unknown_host_is_config_error():
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        netutil.resolve("no-such-host.invalid", 80)


def test_interface_addr_lo():
    assert netutil.interface_addr("lo") == "127.0.0.1"


def test_interface_addr_missing_lists_interfaces():
    with pytest.raises(ConfigError) as ei:
        netutil.interface_addr("nosuchif0")
    msg = str(ei.value)
    assert "nosuchif0" in msg and "lo" in msg and ENV.SOCKET_IFNAME in msg


def test_advertised_addr_default_routes_to_master():
    assert netutil.advertised_addr("127.0.0.1", 29500, environ={}) == "127.0.0.1"


def test_advertised_addr_socket_addr_wins():
    env = {ENV.SOCKET_ADDR: "10.9.8.7", ENV.SOCKET_IFNAME: "lo"}
    assert netutil.advertised_addr("127.0.0.1", 29500, environ=env) == "10.9.8.7"


def test_advertised_addr_ifname():
    assert netutil.advertised_addr("192.0.2.1", 29500, environ={ENV.SOCKET_IFNAME: "lo"}) == "127.0.0.1"
    with pytest.raises(ConfigError, match="nosuchif0"):
        netutil.advertised_addr("127.0.0.1", 29500, environ={ENV.SOCKET_IFNAME: "nosuchif0"})


def test_format_hostport():
    assert netutil.format_hostport("h", 1) == "h:1"
    assert netutil.format_hostport("::1", 1) == "[::1]:1"


def test_non_loopback_addrs():
    for a in netutil.non_loopback_addrs():
        assert not ipaddress.ip_address(a).is_loopback
