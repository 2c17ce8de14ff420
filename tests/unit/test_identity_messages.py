"""Issue 11 items 5 and 9: a bad rank / world size / port is refused at once, headed by the bad argument or
variable and its value (not by "does not know this process's rank"), for every init method."""

from __future__ import annotations

import os
import time

import pytest

import procgroup as dist
from procgroup import identity_guard
from procgroup import store as store_mod
from procgroup.errors import ConfigError, NoIdentityError
from procgroup.identity import detect_identity
from procgroup.netutil import free_port

pytestmark = pytest.mark.timeout(60)

_KEEP = ("PATH", "HOME", "PYTHONPATH", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT", "PYTEST_CURRENT_TEST")


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variables at all; a fixed secret; init leaves no default group behind."""
    if dist.is_initialized():
        pytest.skip("another test left the default process group initialized")
    for k in list(os.environ):
        if k not in _KEEP:
            monkeypatch.delenv(k)
    monkeypatch.setenv("PROCGROUP_SECRET", "s")
    # a refusing rank's wait for its peers (item 8) has its own tests with real processes: keep these quick
    monkeypatch.setattr(identity_guard, "PUBLISH_CONNECT_S", 0.05)
    monkeypatch.setattr(identity_guard, "PUBLISH_LINGER_S", 0.05)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


# -------------------------------------------------------------------------------- item 9: the headline
_OK = {"RANK": "0", "WORLD_SIZE": "2"}

BAD_ENV = [
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a valid TCP port (1-65535)"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a valid TCP port (1-65535)"),
    ({"MASTER_PORT": "-5"}, "MASTER_PORT=-5 is not a valid TCP port"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a valid world size"),
    ({"WORLD_SIZE": "-3"}, "WORLD_SIZE=-3 is not a valid world size"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "2"}, "RANK=2 is out of range"),
    ({"RANK": "-1"}, "RANK=-1 is out of range"),
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3 is out of range"),
    ({"LOCAL_RANK": "q", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='q' is not an integer"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 is not a valid local world size"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2"),
    ({"GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"}, "GROUP_RANK=2 is out of range"),
    ({"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "0"}, "GROUP_WORLD_SIZE=0 is not a valid number of nodes"),
    ({"NODE_RANK": "-2"}, "NODE_RANK=-2 is not a valid node rank"),
]


@pytest.mark.parametrize("bad, head", BAD_ENV, ids=[h.split(" ")[0] for _, h in BAD_ENV])
def test_detect_identity_leads_with_the_bad_variable(bad, head):
    with pytest.raises(ConfigError) as ei:
        detect_identity({**_OK, **bad})
    first = str(ei.value).splitlines()[0]
    assert first.startswith(head), first
    assert "does not know" not in first


@pytest.mark.parametrize("bad, head", BAD_ENV, ids=[h.split(" ")[0] for _, h in BAD_ENV])
def test_init_leads_with_the_bad_variable(bare_env, bad, head):
    """Through init_process_group (env://): the headline is the variable, not "does not know ... rank"."""
    for k, v in {**_OK, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **bad}.items():
        bare_env.setenv(k, v)
    with pytest.raises(ConfigError) as ei:
        dist.init_process_group(timeout=5)
    first = str(ei.value).splitlines()[0]
    assert first.startswith(head), first
    assert not dist.is_initialized()


def test_nothing_set_still_says_it_does_not_know(bare_env):
    with pytest.raises(NoIdentityError, match="does not know this process's rank and world size"):
        dist.init_process_group(timeout=5)


def test_explicit_arguments_still_read_master_from_the_environment(bare_env):
    """rank=/world_size= with env://: MASTER_PORT from the environment is still checked (it was silently
    replaced by the default port before)."""
    bare_env.setenv("MASTER_PORT", "99999")
    with pytest.raises(ConfigError, match=r"^MASTER_PORT=99999 is not a valid TCP port"):
        dist.init_process_group(rank=0, world_size=1, timeout=5)


# -------------------------------------------------------------------------------- item 5: explicit arguments
BAD_ARGS = [
    (dict(rank=2, world_size=2), "rank=2 is out of range: with world_size=2 the ranks are 0..1"),
    (dict(rank=5, world_size=1), "rank=5 is out of range: with world_size=1"),
    (dict(rank=-2, world_size=2), "rank=-2 is not a valid rank (it must be in [0, 2))"),
    (dict(rank=0, world_size=0), "world_size=0 is not a valid world size"),
    (dict(rank=0, world_size=-4), "world_size=-4 is not a valid world size"),
    (dict(rank=1), "rank=1 was passed without world_size="),
    (dict(world_size=2), "world_size=2 was passed without rank="),
    (dict(rank="1", world_size=2), "rank='1' is not an integer (str)"),
    (dict(rank=0, world_size=2.0), "world_size=2.0 is not an integer (float)"),
]


def _init_method(kind: str, tmp_path) -> dict:
    if kind == "tcp":
        return {"init_method": f"tcp://127.0.0.1:{free_port()}"}
    if kind == "file":
        return {"init_method": f"file://{tmp_path / 'rdzv'}"}
    if kind == "env":
        return {"init_method": "env://"}
    return {"store": store_mod.HashStore()}


@pytest.mark.parametrize("kind", ["tcp", "file", "env", "store"])
@pytest.mark.parametrize("kwargs, head", BAD_ARGS, ids=[h.split(" ")[0] for _, h in BAD_ARGS])
def test_bad_explicit_rank_is_refused_at_once(bare_env, tmp_path, kind, kwargs, head):
    """Before: rank=2, world_size=2 waited the whole deadline, then blamed connectivity."""
    bare_env.setenv("MASTER_PORT", str(free_port()))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as ei:
        dist.init_process_group(timeout=3, **kwargs, **_init_method(kind, tmp_path))
    elapsed = time.monotonic() - t0
    assert str(ei.value).startswith(head), str(ei.value)
    assert elapsed < 1.0, f"{elapsed:.2f}s to refuse {kwargs}"
    assert not dist.is_initialized()
    assert not (tmp_path / "rdzv").exists(), "a refused init must not create the file store"


@pytest.mark.parametrize(
    "query, kwargs, head",
    [("rank=3&world_size=2", {}, "rank=3 is out of range"), ("world_size=0", {"rank": 0}, "world_size=0")],
)
def test_bad_rank_in_the_url_query_is_refused_at_once(bare_env, query, kwargs, head):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"^{head}"):
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}?{query}", timeout=3, **kwargs)
    assert time.monotonic() - t0 < 1.0


