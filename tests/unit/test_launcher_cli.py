"""``procgroup run`` argument parsing, PET_* defaults and the worker environment (no processes)."""

from __future__ import annotations

import os

import pytest

from procgroup.__main__ import main
from procgroup.config import ENV, KUBEFLOW, TORCHRUN
from procgroup.errors import ConfigError
from procgroup.launcher.cli import (
    DEFAULT_MASTER_PORT,
    LaunchConfig,
    build_parser,
    parse_args,
    parse_ranks,
    worker_env,
)

NO_ENV: dict[str, str] = {}


def parse(*argv: str, env: dict[str, str] = NO_ENV) -> LaunchConfig:
    return parse_args(list(argv), environ=env)


# --------------------------------------------------------------------------- parsing


def test_defaults():
    c = parse("train.py")
    assert (c.entrypoint, c.args, c.nproc_per_node, c.nnodes, c.node_rank) == ("train.py", (), 1, 1, 0)
    assert (c.master_addr, c.master_port, c.standalone, c.max_restarts) == ("127.0.0.1", DEFAULT_MASTER_PORT, False, 0)
    assert c.prefix_format == "[{rank}] " and c.log_dir is None and not c.module and not c.no_python
    assert c.run_id and c.run_id != "none"  # random on one node


def test_script_args_are_passed_through_untouched():
    c = parse("--nproc-per-node", "2", "train.py", "--nproc-per-node", "7", "-m", "--", "x")
    assert c.nproc_per_node == 2
    assert c.args == ("--nproc-per-node", "7", "-m", "--", "x")


@pytest.mark.parametrize(
    "dash, underscore",
    [
        (["--nproc-per-node", "3"], ["--nproc_per_node", "3"]),
        (["--master-addr", "10.0.0.1"], ["--master_addr", "10.0.0.1"]),
        (["--master-port", "1234"], ["--master_port", "1234"]),
        (["--nnodes", "2", "--node-rank", "1"], ["--nnodes", "2", "--node_rank", "1"]),
        (["--max-restarts", "2"], ["--max_restarts", "2"]),
        (["--run-id", "job7"], ["--run_id", "job7"]),
        (["--log-dir", "/tmp/x"], ["--log_dir", "/tmp/x"]),
        (["--no-python"], ["--no_python"]),
    ],
)
def test_torchrun_underscore_aliases(dash, underscore):
    env = {KUBEFLOW.NNODES: "1"}
    pin = [] if "job7" in dash else ["--run-id", "r"]  # the default run id is random
    assert parse(*dash, *pin, "prog", env=env) == parse(*underscore, *pin, "prog", env=env)


def test_help_shows_one_spelling():
    h = build_parser().format_help()
    assert "--nproc-per-node" in h and "--nproc_per_node" not in h and "--master_port" not in h


def test_module_and_no_python():
    assert parse("-m", "pkg.mod", "a").module is True
    c = parse("--no-python", "sh", "-c", "echo")
    assert c.no_python and c.entrypoint == "sh" and c.args == ("-c", "echo")
    with pytest.raises(ConfigError, match="exclude each other"):
        parse("-m", "--no-python", "x")


def test_nproc_auto_is_cpu_count():
    assert parse("--nproc-per-node", "auto", "x").nproc_per_node == (os.cpu_count() or 1)


@pytest.mark.parametrize("bad", ["0", "-1", "two", "gpu"])
def test_bad_nproc_names_the_flag(bad):
    with pytest.raises(ConfigError, match="nproc-per-node"):
        parse("--nproc-per-node", bad, "x")


def test_nnodes_ranges():
    env = {ENV.SECRET: "s"}
    assert parse("--nnodes", "2:2", "x", env=env).nnodes == 2
    c = parse("--nnodes", "1:4", "x", env=env)  # elastic membership (issue 15)
    assert (c.min_nnodes, c.nnodes, c.node_rank, c.elastic) == (1, 4, None, True)
    with pytest.raises(ConfigError, match="elastic"):
        parse("--nnodes", "1:4", "--node-rank", "0", "x", env=env)
    with pytest.raises(ConfigError, match="MIN <= MAX"):
        parse("--nnodes", "3:2", "x", env=env)


def test_node_rank_out_of_range():
    with pytest.raises(ConfigError, match=r"--node-rank 2 is out of range for --nnodes 2"):
        parse("--nnodes", "2", "--node-rank", "2", "x")


def test_standalone_picks_port_and_rejects_explicit_address():
    c = parse("--standalone", "x")
    assert c.master_port == 0 and c.master_addr == "127.0.0.1"
    with pytest.raises(ConfigError, match="drop --master-port"):
        parse("--standalone", "--master-port", "29501", "x")
    with pytest.raises(ConfigError, match="single-node"):
        parse("--standalone", "--nnodes", "2", "x")


