"""Multi-node launcher logic without processes: the agents' rendezvous decision, hostfiles, the env
forwarding policy, the remote command line, srun detection, result transport and combination, and the
gang protocol itself with agents as threads over a real local store."""

from __future__ import annotations

import json
import os
import shlex
import stat
import threading
import time

import pytest

from procgroup.config import ENV
from procgroup.deadline import Deadline
from procgroup.errors import ConfigError, DistTimeoutError, RendezvousError
from procgroup.identity import derive_port
from procgroup.launcher import gang as gang_mod
from procgroup.launcher.cli import LaunchConfig, Placement, parse_args, worker_env
from procgroup.launcher.gang import AgentInfo, Gang, assign, format_mapping
from procgroup.launcher.hosts import EnvPolicy, HeadConfig, agent_argv, parse_hostfile, remote_command, ssh_argv
from procgroup.launcher.report import (
    RunResult,
    WorkerResult,
    combine_results,
    format_root_cause,
    format_summary,
    result_from_json,
    result_to_json,
)
from procgroup.launcher.slurm import detect_srun_step, read_secret_file, wait_secret_file, write_secret_file

from .test_identity import env_of

T0 = 1_000_000.0


def info(host: str, node=None, *, store=False, nproc=2, nnodes=3, port=None, run_id="j", pid=1):  # type: ignore[no-untyped-def]
    return AgentInfo(
        host=host,
        pid=pid,
        nproc=nproc,
        nnodes=nnodes,
        run_id=run_id,
        max_restarts=0,
        node_rank=node,
        hosts_store=store,
        worker_port=port if port is not None else (4000 if store else None),
    )


# --------------------------------------------------------------------------- assign (decide)


def test_assign_explicit_ranks_any_join_order():
    infos = [info("c", 2), info("a", 0, store=True), info("b", 1)]
    a = assign(infos, 3)
    assert [(n.node_rank, n.host, n.slot, n.rank_offset) for n in a.nodes] == [
        (0, "a", 1, 0),
        (1, "b", 2, 2),
        (2, "c", 0, 4),
    ]
    assert a.world_size == 6 and a.worker_port == 4000 and a.hosts == ["a", "b", "c"]


def test_assign_without_ranks_master_first_then_by_host_name():
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        pool = [info("h1", store=True), info("h3"), info("h2")]
        a = assign([pool[i] for i in order], 3)
        assert a.hosts == ["h1", "h2", "h3"], order


def test_assign_mixed_explicit_and_auto():
    infos = [info("z", nnodes=4), info("m", 0, store=True, nnodes=4), info("a", 2, nnodes=4), info("b", nnodes=4)]
    a = assign(infos, 4)
    assert a.hosts == ["m", "b", "a", "z"]


def test_assign_uneven_slots_number_ranks_node_by_node():
    a = assign([info("h1", 0, store=True, nproc=3), info("h2", 1, nproc=1), info("h3", 2, nproc=2)], 3)
    assert [n.rank_offset for n in a.nodes] == [0, 3, 4] and a.world_size == 6
    pl = a.placement(1, "h1")
    assert (pl.rank(0), pl.world_size, pl.local_world_size, pl.master_port) == (3, 6, 1, 4000)


@pytest.mark.parametrize(
    "infos, match",
    [
        ([info("a", 0, store=True), info("b", 1), info("c", 1)], r"--node-rank 1 was given to two nodes: b .* and c"),
        ([info("a", store=True), info("b"), info("b")], r"2 agents on host b have no --node-rank"),
        ([info("a", 0, store=True), info("b", 1, nnodes=4), info("c", 2)], r"disagree on --nnodes"),
        ([info("a", 0, store=True), info("b", 1, run_id="x"), info("c", 2)], r"disagree on --run-id .*b: x"),
        ([info("a", 0, store=True), info("b", 1, store=True), info("c", 2)], r"2 agents claim to host the store"),
        ([info("a", 0), info("b", 1, store=True), info("c", 2)], r"has --node-rank 0 but b .* hosts the store"),
        ([info("a", 0, store=True), info("b", 5), info("c", 2)], r"--node-rank 5, out of range 0..2"),
        ([info("a", 0, store=True, port=0), info("b", 1), info("c", 2)], r"did not publish the workers' port"),
    ],
)
def test_assign_errors_name_the_nodes_and_the_fix(infos, match):
    with pytest.raises(RendezvousError, match=match):
        assign(infos, 3)