def test_argument_meets_the_environment(bare_env):
    """rank= given, WORLD_SIZE from the environment: the message says which is which."""
    bare_env.setenv("WORLD_SIZE", "2")
    bare_env.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"^rank=4 is out of range: with WORLD_SIZE=2"):
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{free_port()}", rank=4, timeout=3)


# -------------------------------------------------------------------------------- item 8: telling the others
def test_refusal_is_recorded_in_a_live_store(bare_env):
    """The refusing rank writes the rendezvous error where the waiting members read it (quickly, when the store
    is up), naming its bad value."""
    port = free_port()
    server = store_mod.StoreServer("127.0.0.1", port, secret=b"s")
    server.start()
    try:
        with pytest.raises(ConfigError):
            dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=2, world_size=2, timeout=3)
        client = store_mod.TCPStore("127.0.0.1", port, secret=b"s", timeout=3)
        try:
            rec = client.get("pg/0/error").decode()
        finally:
            client.close()
        assert "refused to start: rank=2 is out of range" in rec, rec
    finally:
        server.close()


def test_refusal_is_recorded_in_a_given_store(bare_env):
    st = store_mod.HashStore()
    with pytest.raises(ConfigError):
        dist.init_process_group(store=st, rank=0, world_size=0, timeout=3)
    assert b"world_size=0 is not a valid world size" in st.get("pg/0/error")


# -------------------------------------------------------------------------------- item 10: stale file store
def _claim(store, rank: int, pid: int, ws: int = 2) -> None:
    from procgroup.rendezvous import MemberInfo, host_key, process_start_time

    store.set("pg/0/world_size", str(ws))
    info = MemberInfo(rank, ws, "here", host_key(), "127.0.0.1", pid, "n", start_time=process_start_time(pid))
    store.set(f"pg/0/rank/{rank}", info.encode())


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_file_store_of_dead_members_is_moved_aside(tmp_path, caplog):
    from procgroup.file_rendezvous import open_file_store

    path = str(tmp_path / "rdzv")
    old = store_mod.FileStore(path)
    dead = _dead_pid()
    _claim(old, 0, dead)
    old.close()
    st = open_file_store(path, 5.0, "pg/0")
    try:
        assert not st.check(["pg/0/rank/0"]), "a fresh file is expected"
    finally:
        st.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rdzv.stale-")], list(tmp_path.iterdir())
    assert f"pid {dead}" in caplog.text and "was left by a killed job" in caplog.text


def test_file_store_with_dead_and_live_members_says_delete_it(tmp_path):
    from procgroup.errors import StaleStoreError
    from procgroup.file_rendezvous import open_file_store

    path = str(tmp_path / "rdzv")
    old = store_mod.FileStore(path)
    dead = _dead_pid()
    _claim(old, 0, dead)
    _claim(old, 1, os.getpid())
    old.close()
    with pytest.raises(StaleStoreError, match=rf"from a killed job: its member\(s\) rank 0 pid {dead} .* Delete the"):
        open_file_store(path, 5.0, "pg/0")
    assert os.path.exists(path)


def test_file_store_of_live_members_is_kept(tmp_path):
    from procgroup.file_rendezvous import open_file_store

    path = str(tmp_path / "rdzv")
    old = store_mod.FileStore(path)
    _claim(old, 0, os.getpid())
    old.close()
    st = open_file_store(path, 5.0, "pg/0")
    try:
        assert st.check(["pg/0/rank/0"])
    finally:
        st.close()
