"""``procgroup top`` without a job: the status record (telemetry), the verdicts, the table, the run-info files,
and ``procgroup run --local-rank-arg``'s argv."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from procgroup.config import ENV, RuntimeConfig, top_interval
from procgroup.errors import ConfigError
from procgroup.flight import FlightRecord
from procgroup.launcher import top
from procgroup.launcher.attempt import worker_specs
from procgroup.launcher.cli import parse_args
from procgroup.launcher.config import LaunchConfig, Placement
from procgroup.launcher.hosts import agent_argv
from procgroup.launcher.runinfo import RunInfo, find_run, publish_run, running_jobs, write_run_info
from procgroup.telemetry import Publisher, build_record, start_publisher, top_key
from procgroup.transport.memory import MemoryHub, MemoryTransport
from procgroup.watchdog import GroupStatus

NOW = 1000.0  # monotonic clock of the flight records
WALL = 1_700_000_000.0


def _group(gid=0, ranks=(0, 1, 2, 3), inflight=None, last=-1, flight=(), name="WORLD", member=True):
    return GroupStatus(
        gid=gid,
        name=name,
        ranks=tuple(ranks),
        member=member,
        closed=False,
        inflight=inflight,
        last_completed=last,
        chain=(),
        flight=tuple(flight),
    )


def _rec(rank, world=4, **kw):
    base = dict(now=NOW, wall=WALL, interval=1.0, sent=0, bps=0.0, rss=1 << 20, cpu=1.0)
    base.update(kw.pop("counters", {}))
    return build_record(rank, world, "h1", 100 + rank, kw.pop("groups"), **base)


def _in_op(rank, seq, secs, world=4, gid=0, ranks=(0, 1, 2, 3), name="WORLD"):
    r = FlightRecord(seq, "all_reduce", ("all_reduce", "float32", 4, "SUM"), NOW - secs)
    done = [FlightRecord(q, "all_reduce", ("all_reduce",), NOW - 50, NOW - 49, "completed") for q in range(seq)]
    return _rec(rank, world, groups=[_group(gid, ranks, r, seq - 1, done + [r], name)])


def _computing(rank, last, idle, world=4, gid=0, ranks=(0, 1, 2, 3), name="WORLD"):
    rec = FlightRecord(last, "all_reduce", ("all_reduce",), NOW - idle - 0.1, NOW - idle, "completed")
    return _rec(rank, world, groups=[_group(gid, ranks, None, last, [rec], name)])


# ------------------------------------------------------------------------------------------------ telemetry


def test_record_in_a_collective():
    rec = _in_op(1, seq=5, secs=2.5)
    assert rec["v"] == 1 and rec["rank"] == 1 and rec["world"] == 4 and rec["pid"] == 101
    assert rec["state"] == "op"
    assert rec["op"] == {
        "name": "all_reduce",
        "sig": "all_reduce(float32, 4, SUM)",
        "group": "WORLD",
        "gid": 0,
        "seq": 5,
        "secs": 2.5,
        "members": None,  # the group of every rank
    }
    assert rec["g"] == {"0": [4, 5]}
    assert rec["last"] == 4
    json.dumps(rec)  # JSON-able


def test_record_between_collectives_and_after_a_failure():
    rec = _computing(2, last=4, idle=3.0)
    assert rec["state"] == "compute" and rec["op"] is None and rec["idle"] == 3.0 and rec["g"] == {"0": [4, None]}
    failed = FlightRecord(5, "all_reduce", ("all_reduce",), NOW - 2, NOW - 1, "failed")
    rec = _rec(0, groups=[_group(inflight=None, last=4, flight=[failed])])
    assert rec["state"] == "failed"


def test_record_picks_the_oldest_collective_in_flight_and_names_subgroup_members():
    old = FlightRecord(7, "barrier", ("barrier",), NOW - 9)
    new = FlightRecord(2, "all_reduce", ("all_reduce",), NOW - 1)
    groups = [
        _group(0, inflight=new, last=1),
        _group(3, ranks=(1, 3), inflight=old, last=6, name="pairs"),
        _group(4, ranks=(0, 2), member=False, name="other"),
    ]
    rec = _rec(1, groups=groups)
    assert rec["op"]["gid"] == 3 and rec["op"]["members"] == [1, 3] and rec["op"]["secs"] == 9.0
    assert set(rec["g"]) == {"0", "3"}  # not the group this rank is no member of


class _Store:
    def __init__(self):
        self.data = {}

    def set(self, k, v):
        self.data[k] = v


def test_publisher_writes_rates_from_its_counters():
    sent = [0]
    store = _Store()
    pub = Publisher(store, 3, 4, "h1", lambda: [_group()], lambda: sent[0], interval=0.5)
    pub.tick()
    first = json.loads(store.data[top_key(3)])
    assert first["bps"] is None and first["cpu"] is None and first["rss"] > 0 and first["pid"] == os.getpid()
    sent[0] = 1 << 20
    time.sleep(0.05)
    pub.tick()
    second = json.loads(store.data[top_key(3)])
    assert second["bytes"] == 1 << 20 and second["bps"] > 1 << 20  # 1 MiB in well under a second
    assert second["cpu"] is not None and second["cpu"] >= 0


def test_publisher_thread_publishes_at_once_and_stops():
    store = _Store()

    class W:
        rank, size, hostnames, on_close = 0, 1, ["hx"], []
        transport = MemoryTransport(MemoryHub(1), 0)

    pub = start_publisher(store, W, lambda: [_group(ranks=(0,))], 0.05)
    assert pub is not None and W.on_close
    deadline = time.monotonic() + 5
    while top_key(0) not in store.data and time.monotonic() < deadline:
        time.sleep(0.01)
    W.on_close[0]()
    assert json.loads(store.data[top_key(0)])["host"] == "hx"
    assert start_publisher(store, W, lambda: [], 0.0) is None  # PROCGROUP_TOP_INTERVAL=0: no thread


def test_top_interval_from_the_environment():
    assert top_interval({}) == 1.0
    assert top_interval({ENV.TOP_INTERVAL: "0"}) == 0.0
    assert RuntimeConfig.load({ENV.TOP_INTERVAL: "0.25"}).top_interval == 0.25
    for bad in ("-1", "soon"):
        with pytest.raises(ConfigError, match=ENV.TOP_INTERVAL):
            top_interval({ENV.TOP_INTERVAL: bad})


@pytest.mark.parametrize("kind", ["shm", "tcp", "router"])
def test_the_transport_counts_bytes_sent(kind):
    import uuid  # noqa: PLC0415

    from tests.unit.test_transport_conformance import _form, run_ranks  # noqa: PLC0415

    ts = _form(kind, 2, f"top-{uuid.uuid4().hex[:10]}")
    try:

        def body(t):
            if t.rank == 0:
                t.send(0, 1, b"12345")  # to itself: nothing moved
                t.send(1, 2, bytes(1000))
            else:
                t.recv(0, 2, bytearray(1000))
            arena = t.arena(7, [0, 1])
            if arena is not None:
                arena.exchange(memoryview(bytes(100)), 1, None)
                return 100
            return 0

        extra = run_ranks(ts, body)
        assert [t.sent_bytes() for t in ts] == [1000 + extra[0], extra[1]]
    finally:
        for t in ts:
            t.close()


# ------------------------------------------------------------------------------------------------ verdicts


def _stalled_world(waited=5.0, stalled=2):
    """Ranks other than ``stalled`` wait in all_reduce seq 5; ``stalled`` finished seq 4 and is computing."""
    return {r: (_computing(r, 4, waited) if r == stalled else _in_op(r, 5, waited)) for r in range(4)}


def test_assess_names_the_rank_the_others_wait_for():
    why = top.assess(_stalled_world(), 4, WALL)
    assert list(why) == [2]
    assert why[2] == "ranks 0, 1, 3 have waited 5.0s for it in all_reduce(float32, 4, SUM) (seq 5, group WORLD)"


def test_assess_is_quiet_below_the_threshold_and_when_all_wait_together():
    assert top.assess(_stalled_world(waited=1.0), 4, WALL) == {}
    together = {r: _in_op(r, 5, 30.0) for r in range(4)}
    assert top.assess(together, 4, WALL) == {}
    progressing = {r: _computing(r, 9, 0.01) for r in range(4)}
    assert top.assess(progressing, 4, WALL) == {}


def test_assess_uses_the_group_of_the_collective():
    # ranks 1 and 3 form a group; 1 waits in its seq 2, 3 is still at seq 1 of that group; 0 and 2 are idle
    recs = {
        0: _computing(0, 4, 0.1),
        1: _in_op(1, 2, 10.0, gid=3, ranks=(1, 3), name="pairs"),
        2: _computing(2, 4, 0.1),
        3: _computing(3, 1, 10.0, gid=3, ranks=(1, 3), name="pairs"),
    }
    why = top.assess(recs, 4, WALL)
    assert list(why) == [3] and "rank 1 has waited 10.0s" in why[3] and "group pairs" in why[3]


def test_assess_stale_missing_and_failed_records():
    recs = _stalled_world(waited=0.5)
    recs[1] = dict(recs[1], t=WALL - 60)  # its last record is a minute old
    del recs[3]
    recs[0] = dict(recs[0], state="failed", op=None)
    why = top.assess(recs, 4, WALL)
    assert why[1].startswith("no status record for 60.0s")
    assert "has not published" in why[3]
    assert why[0] == "its last collective failed"
    assert 2 not in why


def test_assess_rank_left_behind_in_a_collective_the_others_completed():
    recs = {r: _computing(r, 5, 0.2) for r in range(4)}
    recs[2] = _in_op(2, 5, 8.0)
    why = top.assess(recs, 4, WALL)
    assert list(why) == [2] and "after every other member completed it" in why[2]


# ------------------------------------------------------------------------------------------------ table


def _snapshot(recs, world=4):
    target = top.Target("127.0.0.1", 29500, "s", run_id="abc")
    return top.Snapshot(
        target, WALL, world, top.make_rows(recs, world, WALL), top.assess(recs, world, WALL), top.DEFAULT_STUCK_AFTER
    )


def test_render_plain_marks_the_stuck_rank_and_says_why():
    lines = top.render(_snapshot(_stalled_world()))
    assert lines[0].startswith("procgroup top - run abc - store 127.0.0.1:29500 - 4 ranks - ")
    assert lines[1].split() == ["RANK", "HOST", "PID", "STATE", "OP", "GROUP", "SEQ", "TIME", "SENT/s", "RSS", "CPU%"]
    rows = lines[2:6]
    assert [r.split()[0] for r in rows] == ["0", "1", "!", "3"]
    assert rows[2].split()[1:5] == ["2", "h1", "102", "compute"]
    assert rows[0].split()[0:5] == ["0", "h1", "100", "op", "all_reduce(float32,"]
    assert "WORLD" in rows[0] and " 5 " in rows[0] and "5.0s" in rows[0] and "1.0M" in rows[0]
    assert lines[-1] == "! rank 2: " + top.assess(_stalled_world(), 4, WALL)[2]
    assert not any("\x1b" in line for line in lines)


def test_render_color_highlights_only_the_stuck_row_and_fits_the_width():
    lines = top.render(_snapshot(_stalled_world()), width=80, color=True)
    hl = [i for i, line in enumerate(lines) if line.startswith(top.HIGHLIGHT)]
    assert hl == [4]  # header, column titles, ranks 0, 1, then rank 2
    assert lines[4].endswith(top.RESET)
    assert all(len(line.replace(top.HIGHLIGHT, "").replace(top.RESET, "")) <= 80 for line in lines)


def test_render_missing_ranks_and_units():
    lines = top.render(_snapshot({}, world=2))
    assert lines[-1] == "no rank has published a status record yet"
    assert [top._bytes(n) for n in (None, 0, 1023, 1536, 5 << 30)] == ["-", "0B", "1023B", "1.5K", "5.0G"]
    assert [top._secs(s) for s in (None, 3.21, 125, 7300)] == ["-", "3.2s", "2m05s", "2h01m"]


def test_snapshot_json_lists_the_stuck_rank():
    doc = top.snapshot_json(_snapshot(_stalled_world()))
    json.dumps(doc)
    assert doc["run_id"] == "abc" and doc["world_size"] == 4 and doc["store"] == "127.0.0.1:29500"
    assert [s["rank"] for s in doc["stuck"]] == [2]
    assert [r["stuck"] for r in doc["ranks"]] == [False, False, True, False]
    assert doc["ranks"][0]["state"] == "op" and doc["ranks"][0]["seq"] == 5 and doc["ranks"][2]["seq"] == 4


# ------------------------------------------------------------------------------------------------ run-info


def _info(run_id="r1", pid=None, port=29500):
    return RunInfo(run_id, "127.0.0.1", port, "sec", 4, 1, 0, pid or os.getpid(), "h1", time.time())


def test_run_info_is_private_and_found_by_run_id(tmp_path):
    env = {ENV.RUNTIME_DIR: str(tmp_path / "rt dir é")}
    path = write_run_info(_info(), env)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    got = find_run("r1", env)
    assert got.store == "127.0.0.1:29500" and got.secret == "sec" and got.world_size == 4
    assert find_run(None, env).run_id == "r1"  # the only job
    with pytest.raises(ConfigError, match="no running job with run id 'zz'"):
        find_run("zz", env)


def test_run_info_stale_files_are_removed_and_several_jobs_are_listed(tmp_path):
    env = {ENV.RUNTIME_DIR: str(tmp_path)}
    dead = write_run_info(_info("gone", pid=999_999_999), env)
    write_run_info(_info("a"), env)
    write_run_info(_info("b", pid=os.getppid()), env)
    assert [j.run_id for j in running_jobs(env)] == ["a", "b"]
    assert not os.path.exists(dead)
    with pytest.raises(ConfigError, match="2 running jobs; give its run id"):
        find_run(None, env)


def test_run_info_refuses_a_directory_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(ConfigError, match=ENV.RUNTIME_DIR):
        running_jobs({ENV.RUNTIME_DIR: str(d)})


def test_publish_run_warns_once_and_never_fails_the_job(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    said = []
    cfg = LaunchConfig(entrypoint="x.py", run_id="r9", nproc_per_node=2)
    pl = Placement.uniform(cfg, 1234)
    env = {ENV.RUNTIME_DIR: str(blocker / "sub")}
    got = publish_run(None, cfg, pl, secret="s", restart=0, agent_pid=1, host="h", environ=env, warn=said.append)
    assert got is None and len(said) == 1 and "procgroup top r9" in said[0]
    env = {ENV.RUNTIME_DIR: str(tmp_path / "ok")}
    got = publish_run(None, cfg, pl, secret="s", restart=0, agent_pid=os.getpid(), host="h", environ=env, warn=print)
    again = publish_run(got, cfg, pl, secret="s", restart=1, agent_pid=os.getpid(), host="h", environ=env, warn=print)
    assert got == again and find_run("r9", env).restart == 1 and find_run("r9", env).world_size == 2


def test_top_command_line_errors(tmp_path, capsys):
    env = {ENV.RUNTIME_DIR: str(tmp_path)}
    assert top.main(["--once", "nosuch"], env) == 1
    assert "no running job with run id 'nosuch'" in capsys.readouterr().err
    assert top.main(["--once", "--store", "127.0.0.1:1"], env) == 1
    assert f"set {ENV.SECRET}" in capsys.readouterr().err
    assert top.main(["--list"], env) == 0
    assert "no running jobs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        top.main(["--once", "--json"], env)
    assert e.value.code == 2


# ------------------------------------------------------------------------------------------------ --local-rank-arg


@pytest.mark.parametrize(
    "flags, form",
    [
        ([], None),
        (["--local-rank-arg"], "dash"),
        (["--local-rank-arg=dash"], "dash"),
        (["--local-rank-arg=underscore"], "underscore"),
        (["--local-rank-arg", "underscore"], "underscore"),
        (["--local-rank-arg", "--nproc-per-node", "2"], "dash"),
        (["--nproc-per-node", "2", "--local-rank-arg"], "dash"),
        (["--prefix-format", "x", "--local-rank-arg"], "dash"),
    ],
)
def test_local_rank_arg_flag(flags, form):
    cfg = parse_args([*flags, "train.py", "--local-rank-arg", "--lr", "3"], environ={})
    assert isinstance(cfg, LaunchConfig)
    assert cfg.local_rank_arg == form
    assert cfg.entrypoint == "train.py"
    assert cfg.args == ("--local-rank-arg", "--lr", "3")  # the program's own arguments are untouched


def test_local_rank_arg_bad_form():
    with pytest.raises(ConfigError, match="--local-rank-arg=underscore"):
        parse_args(["--local-rank-arg=dots", "train.py"], environ={})


def _specs(cfg: LaunchConfig, tmp_path, cpus: tuple[int, ...] = ()) -> list:  # type: ignore[no-untyped-def]
    """The worker blueprints of generation 0 of a one-node ``cfg`` whose agent may use ``cpus``."""
    return worker_specs(
        cfg,
        secret="s",
        restart=0,
        placement=Placement.uniform(cfg, 1234),
        hostname="h",
        environ={},
        error_dir=str(tmp_path),
        agent_pid=1,
        tty=None,
        cpus=cpus,
    )


@pytest.mark.parametrize("form, option", [(None, None), ("dash", "--local-rank"), ("underscore", "--local_rank")])
def test_local_rank_arg_goes_after_the_program_before_its_arguments(tmp_path, form, option):
    cfg = LaunchConfig(entrypoint="train.py", args=("--lr", "3"), nproc_per_node=2, local_rank_arg=form)
    specs = _specs(cfg, tmp_path)
    for local, spec in enumerate(specs):
        tail = list(spec.argv[spec.argv.index("--") + 1 :])
        mid = [f"{option}={local}"] if option else []
        assert tail == ["train.py", *mid, "--lr", "3"]
        assert spec.env[ENV.LOCAL_RANK] == str(local)  # the environment carries it too
    a = agent_argv(cfg, node_rank=1, nnodes=2, nproc=2, master_addr="h0", master_port=1, run_id="r")
    assert (f"--local-rank-arg={form}" in a) == (form is not None)
    assert a[-3:] == ["train.py", "--lr", "3"]


def test_worker_specs_pass_the_binding_to_the_bootstrap_and_the_head_forwards_the_mode(tmp_path):
    """--cpu-bind auto: the bootstrap of each worker gets ``--cpus`` where the workers outnumber the agent's CPUs;
    the head node passes the mode to every host's agent."""

    def cpus(cfg: LaunchConfig, usable: tuple[int, ...]) -> list[object]:
        out: list[object] = []
        for spec in _specs(cfg, tmp_path, usable):
            head = list(spec.argv[: spec.argv.index("--")])
            out.append(head[head.index("--cpus") + 1] if "--cpus" in head else None)
        return out

    cfg = LaunchConfig(entrypoint="train.py", nproc_per_node=3)
    assert cpus(cfg, (0, 1)) == ["0", "1", "0"]
    assert cpus(cfg, (0, 1, 2, 3)) == [None, None, None]
    assert cpus(LaunchConfig(entrypoint="train.py", nproc_per_node=3, cpu_bind="none"), (0, 1)) == [None] * 3
    for mode in ("auto", "none"):
        c = LaunchConfig(entrypoint="train.py", nproc_per_node=3, cpu_bind=mode)
        a = agent_argv(c, node_rank=1, nnodes=2, nproc=3, master_addr="h0", master_port=1, run_id="r")
        assert a[a.index("--cpu-bind") + 1] == mode and a[-1] == "train.py"