def test_format_mapping_lists_every_rank_once():
    a = assign([info("h1", 0, store=True, nnodes=2), info("h2", 1, nnodes=2)], 2)
    s = format_mapping(a, {0: [[1, 1, 11], [0, 0, 10]], 1: [[2, 0, 20], [3, 1, 21]]}, run_id="r", restart=1)
    lines = s.splitlines()
    assert lines[0] == "procgroup run: 4 workers on 2 nodes (run id r, restart 1):"
    assert [ln.split() for ln in lines[2:]] == [
        ["0", "0", "h1", "0", "10"],
        ["1", "0", "h1", "1", "11"],
        ["2", "1", "h2", "0", "20"],
        ["3", "1", "h2", "1", "21"],
    ]


# --------------------------------------------------------------------------- worker env with a placement


def test_worker_env_from_a_placement_and_store_not_hosted():
    cfg = LaunchConfig(entrypoint="x", nnodes=3, node_rank=None, master_addr="h1", master_port=29400)
    pl = Placement(
        node_rank=2, nnodes=3, rank_offset=5, world_size=7, local_world_size=2, master_addr="h1", master_port=4242
    )
    e = worker_env(cfg, 1, master_port=0, secret="s", hostname="h3", error_file="/e", base={}, placement=pl)
    assert (e[ENV.RANK], e[ENV.LOCAL_RANK], e[ENV.WORLD_SIZE], e[ENV.LOCAL_WORLD_SIZE]) == ("6", "1", "7", "2")
    assert (e[ENV.GROUP_RANK], e[ENV.NODE_RANK], e[ENV.GROUP_WORLD_SIZE]) == ("2", "2", "3")
    assert (e[ENV.MASTER_ADDR], e[ENV.MASTER_PORT], e[ENV.STORE_HOSTED]) == ("h1", "4242", "0")
    with pytest.raises(ConfigError):
        worker_env(cfg, 2, master_port=0, secret="s", hostname="h3", error_file="/e", base={}, placement=pl)