def test_bad_port():
    with pytest.raises(ConfigError, match="not a whole number"):
        parse("--master-port", "http", "x")
    with pytest.raises(ConfigError, match="65535"):
        parse("--master-port", "70000", "x")


def test_restarts_work_across_nodes():
    c = parse("--nnodes", "2", "--max-restarts", "1", "x")
    assert (c.nnodes, c.max_restarts) == (2, 1)
    with pytest.raises(ConfigError, match=">= 0"):
        parse("--max-restarts", "-1", "x")


def test_node_rank_omitted_on_several_nodes_is_assigned_at_the_rendezvous():
    assert parse("--nnodes", "3", "x").node_rank is None
    assert parse("x").node_rank == 0
    assert parse("--nnodes", "3", "x", env={KUBEFLOW.NODE_RANK: "2"}).node_rank == 2


def test_secret_file_and_join_timeout():
    c = parse("--nnodes", "2", "--secret-file", "s.txt", "--join-timeout", "12", "x")
    assert c.secret_file == os.path.abspath("s.txt") and c.join_timeout == 12.0
    assert parse("x", env={ENV.TIMEOUT: "33"}).join_timeout == 33.0
    with pytest.raises(ConfigError, match="--join-timeout"):
        parse("--join-timeout", "0", "x")


def test_tee_needs_log_dir():
    with pytest.raises(ConfigError, match="--log-dir"):
        parse("--tee", "x")


# --------------------------------------------------------------------------- PET_* defaults


def test_pet_defaults_apply():
    env = {
        KUBEFLOW.NPROC_PER_NODE: "3",
        KUBEFLOW.NNODES: "2",
        KUBEFLOW.NODE_RANK: "1",
        KUBEFLOW.MASTER_ADDR: "master-0",
        KUBEFLOW.MASTER_PORT: "23456",
    }
    c = parse("x", env=env)
    assert (c.nproc_per_node, c.nnodes, c.node_rank, c.master_addr, c.master_port) == (3, 2, 1, "master-0", 23456)
    assert c.run_id == "none" and c.prefix_format == "[{host}:{rank}] "


def test_flags_beat_pet():
    env = {KUBEFLOW.NPROC_PER_NODE: "3", KUBEFLOW.MASTER_PORT: "23456"}
    c = parse("--nproc-per-node", "2", "--master-port", "1111", "x", env=env)
    assert (c.nproc_per_node, c.master_port) == (2, 1111)


def test_bad_pet_value_names_the_variable():
    with pytest.raises(ConfigError, match=KUBEFLOW.MASTER_PORT):
        parse("x", env={KUBEFLOW.MASTER_PORT: "abc"})


def test_standalone_ignores_pet_port():
    assert parse("--standalone", "x", env={KUBEFLOW.MASTER_PORT: "23456"}).master_port == 0


# --------------------------------------------------------------------------- ranks filter / prefix


def test_parse_ranks():
    assert parse_ranks("0,3") == {0, 3}
    assert parse_ranks("0-2, 5") == {0, 1, 2, 5}
    for bad in ("a", "3-1", "1,,2", ""):
        with pytest.raises(ConfigError, match="ranks-filter"):
            parse_ranks(bad)


def test_ranks_filter_checked_against_world_size():
    c = parse("--nproc-per-node", "4", "--ranks-filter", "0,3", "x")
    assert c.shows_rank(0) and c.shows_rank(3) and not c.shows_rank(1)
    with pytest.raises(ConfigError, match=r"rank\(s\) \[4\]"):
        parse("--nproc-per-node", "4", "--ranks-filter", "4", "x")


def test_log_dir_hides_console_unless_tee():
    assert not parse("--log-dir", "d", "x").shows_rank(0)
    assert parse("--log-dir", "d", "--tee", "x").shows_rank(0)


def test_prefix_format():
    c = parse("--prefix-format", "{host}/{local_rank}> ", "--nproc-per-node", "2", "x")
    assert c.format_prefix(1, "h") == "h/1> "
    assert parse("--no-prefix", "x").format_prefix(0, "h") == ""
    with pytest.raises(ConfigError, match="prefix-format"):
        parse("--prefix-format", "{nope}", "x")


# --------------------------------------------------------------------------- worker env


