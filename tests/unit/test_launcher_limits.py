"""--nproc-per-node against the machine (issue 11 item 6): the pure check, the CLI and its --oversubscribe."""

from __future__ import annotations

import pytest

from procgroup.errors import ConfigError
from procgroup.launcher.cli import parse_args
from procgroup.launcher.config import check_worker_count


def test_within_the_limits_passes():
    check_worker_count(64, cpus=1, nproc_limit=None, pid_max=32768)
    check_worker_count(16, cpus=2, nproc_limit=100, pid_max=32768)
    check_worker_count(10, cpus=None, nproc_limit=None, pid_max=None)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"cpus": 2, "nproc_limit": None, "pid_max": None}, "workers per CPU on this 2-CPU host"),
        ({"cpus": 4096, "nproc_limit": 500, "pid_max": None}, "RLIMIT_NPROC, `ulimit -u`, is 500"),
        ({"cpus": 4096, "nproc_limit": None, "pid_max": 1000}, "pid_max is 1000"),
    ],
)
def test_each_limit_is_named_with_the_flag(kw, words):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="--oversubscribe") as e:
        check_worker_count(1000, **kw)
    assert words in str(e.value) and "--nproc-per-node 1000" in str(e.value)


def test_cli_refuses_and_the_flag_overrides():
    with pytest.raises(ConfigError, match="--oversubscribe"):
        parse_args(["--standalone", "--nproc-per-node", "100000", "x.py"], environ={})
    cfg = parse_args(["--standalone", "--oversubscribe", "--nproc-per-node", "100000", "x.py"], environ={})
    assert cfg.nproc_per_node == 100000  # type: ignore[union-attr]