def test_worker_env_tty_for_breakpoint():
    cfg = LaunchConfig(entrypoint="x")
    kw = dict(master_port=1, secret="s", hostname="h", error_file="/e")
    assert worker_env(cfg, 0, base={}, tty="/dev/pts/3", **kw)[ENV.TTY] == "/dev/pts/3"  # type: ignore[arg-type]
    assert ENV.TTY not in worker_env(cfg, 0, base={ENV.TTY: "/dev/pts/9"}, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- hostfile


def test_hostfile_comments_blanks_and_default_slots():
    text = "# cluster\n\nh1 slots=4  # big\n  me@h2\nh3 slots=1 max_slots=8\n"
    hs = parse_hostfile(text, 2)
    assert [(h.host, h.slots, h.line) for h in hs] == [("h1", 4, 3), ("me@h2", 2, 4), ("h3", 1, 5)]
    assert hs[1].name == "h2"


@pytest.mark.parametrize(
    "text, match",
    [
        ("h1\nh1 slots=2\n", r"line 2: host 'h1' is already listed on line 1"),
        ("h1 slots=x\n", r"line 1: 'slots=x': slots must be a whole number"),
        ("h1 slots=0\n", r"slots must be >= 1"),
        ("h1 cpu=2\n", r"line 1: unknown field 'cpu=2'"),
        ("slots=2\n", r"is not a host name"),
        ("# nothing\n\n", r"lists no hosts"),
    ],
)
def test_hostfile_errors_name_the_line(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_hostfile(text, 1, source="hf")


# --------------------------------------------------------------------------- env forwarding


ENVIRON = {
    "PYTHONPATH": "/src",
    "OMP_NUM_THREADS": "4",
    "PROCGROUP_TIMEOUT": "60",
    "PROCGROUP_SECRET": "sekrit",
    "PROCGROUP_HOSTNAME": "here",
    "RANK": "3",
    "MASTER_PORT": "1",
    "HOME": "/root",
    "HOSTNAME": "head",
    "SSH_CONNECTION": "x",
    "NCCL_DEBUG": "INFO",
    "MY_VAR": "a b'c",
}


def test_default_policy_forwards_prefixes_never_identity_or_secret():
    sel = EnvPolicy().select(ENVIRON)
    assert sel == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "PROCGROUP_TIMEOUT": "60", "PYTHONPATH": "/src"}
    line = EnvPolicy().describe(sel, ENVIRON)
    assert "NCCL_DEBUG, OMP_NUM_THREADS, PROCGROUP_TIMEOUT, PYTHONPATH" in line
    assert "sekrit" not in line and "/src" not in line and "PROCGROUP_SECRET goes over" in line


def test_env_names_values_prefixes_and_all():
    p = EnvPolicy(names=("MY_VAR", "X=1", "UNSET_ONE"), prefixes=("OMP_",))
    assert p.select(ENVIRON) == {"OMP_NUM_THREADS": "4", "MY_VAR": "a b'c", "X": "1"}
    assert "not set here, so not forwarded: UNSET_ONE" in p.describe(p.select(ENVIRON), ENVIRON)
    allv = EnvPolicy(everything=True).select(ENVIRON)
    assert "HOME" in allv and "MY_VAR" in allv
    never = {"HOSTNAME", "SSH_CONNECTION", "PROCGROUP_SECRET", "RANK", "MASTER_PORT", "PROCGROUP_HOSTNAME"}
    assert not never & set(allv)


@pytest.mark.parametrize("name", ["RANK", "PROCGROUP_SECRET", "1BAD"])
def test_env_policy_rejects_what_cannot_travel(name):
    with pytest.raises(ConfigError, match=name):
        EnvPolicy(names=(name,))


# --------------------------------------------------------------------------- the remote command


def test_remote_command_quotes_everything_and_carries_no_secret():
    cfg = LaunchConfig(
        entrypoint="my script.py",
        args=("--lr", "0.1", "it's"),
        nnodes=3,
        node_rank=0,
        master_addr="h1",
        master_port=0,
        from_head=True,
        log_dir="/l d",
        tee=True,
        ranks_filter=frozenset({0, 3}),
        prefix_format="[{host}:{rank}] ",
        max_restarts=2,
    )
    argv = agent_argv(cfg, node_rank=1, nnodes=3, nproc=4, master_addr="h1", master_port=5000, run_id="r1")
    cmd = remote_command(cwd="/work dir", env={"PYTHONPATH": "/a b", "MY": "x'y"}, python="/usr/bin/python3", argv=argv)
    toks = shlex.split(cmd)
    assert toks[:6] == ["cd", "/work dir", "&&", "exec", "env", "PYTHONPATH=/a b"]
    assert toks[6:11] == ["MY=x'y", "/usr/bin/python3", "-m", "procgroup", "run"]
    rest = toks[11:]
    assert rest[-4:] == ["my script.py", "--lr", "0.1", "it's"]
    ns = parse_args(rest, environ={})
    assert isinstance(ns, LaunchConfig)
    assert (ns.from_head, ns.nnodes, ns.node_rank, ns.nproc_per_node) == (True, 3, 1, 4)
    assert (ns.master_addr, ns.master_port, ns.run_id, ns.max_restarts) == ("h1", 5000, "r1", 2)
    assert (ns.log_dir, ns.tee, ns.ranks_filter, ns.prefix_format) == (
        "/l d",
        True,
        frozenset({0, 3}),
        "[{host}:{rank}] ",
    )


def test_node0_of_a_head_job_may_ask_for_any_port():
    c = parse_args(["--from-head", "--nnodes", "2", "--node-rank", "0", "--master-port", "0", "x"], environ={})
    assert c.master_port == 0
    with pytest.raises(ConfigError):
        parse_args(["--nnodes", "2", "--node-rank", "0", "--master-port", "0", "x"], environ={})


def test_ssh_argv():
    assert ssh_argv(("ssh", "-F", "cfg"), "h2", "cmd", port=2222, options=("ConnectTimeout=5",)) == [
        "ssh",
        "-F",
        "cfg",
        "-T",
        "-o",
        "BatchMode=yes",
        "-p",
        "2222",
        "-o",
        "ConnectTimeout=5",
        "h2",
        "cmd",
    ]


# --------------------------------------------------------------------------- --hostfile parsing


def test_hostfile_flag_gives_a_head_config(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("h1 slots=2\nh2\nh3 slots=3\n")
    c = parse_args(
        [
            "--hostfile",
            str(hf),
            "--ssh-command",
            "ssh -F my cfg",
            "--ssh-option",
            "A=b",
            "--env",
            "FOO",
            "--env-prefix",
            "X_",
            "t.py",
            "a",
        ],
        environ={},
    )
    assert isinstance(c, HeadConfig)
    assert [h.slots for h in c.hosts] == [2, 1, 3] and c.world_size == 6 and c.master == "h1"
    assert c.ssh_command == ("ssh", "-F", "my", "cfg") and c.ssh_options == ("A=b",)
    assert c.env.names == ("FOO",) and c.env.prefixes == ("X_",)
    assert c.agent.entrypoint == "t.py" and c.agent.args == ("a",) and c.agent.nnodes == 3
    assert c.agent.prefix_format == "[{host}:{rank}] " and c.agent.run_id != "none"
    c2 = parse_args(["--hostfile", str(hf), "--nproc-per-node", "4", "t.py"], environ={})
    assert [h.slots for h in c2.hosts] == [2, 4, 3]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--node-rank", "1"], "--node-rank does not go with --hostfile"),
        (["--nnodes", "2"], "lists 3 host"),
        (["--standalone"], "--standalone does not go"),
        (["--ranks-filter", "9"], "rank\\(s\\) \\[9\\]"),
    ],
)
def test_hostfile_conflicts(tmp_path, extra, match):
    hf = tmp_path / "hosts"
    hf.write_text("h1\nh2\nh3\n")
    with pytest.raises(ConfigError, match=match):
        parse_args(["--hostfile", str(hf), *extra, "t.py"], environ={})