def _env(cfg: LaunchConfig, local: int, **kw) -> dict[str, str]:  # type: ignore[no-untyped-def]
    args = dict(master_port=4242, secret="sekrit", hostname="h1", error_file="/e/rank.json", base={})
    args.update(kw)
    return worker_env(cfg, local, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("node_rank", [0, 1, 2])
def test_env_for_node_ranks(node_rank):
    cfg = LaunchConfig(entrypoint="x", nproc_per_node=4, nnodes=3, node_rank=node_rank, master_addr="m", run_id="j")
    ranks = []
    for local in range(4):
        e = _env(cfg, local, restart_count=2)
        rank = node_rank * 4 + local
        ranks.append(int(e[ENV.RANK]))
        assert e[ENV.RANK] == e[ENV.ROLE_RANK] == str(rank)
        assert e[ENV.LOCAL_RANK] == str(local)
        assert e[ENV.WORLD_SIZE] == e[ENV.ROLE_WORLD_SIZE] == "12"
        assert e[ENV.LOCAL_WORLD_SIZE] == "4"
        assert e[ENV.GROUP_RANK] == e[ENV.NODE_RANK] == str(node_rank)
        assert e[ENV.GROUP_WORLD_SIZE] == "3"
        assert e[ENV.ROLE_NAME] == "default"
        assert (e[ENV.MASTER_ADDR], e[ENV.MASTER_PORT]) == ("m", "4242")
        assert e[ENV.TORCHELASTIC_RUN_ID] == e[ENV.RUN_ID] == "j"
        assert e[ENV.TORCHELASTIC_RESTART_COUNT] == e[ENV.RESTART_COUNT] == "2"
        assert e[ENV.TORCHELASTIC_MAX_RESTARTS] == "0"
        assert e[ENV.TORCHELASTIC_ERROR_FILE] == e[ENV.ERROR_FILE] == "/e/rank.json"
        # MASTER_PORT is the workers' rank 0's own store (torch's rank 0 binds it), not the launcher's
        assert e[ENV.SECRET] == "sekrit" and e[ENV.STORE_HOSTED] == "0" and e[ENV.HOSTNAME] == "h1"
        assert e["PYTHONUNBUFFERED"] == "1" and e["OMP_NUM_THREADS"] == "1"
        assert set(TORCHRUN.VARS) <= set(e)
    assert ranks == list(range(node_rank * 4, node_rank * 4 + 4))


def test_env_keeps_user_values_it_does_not_own_and_overrides_stale_ones():
    cfg = LaunchConfig(entrypoint="x", nproc_per_node=2)
    e = _env(cfg, 1, base={"OMP_NUM_THREADS": "8", "RANK": "99", "HOME": "/home/u"})
    assert e["OMP_NUM_THREADS"] == "8" and e["HOME"] == "/home/u" and e[ENV.RANK] == "1"


def test_env_rejects_bad_local_rank():
    with pytest.raises(ConfigError):
        _env(LaunchConfig(entrypoint="x", nproc_per_node=2), 2)


def test_launch_config_validates_directly():
    with pytest.raises(ConfigError, match="no program"):
        LaunchConfig(entrypoint="")
    with pytest.raises(ConfigError, match="--standalone"):
        LaunchConfig(entrypoint="x", master_port=0)


# --------------------------------------------------------------------------- the procgroup command


def test_procgroup_env_lists_the_table(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for v in ENV.table():
        assert v.name in out


def test_procgroup_dispatches_run_env_and_bench():
    from procgroup.__main__ import COMMANDS

    assert {"run", "env", "bench"} <= set(COMMANDS)


def test_unknown_command(capsys):
    assert main(["runn"]) == 2
    assert "unknown command 'runn'" in capsys.readouterr().err


def test_run_config_error_exit_2(capsys):
    assert main(["run", "--nproc-per-node", "0", "x"]) == 2
    assert "procgroup run: error: --nproc-per-node" in capsys.readouterr().err


def test_multi_node_needs_shared_secret(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(ENV.SECRET, raising=False)
    # with a home directory the per-user secret file is the shared secret (test_secretfile.py); without one:
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    prog = tmp_path / "train.py"
    prog.write_text("")
    assert main(["run", "--nnodes", "2", "--node-rank", "1", str(prog)]) == 1
    err = capsys.readouterr().err
    assert ENV.SECRET in err and "--secret-file" in err and "--hostfile" in err


def test_secret_file_is_read(tmp_path):
    from procgroup.launcher.agent import LocalAgent

    f = tmp_path / "secret"
    f.write_text("from-file\n")
    cfg = LaunchConfig(entrypoint="x", nnodes=2, node_rank=1, secret_file=str(f))
    assert LocalAgent(cfg, environ={})._secret(False) == "from-file"
    assert LocalAgent(cfg, environ={ENV.SECRET: "env"})._secret(False) == "env"
    with pytest.raises(ConfigError, match="no such file"):
        LocalAgent(LaunchConfig(entrypoint="x", secret_file=str(tmp_path / "nope")), environ={})._secret()


def test_missing_script_is_reported_before_anything_starts(capsys, tmp_path):
    assert main(["run", "--standalone", str(tmp_path / "nope.py")]) == 1
    assert "nope.py" in capsys.readouterr().err


def test_secret_user_value_wins_else_fresh_per_job():
    from procgroup.launcher.agent import LocalAgent

    cfg = LaunchConfig(entrypoint="x")
    assert LocalAgent(cfg, environ={ENV.SECRET: "mine"})._secret() == "mine"
    a, b = LocalAgent(cfg, environ={})._secret(), LocalAgent(cfg, environ={})._secret()
    assert a != b and len(a) == 64


def test_run_id_is_random_hex_per_job():
    a, b = parse("train.py").run_id, parse("train.py").run_id
    assert a != b and len(a) == 12 and int(a, 16) >= 0


def test_agent_shm_precheck_matches_the_transport_naming(tmp_path, monkeypatch):
    """The agent skips importing the shm transport when /dev/shm holds no procgroup segment at all;
    that test must cover every name the transport can give a segment."""
    from procgroup.launcher import agent
    from procgroup.transport import shm

    assert agent.SHM_DIR == shm.SHM_DIR
    for job in ("0a1b2c3d4e5f/0", "run id with spaces/3", "", "x" * 200):
        assert shm.segment_prefix(job).startswith(agent.SHM_SEGMENT_PREFIX)
    monkeypatch.setattr(agent, "SHM_DIR", str(tmp_path))
    assert not agent._any_shm_segment()
    (tmp_path / "vader_segment.1").write_bytes(b"")
    assert not agent._any_shm_segment()
    (tmp_path / (shm.segment_prefix("job/0") + "r0")).write_bytes(b"")
    assert agent._any_shm_segment()
    monkeypatch.setattr(agent, "SHM_DIR", str(tmp_path / "missing"))
    assert not agent._any_shm_segment()


def test_fresh_secret_has_the_protocol_format():
    from procgroup.launcher.agent import LocalAgent
    from procgroup.protocol.auth import new_secret

    mine = LocalAgent(LaunchConfig(entrypoint="x"), environ={})._secret()
    assert len(mine) == len(new_secret()) == 64 and int(mine, 16) >= 0


# --------------------------------------------------------------------------- --cpu-bind


def test_cpu_binding_binds_only_workers_that_outnumber_the_cpus():
    from procgroup.launcher.config import cpu_binding

    assert cpu_binding(2, (0, 1), "auto") is None  # a CPU each: nothing to stack, left to the scheduler
    assert cpu_binding(3, (5, 3), "auto") == [(3,), (5,), (3,)]  # round-robin over the sorted CPUs
    assert cpu_binding(5, (0, 1), "auto") == [(0,), (1,), (0,), (1,), (0,)]
    assert cpu_binding(1, (7,), "auto") is None and cpu_binding(2, (7,), "auto") == [(7,), (7,)]
    assert cpu_binding(8, (0, 1), "none") is None
    assert cpu_binding(8, (), "auto") is None  # the platform could not say which CPUs: bind nothing
    with pytest.raises(ConfigError, match="--cpu-bind 'core' must be one of auto, none"):
        cpu_binding(3, (0, 1), "core")


def test_cpu_bind_flag_env_and_default():
    assert parse("train.py").cpu_bind == "auto"
    assert parse("--cpu-bind", "none", "train.py").cpu_bind == "none"
    assert parse("train.py", env={ENV.CPU_BIND: "None "}).cpu_bind == "none"
    assert parse("--cpu-bind", "auto", "train.py", env={ENV.CPU_BIND: "none"}).cpu_bind == "auto"  # the flag wins
    with pytest.raises(ConfigError, match="PROCGROUP_CPU_BIND"):
        parse("train.py", env={ENV.CPU_BIND: "cores"})
    with pytest.raises(SystemExit):
        parse("--cpu-bind", "cores", "train.py")


def test_bootstrap_binds_before_the_program_and_survives_a_cpu_it_may_not_use(capsys):
    from procgroup.launcher import bootstrap

    assert bootstrap._parse(["--cpus", "0,1", "--parent-pid", "7", "t.py", "--cpus", "9"]).cpus == "0,1"
    before = os.sched_getaffinity(0)
    try:
        mine = min(before)
        assert bootstrap.bind_cpus(str(mine)) and os.sched_getaffinity(0) == {mine}
        assert not bootstrap.bind_cpus("100000") and os.sched_getaffinity(0) == {mine}  # no such CPU: left alone
        assert not bootstrap.bind_cpus("x")
    finally:
        os.sched_setaffinity(0, before)
    err = capsys.readouterr().err
    assert "not bound to CPUs '100000'" in err and "running unbound" in err
