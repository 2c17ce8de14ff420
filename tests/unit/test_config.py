"""The runtime configuration: parsed once, explicit > environment > default, every bad value named."""

import datetime
import logging

import pytest

from procgroup.config import (
    DEFAULT_TCP_SPIN_US,
    DEFAULT_TIMEOUT,
    ENV,
    RuntimeConfig,
    ShmOptions,
    TcpOptions,
    job_secret,
    shm_options,
    tcp_options,
    to_seconds,
)
from procgroup.errors import ConfigError


def test_defaults_from_an_empty_environment():
    c = RuntimeConfig.load({})
    assert c == RuntimeConfig()
    assert c.timeout == DEFAULT_TIMEOUT and c.transport == "auto" and c.restart_count == 0
    assert c.shm == ShmOptions(cma=True, spin_us=None, split=True, arena=True)
    assert c.tcp == TcpOptions(spin_us=DEFAULT_TCP_SPIN_US)


def test_every_variable_is_read():
    env = {
        ENV.TIMEOUT: "7.5",
        ENV.TRANSPORT: "TCP",
        ENV.SOCKET_ADDR: "10.0.0.2",
        ENV.SOCKET_IFNAME: "eth1",
        ENV.HOSTNAME: "h9",
        ENV.LOG_LEVEL: "debug",
        ENV.PROGRESS_INTERVAL: "2",
        ENV.STORE_HOSTED: "1",
        ENV.RUN_ID: "job7",
        ENV.TORCHELASTIC_RUN_ID: "te7",
        ENV.RESTART_COUNT: "3",
        ENV.TTY: "/dev/pts/9",
        ENV.SECRET: "s3cr3t",
        ENV.SHM_CMA: "0",
        ENV.SHM_SPIN_US: "40",
        ENV.SHM_SPLIT: "off",
        ENV.SHM_ARENA: "no",
        ENV.TCP_SPIN_US: "250",
    }
    c = RuntimeConfig.load(env)
    assert (c.timeout, c.transport, c.socket_addr) == (7.5, "tcp", "10.0.0.2")
    assert (c.socket_ifname, c.hostname) == ("eth1", "h9")
    assert (c.log_level, c.progress_interval, c.store_hosted) == (logging.DEBUG, 2.0, True)
    assert (c.run_id, c.torchelastic_run_id, c.restart_count, c.tty) == ("job7", "te7", 3, "/dev/pts/9")
    assert c.shm == ShmOptions(cma=False, spin_us=40.0, split=False, arena=False)
    assert c.tcp == TcpOptions(spin_us=250.0)
    assert job_secret(c, "any") == b"s3cr3t"
    assert "s3cr3t" not in repr(c)


def test_explicit_timeout_wins_and_timedelta_is_seconds():
    env = {ENV.TIMEOUT: "9"}
    assert RuntimeConfig.load(env).timeout == 9.0
    assert RuntimeConfig.load(env, timeout=datetime.timedelta(milliseconds=1500)).timeout == 1.5
    assert RuntimeConfig.load(env, timeout=3).timeout == 3.0


def test_restart_count_falls_back_to_torchelastic():
    assert RuntimeConfig.load({ENV.TORCHELASTIC_RESTART_COUNT: "2"}).restart_count == 2
    assert RuntimeConfig.load({ENV.TORCHELASTIC_RESTART_COUNT: "2", ENV.RESTART_COUNT: "0"}).restart_count == 0


@pytest.mark.parametrize(
    "name,value",
    [
        (ENV.LOG_LEVEL, "loud"),
        (ENV.TRANSPORT, "infiniband"),
        (ENV.TIMEOUT, "0"),
        (ENV.TIMEOUT, "soon"),
        (ENV.PROGRESS_INTERVAL, "-1"),
        (ENV.STORE_HOSTED, "maybe"),
        (ENV.RESTART_COUNT, "-1"),
        (ENV.SHM_SPIN_US, "fast"),
        (ENV.SHM_SPIN_US, "-5"),
        (ENV.SHM_ARENA, "2"),
        (ENV.TCP_SPIN_US, "-1"),
        (ENV.TCP_SPIN_US, "long"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(name, value):
    with pytest.raises(ConfigError) as ei:
        RuntimeConfig.load({name: value})
    assert name in str(ei.value) and value in str(ei.value)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "x", [1], datetime.timedelta(0)])
def test_to_seconds_rejects(bad):
    with pytest.raises(ConfigError, match="timeout"):
        to_seconds(bad)


def test_to_seconds_accepts():
    assert to_seconds(None) is None
    assert to_seconds(2) == 2.0 and to_seconds("2.5") == 2.5
    assert to_seconds(datetime.timedelta(minutes=1), name="x") == 60.0


def test_derived_secret_without_the_variable():
    assert job_secret(RuntimeConfig(), "j1") != job_secret(RuntimeConfig(), "j2")


def test_shm_options_alone():
    assert shm_options({}) == ShmOptions()
    assert shm_options({ENV.SHM_SPIN_US: "0"}).spin_us == 0.0


def test_tcp_options_alone():
    assert tcp_options({}) == TcpOptions() and TcpOptions().spin_us == DEFAULT_TCP_SPIN_US
    assert tcp_options({ENV.TCP_SPIN_US: "0"}).spin_us == 0.0