def test_head_flags_need_a_hostfile():
    with pytest.raises(ConfigError, match="use them with --hostfile"):
        parse_args(["--env", "X", "t.py"], environ={})


def test_missing_hostfile():
    with pytest.raises(ConfigError, match="--hostfile '/nope': cannot read it"):
        parse_args(["--hostfile", "/nope", "t.py"], environ={})


# --------------------------------------------------------------------------- srun


def one_task_per_node(rank: int) -> dict:
    """The N3n6 capture of rank 2*rank, turned into `srun -N3 --ntasks-per-node=1`'s task ``rank``."""
    e = env_of("slurm-netns-N3n6.env", rank * 2)
    e.update(
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        SLURM_STEP_TASKS_PER_NODE="1(x3)",
        SLURM_TASKS_PER_NODE="1(x3)",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_NTASKS="3",
        SLURM_NPROCS="3",
        SLURM_GTIDS=str(rank),
    )
    return e


@pytest.mark.parametrize("node", [0, 1, 2])
def test_srun_step_gives_node_rank_master_and_port(node):
    env = one_task_per_node(node)
    assert env["SLURM_NODEID"] == str(node)
    c = parse_args(["--nproc-per-node", "2", "t.py"], environ=env)
    job, step = env["SLURM_JOB_ID"], int(env["SLURM_STEP_ID"])
    assert (c.nnodes, c.node_rank, c.master_addr) == (3, node, "h1")
    assert c.master_port == derive_port(job, step) and c.run_id == f"{job}.{step}" == c.slurm_step
    assert c.prefix_format == "[{host}:{rank}] "
    assert any("SLURM_NODEID" in n for n in c.notes) and any("first host of SLURM_STEP_NODELIST" in n for n in c.notes)


def test_srun_with_several_tasks_per_node_says_ntasks_per_node_1():
    env = env_of("slurm-netns-N3n6.env", 0)
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        parse_args(["t.py"], environ=env)


