"""The per-user secret file: created once, private, atomic under a race; where it lives; the launcher's choice."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat

import pytest

from procgroup.config import ENV, RuntimeConfig, job_secret, user_secret_path
from procgroup.errors import ConfigError
from procgroup.secretfile import load_or_create_user_secret, read_user_secret, secret_source


def _create(path: str, q: "mp.Queue[str]") -> None:
    q.put(load_or_create_user_secret(path)[0])


def test_created_once_mode_0600_and_racers_agree(tmp_path):  # type: ignore[no-untyped-def]
    path = str(tmp_path / "cfg" / "procgroup" / "secret")
    ctx = mp.get_context("fork")
    q: "mp.Queue[str]" = ctx.Queue()
    procs = [ctx.Process(target=_create, args=(path, q)) for _ in range(8)]
    for p in procs:
        p.start()
    got = {q.get(timeout=20) for _ in procs}
    for p in procs:
        p.join(10)
    assert len(got) == 1 and len(next(iter(got))) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) & 0o077 == 0
    assert sorted(os.listdir(os.path.dirname(path))) == ["secret"]  # no temporary file left
    assert load_or_create_user_secret(path) == (next(iter(got)), False)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_group_or_other_permissions_are_refused(tmp_path, mode):  # type: ignore[no-untyped-def]
    p = tmp_path / "secret"
    p.write_text("abc")
    p.chmod(mode)
    with pytest.raises(ConfigError, match=f"chmod 600 {p}"):
        read_user_secret(str(p))


def test_a_symlink_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    (tmp_path / "real").write_text("abc")
    (tmp_path / "real").chmod(0o600)
    (tmp_path / "secret").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symbolic link"):
        read_user_secret(str(tmp_path / "secret"))


def test_path_respects_xdg_config_home_then_home():
    assert user_secret_path({ENV.XDG_CONFIG_HOME: "/x/cfg", ENV.HOME: "/h"}) == "/x/cfg/procgroup/secret"
    assert user_secret_path({ENV.HOME: "/h"}) == "/h/.config/procgroup/secret"
    assert user_secret_path({ENV.XDG_CONFIG_HOME: "relative", ENV.HOME: "/h"}) == "/h/.config/procgroup/secret"


def test_job_secret_precedence_and_sources(tmp_path, caplog):  # type: ignore[no-untyped-def]
    f = tmp_path / "named"
    f.write_text("named-secret\n")
    user = str(tmp_path / "u" / "procgroup" / "secret")
    assert job_secret(RuntimeConfig(secret="s", secret_file=str(f), user_secret_file=user), "j") == b"s"
    assert job_secret(RuntimeConfig(secret_file=str(f), user_secret_file=user), "j") == b"named-secret"
    assert secret_source(b"named-secret") == f"{ENV.SECRET_FILE}={f}"
    k = job_secret(RuntimeConfig(user_secret_file=user), "j")
    assert k == open(user).read().strip().encode() and secret_source(k) == f"the per-user secret file {user}"
    with pytest.raises(ConfigError, match="no such file"):
        job_secret(RuntimeConfig(secret_file=str(tmp_path / "missing")), "j")


def test_derived_key_only_when_no_file_can_be_made_and_then_a_warning(tmp_path, caplog):  # type: ignore[no-untyped-def]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(str(ro), os.W_OK):  # root ignores the mode: use a path under a regular file instead
        (tmp_path / "file").write_text("")
        user = str(tmp_path / "file" / "procgroup" / "secret")
    else:
        user = str(ro / "procgroup" / "secret")
    with caplog.at_level("INFO", logger="procgroup"):
        k = job_secret(RuntimeConfig(user_secret_file=user), "h:1")
    assert k == b"procgroup-derived:h:1"
    rec = [r for r in caplog.records if "derived from the job id" in r.getMessage()]
    assert rec and rec[0].levelname == "WARNING" and user in rec[0].getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="procgroup"):
        job_secret(RuntimeConfig(user_secret_file=user), "h:1", loopback=True)
    assert [r.levelname for r in caplog.records if "derived from the job id" in r.getMessage()] == ["INFO"]


def test_launcher_several_nodes_use_the_per_user_file_one_node_a_fresh_secret(tmp_path):  # type: ignore[no-untyped-def]
    from procgroup.launcher.config import LaunchConfig
    from procgroup.launcher.jobsecret import resolve_secret

    env = {ENV.XDG_CONFIG_HOME: str(tmp_path)}
    multi = LaunchConfig(entrypoint="x", nnodes=2, node_rank=1)
    s1, _ = resolve_secret(multi, env)
    s2, _ = resolve_secret(LaunchConfig(entrypoint="x", nnodes=2, node_rank=0), env)
    assert s1 == s2 == (tmp_path / "procgroup" / "secret").read_text().strip()
    one = LaunchConfig(entrypoint="x")
    a, b = resolve_secret(one, env)[0], resolve_secret(one, env)[0]
    assert a != b and a != s1  # one node: a random secret per job
    f = tmp_path / "named"
    f.write_text("n1\n")
    assert resolve_secret(multi, {**env, ENV.SECRET_FILE: str(f)})[0] == "n1"
    assert resolve_secret(multi, {**env, ENV.SECRET_FILE: str(f), ENV.SECRET: "e"})[0] == "e"