def test_explicit_flags_or_no_step_turn_srun_detection_off():
    env = one_task_per_node(1)
    c = parse_args(["--nnodes", "2", "--node-rank", "0", "t.py"], environ=env)
    assert (c.nnodes, c.node_rank, c.slurm_step) == (2, 0, None)
    assert parse_args(["--standalone", "t.py"], environ=env).slurm_step is None
    sbatch = {k: v for k, v in env.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    assert detect_srun_step(sbatch) is None


def test_srun_single_node_step_is_standalone():
    env = one_task_per_node(0)
    env.update(SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1", SLURM_STEP_NODELIST="h1", SLURM_STEP_TASKS_PER_NODE="1")
    c = parse_args(["t.py"], environ=env)
    assert c.standalone and c.nnodes == 1 and c.master_port == 0


def test_secret_file_roundtrip_and_wait(tmp_path):
    p = str(tmp_path / ".procgroup-secret-7.0")
    s = write_secret_file(p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and read_secret_file(p) == s and len(s) == 64
    assert write_secret_file(p, "again") == "again" and read_secret_file(p) == "again"  # a stale one is replaced
    assert wait_secret_file(p, Deadline.after(1), lambda: False, time.sleep) == "again"
    with pytest.raises(DistTimeoutError, match="Export PROCGROUP_SECRET before srun"):
        wait_secret_file(str(tmp_path / "none"), Deadline.after(0.3), lambda: False, time.sleep)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret_file(str(tmp_path / "empty"))


# --------------------------------------------------------------------------- results across nodes


def wr(rank, host, rc, end=1.0, *, sig=None, sig_at=None, err_ts=None):  # type: ignore[no-untyped-def]
    error = (
        None
        if err_ts is None
        else {
            "exc_type": "ValueError",
            "message": "boom",
            "timestamp": T0 + err_ts,
            "traceback": "Traceback (most recent call last):\nValueError: boom\n",
        }
    )
    return WorkerResult(
        rank=rank,
        local_rank=rank % 2,
        host=host,
        pid=100 + rank,
        returncode=rc,
        start_time=T0,
        end_time=T0 + end,
        signaled_by_agent=sig,
        signaled_at=sig_at,
        error=error,
        stderr_tail=("a", "b"),
    )


def test_result_json_roundtrip():
    r = RunResult(
        workers=(wr(0, "h1", 0), wr(1, "h1", 1, err_ts=0.5)),
        run_id="j",
        host="h1",
        restart_count=2,
        interrupted_by=None,
        leftovers_killed=("pid 9",),
        agent_errors=("x",),
        start_time=T0,
        end_time=T0 + 2,
    )
    back = result_from_json(result_to_json(r))
    assert back == r
    with pytest.raises(ValueError):
        result_from_json("[1]")


def test_combined_root_cause_is_the_first_failure_on_any_node():
    n0 = RunResult(
        workers=(wr(0, "h1", -15, sig=15, sig_at=T0 + 0.9), wr(1, "h1", -15, sig=15, sig_at=T0 + 0.9)),
        host="h1",
        start_time=T0,
        end_time=T0 + 1,
    )
    n1 = RunResult(
        workers=(wr(2, "h2", 1, end=0.8, err_ts=0.7), wr(3, "h2", 1, end=0.95, err_ts=0.9)),
        host="h2",
        start_time=T0,
        end_time=T0 + 1,
    )
    c = combine_results([n0, n1], hosts=["h1", "h2"], run_id="j", restart_count=0)
    assert c.root_cause is not None and c.root_cause.rank == 2 and c.exit_code == 1 and c.nnodes == 2
    rc = format_root_cause(c)
    assert rc.startswith("### Root cause: rank 2 (local 0) on host h2, pid 102, exit code 1")
    assert "stopped 2 worker(s) on 1 host(s) 0.30s after the root cause" in rc
    assert "rank 0 (local 0) on h1 pid 100: terminated by the launcher (SIGTERM)" in rc
    assert "failed on its own 0.20s after the root cause" in rc
    s = format_summary(c)
    assert s.startswith("procgroup run: 4 worker(s) on 2 nodes (h1, h2) FAILED")


def test_combined_interrupt_and_lost_nodes_are_failures():
    n0 = RunResult(workers=(wr(0, "h1", -2, sig=2, sig_at=T0),), host="h1", interrupted_by=2)
    n1 = RunResult(workers=(wr(1, "h2", -15, sig=15, sig_at=T0),), host="h2")
    c = combine_results([n0, n1], hosts=["h1", "h2"], run_id="j", restart_count=0)
    assert c.exit_code == 130 and c.agent_errors == ("the agent on h1 received SIGINT",)
    lost = combine_results(
        [n0.__class__(workers=(wr(0, "h1", 0),), host="h1")],
        hosts=["h1", "h2"],
        run_id="j",
        restart_count=0,
        extra_errors=["node 1 (h2) stopped answering"],
    )
    assert lost.is_failed() and lost.exit_code == 1
    assert format_root_cause(lost) == "### Root cause: node 1 (h2) stopped answering"


# --------------------------------------------------------------------------- the gang protocol, agents as threads


class Agents:
    """n Gang instances on 127.0.0.1 (node 0 serves), driven from threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.woken = [threading.Event() for _ in range(n)]
        self.gangs = []
        for k in range(n):
            g = Gang(
                host=f"h{k + 1}",
                master_addr="127.0.0.1",
                port=0,
                nnodes=n,
                node0=k == 0,
                join_timeout=10,
                interrupted=lambda: False,
                wakeup=self.woken[k].set,
                progress=lambda m: None,
            )
            self.gangs.append(g)
        self.gangs[0].serve("s3cret", bind_host="127.0.0.1")
        for g in self.gangs[1:]:
            g.port = self.gangs[0].port
        for g in self.gangs:
            g.connect(lambda: "s3cret")

    def join(self, gen: int, ranks=None):  # type: ignore[no-untyped-def]
        out: list = [None] * self.n
        errs: list = [None] * self.n

        def go(k: int) -> None:
            me = AgentInfo(
                host=f"h{k + 1}",
                pid=k,
                nproc=2,
                nnodes=self.n,
                run_id="j",
                max_restarts=0,
                node_rank=None if ranks is None else ranks[k],
                hosts_store=k == 0,
                worker_port=5555 if k == 0 else None,
            )
            try:
                out[k] = self.gangs[k].join(gen, me)
            except BaseException as e:  # noqa: BLE001
                errs[k] = e

        ts = [threading.Thread(target=go, args=(k,)) for k in reversed(range(self.n))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        for e in errs:
            if e is not None:
                raise e
        return out

    def close(self) -> None:
        for k, g in reversed(list(enumerate(self.gangs))):
            g.close(k, None)


@pytest.fixture
def agents():  # type: ignore[no-untyped-def]
    made = []

    def make(n: int) -> Agents:
        a = Agents(n)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


@pytest.mark.timeout(30)
def test_gang_join_failure_record_and_results(agents):
    ag = agents(3)
    joined = ag.join(0)
    assert [node for _, node in joined] == [0, 1, 2]
    assignment = joined[0][0]
    assert all(a == assignment for a, _ in joined) and assignment.worker_port == 5555
    watchers = [g.watch(0, k, assignment) for k, g in enumerate(ag.gangs)]
    rec = {"reason": "rank 3 on h2 failed", "worker": {"rank": 3}}
    ag.gangs[1].report_failure(0, 1, rec)
    for k in (0, 2):
        assert ag.woken[k].wait(5), f"agent {k} was not woken by the failure record"
        assert watchers[k].abort_record == rec
    for k, g in enumerate(ag.gangs):
        g.post_result(
            0, k, RunResult(workers=(wr(2 * k, f"h{k + 1}", 0), wr(2 * k + 1, f"h{k + 1}", 0)), host=f"h{k + 1}")
        )
    got, errors = ag.gangs[2].collect(0, assignment, settle=5)
    assert sorted(got) == [0, 1, 2] and errors == []
    assert [w.rank for n in sorted(got) for w in got[n].workers] == list(range(6))


@pytest.mark.timeout(30)
def test_gang_generations_are_independent_and_ranks_stable(agents):
    ag = agents(2)
    first = ag.join(0)
    again = ag.join(1, ranks=[node for _, node in first])
    assert [node for _, node in again] == [0, 1]


@pytest.mark.timeout(40)
def test_gang_silent_node_is_declared_lost(agents, monkeypatch):
    monkeypatch.setattr(gang_mod, "LOST_AFTER", 1.5)
    monkeypatch.setattr(gang_mod, "WATCH_SLICE", 0.2)
    ag = agents(3)
    assignment = ag.join(0)[0][0]
    w0 = ag.gangs[0].watch(0, 0, assignment)
    ag.gangs[1].watch(0, 1, assignment)
    # node 2 never starts its watcher: no heartbeat
    assert ag.woken[0].wait(10), "node 0 did not notice that node 2 went silent"
    assert w0.abort_record is not None and "node 2 (h3" in w0.abort_record["reason"]
    assert "no heartbeat" in w0.abort_record["reason"]


@pytest.mark.timeout(30)
def test_gang_store_loss_wakes_the_watcher(agents):
    ag = agents(2)
    assignment = ag.join(0)[0][0]
    w1 = ag.gangs[1].watch(0, 1, assignment)
    ag.gangs[0].server.close()
    assert ag.woken[1].wait(10)
    assert w1.lost is not None and "lost the connection to the agents' store" in w1.lost


def test_agent_info_json_roundtrip():
    i = info("h1", 0, store=True)
    assert AgentInfo.from_json(i.to_json()) == i
    assert json.loads(i.to_json())["worker_port"] == 4000
