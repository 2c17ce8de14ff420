"""Identity detection against REAL launcher environments (tests/data/env/*.env, see capture.sh).

Each capture holds every task of one launch; the ``# hostname:`` comment is the task's
``uname -n``, which is the ground truth for local ranks and nodes.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import sys
import types
from pathlib import Path

import pytest

from procgroup.config import Identity
from procgroup.errors import ConfigError
from procgroup.identity import (
    DEFAULT_MASTER_PORT,
    PORT_BASE,
    PORT_SPAN,
    derive_port,
    describe_identity,
    detect_identity,
    expand_hostlist,
    parse_tasks_per_node,
    resolve_master,
    resolve_master_via_mpi,
)

ENV_DIR = Path(__file__).resolve().parents[1] / "data" / "env"


@dataclasses.dataclass
class Task:
    rank: int  # the launcher's own rank (section header)
    hostname: str  # uname -n of the task
    env: dict


def load_env_capture(name: str) -> list[Task]:
    """Parse a capture: ``[rank N]`` sections of KEY=VALUE lines; ``# hostname: H`` comments."""
    tasks: list[Task] = []
    for line in (ENV_DIR / name).read_text().splitlines():
        if line.startswith("[rank "):
            tasks.append(Task(int(line[6:-1]), "", {}))
        elif line.startswith("# hostname: ") and tasks:
            tasks[-1].hostname = line.split(": ", 1)[1]
        elif line and not line.startswith("#"):
            k, v = line.split("=", 1)
            tasks[-1].env[k] = v
    assert tasks, f"{name} holds no [rank N] section"
    return tasks


def env_of(name: str, rank: int) -> dict:
    return dict(next(t for t in load_env_capture(name) if t.rank == rank).env)


# (file, source, how rank 0's host is named in MASTER_ADDR: a function of the tasks)
NETNS_IP = {"10.77.0.1": "h1", "10.77.0.2": "h2", "10.77.0.3": "h3"}
CAPTURES = [
    ("openmpi.env", "openmpi"),
    ("mpich.env", "mpich"),
    ("slurm-single.env", "slurm"),
    ("slurm-netns-N3n6.env", "slurm"),
    ("slurm-netns-N3n6-uneven.env", "slurm"),
    ("slurm-netns-N2n3-subset.env", "slurm"),
    ("openmpi-in-slurm.env", "openmpi"),
    ("openmpi-in-slurm-np5.env", "openmpi"),
    ("mpich-in-slurm.env", "mpich"),
    ("kubeflow-pytorchjob.env", "kubeflow"),
]


def _master_host(addr: str, tasks: list[Task]) -> str:
    """The uname of the host MASTER_ADDR designates, in the captures' little world."""
    if addr in ("127.0.0.1", "localhost"):
        hosts = {t.hostname for t in tasks}
        assert len(hosts) == 1, f"loopback master {addr} for a job on {sorted(hosts)}"
        return hosts.pop()
    return NETNS_IP.get(addr, addr)


@pytest.mark.parametrize("name,source", CAPTURES)
def test_every_rank_of_a_capture(name: str, source: str) -> None:
    tasks = load_env_capture(name)
    ids = [detect_identity(t.env) for t in tasks]
    world = len(tasks)
    assert sorted(t.rank for t in tasks) == list(range(world))
    by_host: dict[str, list[int]] = {}
    for t in tasks:
        by_host.setdefault(t.hostname, []).append(t.rank)
    hosts_in_order = sorted(by_host, key=lambda h: min(by_host[h]))
    for t, ident in zip(tasks, ids):
        assert ident.source == source, (name, t.rank, ident)
        assert ident.rank == t.rank
        assert ident.world_size == world
        # ground truth from uname: local ranks are 0..k-1 in rank order on each host
        assert ident.local_world_size == len(by_host[t.hostname]), (name, t.rank)
        assert ident.local_rank == sorted(by_host[t.hostname]).index(t.rank), (name, t.rank)
        assert ident.num_nodes == len(by_host)
        assert ident.node_rank == hosts_in_order.index(t.hostname), (name, t.rank, ident.derived)
        assert ident == detect_identity(dict(t.env)), "detection is not deterministic"
    # one master for the whole job, on rank 0's host
    masters = {(i.master_addr, i.master_port) for i in ids}
    assert len(masters) == 1, masters
    addr, port = masters.pop()
    assert addr is not None and port is not None
    assert _master_host(addr, tasks) == tasks[0].hostname
    assert len({i.job_id for i in ids}) == 1


def test_slurm_master_port_is_documented_formula() -> None:
    seen = []
    for name in ("slurm-netns-N3n6.env", "slurm-netns-N2n3-subset.env"):
        for t in load_env_capture(name):
            job, step = int(t.env["SLURM_JOB_ID"]), int(t.env["SLURM_STEP_ID"])
            seen.append((job, step))
            ident = detect_identity(t.env)
            assert ident.master_port == 20000 + (job * 7 + step) % 10000
            assert ident.job_id == f"{job}.{step}"
            assert any(n.startswith(f"MASTER_PORT={ident.master_port} ") for n in ident.derived)
            assert any(
                n.startswith(f"MASTER_ADDR={ident.master_addr} ") and "SLURM_STEP_NODELIST" in n for n in ident.derived
            )
    assert len({j for j, _ in seen}) == 1 and {s for _, s in seen} == {0, 1}  # two steps of one job


def test_two_steps_of_one_job_get_different_ports() -> None:
    a = detect_identity(env_of("slurm-netns-N3n6.env", 0))
    b = detect_identity(env_of("slurm-netns-N2n3-subset.env", 0))
    assert a.job_id != b.job_id and a.master_port != b.master_port


def test_slurm_step_on_subset_uses_step_nodelist_not_job_nodelist() -> None:
    env = env_of("slurm-netns-N2n3-subset.env", 0)
    assert env["SLURM_JOB_NODELIST"] == "h[1-3]" and env["SLURM_STEP_NODELIST"] == "h[2-3]"
    assert detect_identity(env).master_addr == "h2"


def test_slurm_uneven_tasks_per_node() -> None:
    tasks = load_env_capture("slurm-netns-N3n6-uneven.env")
    assert tasks[0].env["SLURM_STEP_TASKS_PER_NODE"] == "4,1(x2)"
    assert [detect_identity(t.env).local_world_size for t in tasks] == [4, 4, 4, 4, 1, 1]


def test_openmpi_port_derives_from_jobid() -> None:
    for name in ("openmpi.env", "openmpi-in-slurm.env"):
        for t in load_env_capture(name):
            ident = detect_identity(t.env)
            job = t.env["OMPI_MCA_ess_base_jobid"]
            assert ident.job_id == job
            assert ident.master_port == derive_port(job)
            assert ident.master_port not in (_uri_port(t.env["OMPI_MCA_orte_hnp_uri"]),)


def _uri_port(uri: str) -> int:
    return int(re.search(r"tcp://[^;]*:(\d+)", uri).group(1))


def test_mpirun_inside_sbatch_is_not_mistaken_for_the_daemon_step() -> None:
    """The capture that motivated the precedence: rank 4 carries the orted step's SLURM_PROCID=0."""
    env = env_of("openmpi-in-slurm.env", 4)
    assert env["SLURM_PROCID"] == "0" and env["SLURM_STEP_NUM_TASKS"] == "2"
    ident = detect_identity(env)
    assert (ident.source, ident.rank, ident.world_size) == ("openmpi", 4, 6)
    assert any("ignoring the SLURM_* variables" in n for n in ident.derived)
    # and MPICH's proxies, started with srun one per node, likewise
    env = env_of("mpich-in-slurm.env", 5)
    assert env["SLURM_PROCID"] == "2" and env["SLURM_STEP_NUM_TASKS"] == "3"
    assert (detect_identity(env).rank, detect_identity(env).world_size) == (5, 6)


def test_mpirun_nolocal_rank_and_size_are_right_master_is_the_documented_guess() -> None:
    tasks = load_env_capture("openmpi-in-slurm-nolocal.env")
    ids = [detect_identity(t.env) for t in tasks]
    assert [(i.rank, i.world_size, i.local_rank, i.local_world_size) for i in ids] == [(0, 2, 0, 1), (1, 2, 0, 1)]
    # documented limit: mpirun's host (h1 = 10.77.0.1), consistently on all ranks, and said so
    assert {i.master_addr for i in ids} == {"10.77.0.1"}
    assert all(any("--nolocal" in n for n in i.derived) for i in ids)


def test_sbatch_shell_is_not_rank_0_of_ntasks() -> None:
    env = env_of("slurm-sbatch.env", 0)
    assert env["SLURM_PROCID"] == "0" and env["SLURM_NTASKS"] == "4" and "SLURM_STEP_ID" not in env
    with pytest.raises(ConfigError) as ei:
        detect_identity(env)
    msg = str(ei.value)
    assert "SLURM_STEP_ID" in msg and "srun" in msg and "sbatch" in msg


def test_mpich_pmi_port_mode_says_what_to_do() -> None:
    env = env_of("mpich-pmi-port.env", 1)
    with pytest.raises(ConfigError, match=r"PMI_ID=1 is set but PMI_SIZE is not.*-pmi-port"):
        detect_identity(env)


def test_mpich_single_host_uses_loopback_and_default_port() -> None:
    ident = detect_identity(env_of("mpich.env", 2))
    assert (ident.master_addr, ident.master_port) == ("127.0.0.1", DEFAULT_MASTER_PORT)
    assert ident.job_id is None


def test_mpich_multi_host_without_slurm_has_no_master() -> None:
    env = env_of("mpich.env", 1)
    env["MPI_LOCALNRANKS"] = "2"  # 4 ranks, 2 on this host: Hydra across hosts
    ident = detect_identity(env)
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (1, 4, 1, 2)
    assert ident.master_addr is None
    assert any("MASTER_ADDR unknown" in n for n in ident.derived)


# --------------------------------------------------------------------------- precedence


def test_torchrun_under_srun_wins_over_slurm() -> None:
    env = env_of("slurm-netns-N3n6.env", 2)
    env.update(
        RANK="5",
        WORLD_SIZE="12",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="4",
        GROUP_RANK="1",
        GROUP_WORLD_SIZE="3",
        MASTER_ADDR="h1",
        MASTER_PORT="29400",
        TORCHELASTIC_RUN_ID="tr-1",
    )
    ident = detect_identity(env)
    assert ident == Identity(
        rank=5,
        world_size=12,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        num_nodes=3,
        master_addr="h1",
        master_port=29400,
        source="torchrun",
        job_id="tr-1",
        derived=(),
    )


def test_procgroup_run_source_and_job_id() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "PROCGROUP_RUN_ID": "pg-7",
        "TORCHELASTIC_RUN_ID": "pg-7",
    }
    ident = detect_identity(env)
    assert (ident.source, ident.job_id, ident.node_rank, ident.num_nodes) == ("procgroup", "pg-7", 0, 1)


def test_rank_and_world_size_set_by_hand() -> None:
    ident = detect_identity({"RANK": "1", "WORLD_SIZE": "3"})
    assert (ident.source, ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (
        "torchrun",
        1,
        3,
        0,
        1,
    )
    assert ident.master_addr is None and ident.master_port is None
    assert any("LOCAL_RANK=0" in n for n in ident.derived)


def test_legacy_launch_local_rank_without_local_world_size() -> None:
    ident = detect_identity({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_WORLD_SIZE": "2"})
    assert ident.local_world_size == 2 and any("LOCAL_WORLD_SIZE=2" in n for n in ident.derived)
    with pytest.raises(ConfigError, match="LOCAL_RANK=1 is set but LOCAL_WORLD_SIZE is not"):
        detect_identity({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})


def test_srun_direct_launch_with_slurm_pmi_stays_slurm() -> None:
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE itself (no Hydra markers): Slurm's richer view wins."""
    env = env_of("slurm-netns-N3n6.env", 3)
    env.update(PMI_RANK="3", PMI_SIZE="6", PMI_FD="5", PMI_JOBID="7.0")
    assert detect_identity(env).source == "slurm"
    # srun --mpi=pmix + MPI already initialized in-process: OMPI_COMM_WORLD_* but no mpirun (no hnp_uri)
    env = env_of("slurm-netns-N3n6.env", 3)
    env.update(
        OMPI_COMM_WORLD_RANK="3",
        OMPI_COMM_WORLD_SIZE="6",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    assert detect_identity(env).source == "slurm"


def test_openmpi_before_mpich() -> None:
    env = env_of("openmpi.env", 1)
    env.update(PMI_RANK="0", PMI_SIZE="9")
    assert (detect_identity(env).source, detect_identity(env).rank) == ("openmpi", 1)


def test_master_from_environment_always_wins() -> None:
    for name, rank in [("slurm-netns-N3n6.env", 4), ("openmpi-in-slurm.env", 5), ("mpich.env", 1)]:
        env = env_of(name, rank)
        env.update(MASTER_ADDR="10.9.9.9", MASTER_PORT="4242")
        ident = detect_identity(env)
        assert (ident.master_addr, ident.master_port) == ("10.9.9.9", 4242)
        assert not any(n.startswith(("MASTER_ADDR=", "MASTER_PORT=")) for n in ident.derived), ident.derived


def test_procgroup_run_id_names_the_job_under_a_scheduler() -> None:
    env = env_of("slurm-netns-N3n6.env", 0)
    env["PROCGROUP_RUN_ID"] = "my-run"
    ident = detect_identity(env)
    assert ident.job_id == "my-run" and ident.source == "slurm"
    assert ident.master_port == derive_port(env["SLURM_JOB_ID"], int(env["SLURM_STEP_ID"]))


def test_nothing_set_names_the_variables_and_the_fix() -> None:
    with pytest.raises(ConfigError) as ei:
        detect_identity({"HOME": "/root", "PATH": "/usr/bin"})
    msg = str(ei.value)
    for needle in (
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "procgroup run",
        "srun",
        "mpirun",
    ):
        assert needle in msg, needle


@pytest.mark.parametrize("env,missing", [({"RANK": "0"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2"}, "RANK")])
def test_half_of_rank_world_size(env: dict, missing: str) -> None:
    with pytest.raises(ConfigError, match=f"{missing} is not"):
        detect_identity(env)


def test_default_environ_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(__import__("os").environ):
        if k.startswith(("RANK", "WORLD_SIZE", "SLURM", "OMPI_", "PMI_", "PROCGROUP_", "MASTER_", "LOCAL_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    assert (detect_identity().rank, detect_identity().world_size) == (2, 5)


# --------------------------------------------------------------------------- Kubeflow


def test_kubeflow_one_process_per_pod_without_pet_vars() -> None:
    """Older operators set only MASTER_*, RANK, WORLD_SIZE; the pod's KUBERNETES_SERVICE_HOST marks it."""
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "RANK": "2",
        "WORLD_SIZE": "4",
    }
    ident = detect_identity(env)
    assert (ident.source, ident.local_rank, ident.local_world_size, ident.node_rank, ident.num_nodes) == (
        "kubeflow",
        0,
        1,
        2,
        4,
    )


def test_kubeflow_nproc_per_node_needs_a_launcher_in_the_pod() -> None:
    env = env_of("kubeflow-pytorchjob.env", 1)
    env.update(PET_NPROC_PER_NODE="4", WORLD_SIZE="12")
    with pytest.raises(ConfigError, match=r"nprocPerNode=4.*procgroup run --nproc-per-node 4"):
        detect_identity(env)
    # ... and with torchrun in the pod (it re-exports RANK etc. per process) all is well
    env.update(RANK="5", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1", TORCHELASTIC_RUN_ID="x")
    ident = detect_identity(env)
    assert (ident.source, ident.rank, ident.world_size, ident.local_rank, ident.node_rank, ident.num_nodes) == (
        "torchrun",
        5,
        12,
        1,
        1,
        3,
    )


def test_kubeflow_pet_master_is_a_fallback() -> None:
    env = env_of("kubeflow-pytorchjob.env", 2)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    ident = detect_identity(env)
    assert (ident.master_addr, ident.master_port) == ("mnist-master-0", 23456)


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "env,pattern",
    [
        ({"RANK": "abc", "WORLD_SIZE": "4"}, r"RANK='abc' is not an integer"),
        ({"RANK": "5", "WORLD_SIZE": "4"}, r"RANK=5 is out of range.*WORLD_SIZE=4"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, r"RANK=-1 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 is not a valid world size \(it must be >= 1"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            r"LOCAL_RANK=2 is out of range.*LOCAL_WORLD_SIZE=2",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
            r"LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"},
            r"GROUP_RANK=2 is out of range.*GROUP_WORLD_SIZE=2",
        ),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "70000"},
            r"MASTER_PORT=70000 is not a valid TCP port \(1-65535\)",
        ),
    ],
)
def test_bad_explicit_values_name_the_variable(env: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        detect_identity(env)


def test_bad_slurm_values_name_the_variable() -> None:
    env = env_of("slurm-netns-N3n6.env", 5)
    env["SLURM_PROCID"] = "6"
    with pytest.raises(ConfigError, match=r"SLURM_PROCID=6 is out of range.*SLURM_STEP_NUM_TASKS=6"):
        detect_identity(env)
    env = env_of("slurm-netns-N3n6.env", 5)
    env["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)"
    with pytest.raises(ConfigError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x2\)' places 4 tasks"):
        detect_identity(env)
    env = env_of("slurm-netns-N3n6.env", 5)
    env["SLURM_LOCALID"] = "x"
    with pytest.raises(ConfigError, match=r"SLURM_LOCALID='x' is not an integer"):
        detect_identity(env)
    env = env_of("slurm-netns-N3n6.env", 5)
    env["SLURM_STEP_NODELIST"] = "h[1-"
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST='h\[1-' is not a valid Slurm host list"):
        detect_identity(env)


def test_bad_openmpi_values_name_the_variable() -> None:
    env = env_of("openmpi.env", 3)
    env["OMPI_COMM_WORLD_LOCAL_RANK"] = "4"
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_LOCAL_RANK=4 is out of range.*LOCAL_SIZE=4"):
        detect_identity(env)


# --------------------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("4", [4]),
        ("2(x3)", [2, 2, 2]),
        ("3,2", [3, 2]),
        ("2(x2),1", [2, 2, 1]),
        ("4,1(x2)", [4, 1, 1]),
        ("1(x1)", [1]),
        (" 2(x2), 3 ", [2, 2, 3]),
    ],
)
def test_parse_tasks_per_node(spec: str, expected: list) -> None:
    assert parse_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["", "2(x)", "x3", "2(x0)", "2(3)", "2,,1", "-1"])
def test_parse_tasks_per_node_rejects(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"SLURM_TASKS_PER_NODE="):
        parse_tasks_per_node(spec, var="SLURM_TASKS_PER_NODE")


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("h[1-3,5]", ["h1", "h2", "h3", "h5"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("a,b[1-2]", ["a", "b1", "b2"]),
        ("localhost", ["localhost"]),
        ("h[2-3]", ["h2", "h3"]),
    ],
)
def test_expand_hostlist(spec: str, expected: list) -> None:
    assert expand_hostlist(spec) == expected


@pytest.fixture
def no_hostlist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hostlist", None)  # makes `import hostlist` raise ImportError


def test_expand_hostlist_without_the_package(no_hostlist: None) -> None:
    assert expand_hostlist("a,b ,c.example.com") == ["a", "b", "c.example.com"]
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST='h\[1-3\]'.*pip install python-hostlist"):
        expand_hostlist("h[1-3]", var="SLURM_STEP_NODELIST")


def test_slurm_without_hostlist_package(no_hostlist: None) -> None:
    env = env_of("slurm-netns-N3n6.env", 0)
    with pytest.raises(ConfigError, match=r"pip install python-hostlist \(or procgroup\[slurm\]\)"):
        detect_identity(env)
    env["MASTER_ADDR"] = "h1"  # nothing to expand
    assert detect_identity(env).master_addr == "h1"
    assert detect_identity(env_of("slurm-single.env", 0)).master_addr == "localhost"


def test_derive_port() -> None:
    assert derive_port("7", 1) == 20050
    assert derive_port("1946157057") == 20000 + (1946157057 * 7) % 10000
    assert derive_port("mnist-abc") == derive_port("mnist-abc")
    ports = {derive_port(str(j), s) for j in range(200) for s in range(3)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN < 32768 for p in ports)
    assert derive_port("abc") != derive_port("abd")


# --------------------------------------------------------------------------- describe


def test_describe_identity() -> None:
    ident = Identity(
        rank=3,
        world_size=6,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        num_nodes=3,
        master_addr="h1",
        master_port=23456,
        source="slurm",
        job_id="7.0",
        derived=("MASTER_ADDR=h1 (first host)",),
    )
    assert describe_identity(ident) == (
        "rank 3/6 (local 1/2, node 1/3) from slurm job 7.0; master h1:23456 [derived: MASTER_ADDR=h1 (first host)]"
    )
    bare = Identity(rank=0, world_size=1)
    assert describe_identity(bare) == "rank 0/1 (local 0/1, node 0/?) from explicit; master not set"
    v6 = dataclasses.replace(bare, master_addr="fd00::2", master_port=1)
    assert describe_identity(v6).endswith("master [fd00::2]:1")


def test_describe_real_capture_mentions_every_derivation() -> None:
    env = env_of("slurm-netns-N3n6.env", 3)
    job, step = env["SLURM_JOB_ID"], env["SLURM_STEP_ID"]
    line = describe_identity(detect_identity(env))
    assert line.startswith(
        f"rank 3/6 (local 1/2, node 1/3) from slurm job {job}.{step}; "
        f"master h1:{derive_port(job, int(step))} [derived: "
    )
    assert "SLURM_STEP_NODELIST=h[1-3]" in line


# --------------------------------------------------------------------------- MPI-assisted master


class FakeComm:
    def __init__(self, rank: int, hosts: list, root_msg=None) -> None:
        self.rank, self.hosts, self.root_msg, self.sent = rank, hosts, root_msg, None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.hosts)

    def allgather(self, x):
        assert x == socket.gethostname()
        return [x if i == self.rank else h for i, h in enumerate(self.hosts)]

    def bcast(self, msg, root=0):
        assert root == 0
        if self.rank == 0:
            self.sent = msg
            return msg
        return self.root_msg


@pytest.fixture
def fake_mpi(monkeypatch: pytest.MonkeyPatch):
    mod = types.ModuleType("mpi4py")
    mod.MPI = types.SimpleNamespace(COMM_WORLD=None)
    monkeypatch.setitem(sys.modules, "mpi4py", mod)
    return mod.MPI


def test_resolve_master_via_mpi_without_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert resolve_master_via_mpi() is None


def test_resolve_master_via_mpi_one_host(fake_mpi) -> None:
    me = socket.gethostname()
    fake_mpi.COMM_WORLD = comm = FakeComm(0, [me, me, me])
    addr, port = resolve_master_via_mpi()
    assert addr == "127.0.0.1" and 0 < port < 65536 and comm.sent == (addr, port, None)
    with socket.socket() as s:  # the port was free
        s.bind(("127.0.0.1", port))


def test_resolve_master_via_mpi_many_hosts_rank0_and_rank1(fake_mpi) -> None:
    env = {"PROCGROUP_SOCKET_ADDR": "127.0.0.1"}  # rank 0's advertised address, as the user set it
    comm0 = FakeComm(0, ["x", "other-host"])
    assert resolve_master_via_mpi(comm=comm0, environ=env)[0] == "127.0.0.1"
    comm1 = FakeComm(1, ["rank0-host", "x"], root_msg=("10.0.0.5", 24000, None))
    assert resolve_master_via_mpi(comm=comm1) == ("10.0.0.5", 24000)
    comm1.root_msg = (None, None, "rank 0 on n1 could not pick a rendezvous address: boom; set MASTER_ADDR")
    with pytest.raises(ConfigError, match="rank 0 on n1 could not pick"):
        resolve_master_via_mpi(comm=comm1)


def test_resolve_master(monkeypatch: pytest.MonkeyPatch, fake_mpi) -> None:
    slurm = detect_identity(env_of("slurm-netns-N3n6.env", 1))
    assert resolve_master(slurm, {}) is slurm  # not MPI: untouched, no MPI call
    env = env_of("openmpi-in-slurm.env", 4)
    ident = detect_identity(env)
    fake_mpi.COMM_WORLD = FakeComm(4, ["h1"] * 4 + ["x", "h3"], root_msg=("10.77.0.1", 25001, None))
    got = resolve_master(ident, env)
    assert (got.master_addr, got.master_port, got.rank) == ("10.77.0.1", 25001, 4)
    assert any("MPI-broadcast" in n for n in got.derived)
    assert not any("mpirun's host" in n for n in got.derived)
    env["MASTER_PORT"] = "4000"
    assert resolve_master(detect_identity(env), env).master_port == 4000
    env["MASTER_ADDR"] = "n0"
    fake_mpi.COMM_WORLD = None  # would fail if used: MASTER_ADDR set means no collective call
    assert resolve_master(detect_identity(env), env).master_addr == "n0"


def test_resolve_master_without_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    env = env_of("mpich.env", 0)
    env["MPI_LOCALNRANKS"] = "2"
    ident = detect_identity(env)
    with pytest.raises(ConfigError, match=r"MASTER_ADDR and MASTER_PORT.*-genv MASTER_ADDR.*pip install mpi4py"):
        resolve_master(ident, env)
    single = detect_identity(env_of("openmpi.env", 0))
    assert resolve_master(single, env_of("openmpi.env", 0)) is single  # derived 127.0.0.1 stays


def test_resolve_master_mpi4py_of_another_mpi(fake_mpi) -> None:
    """Seen for real: Open MPI's mpi4py under mpiexec.mpich makes every process a singleton rank 0."""
    fake_mpi.COMM_WORLD = FakeComm(0, [socket.gethostname()])
    env = env_of("mpich.env", 2)
    ident = detect_identity(env)
    with pytest.raises(ConfigError, match="sees 1 process.*launcher started 4"):
        resolve_master_via_mpi(world_size=ident.world_size)
    kept = resolve_master(ident, env)  # single host: the derived 127.0.0.1:29500 stays, with the reason
    assert (kept.master_addr, kept.master_port) == ("127.0.0.1", DEFAULT_MASTER_PORT)
    assert any("mpi4py not used" in n for n in kept.derived)
    env["MPI_LOCALNRANKS"] = "4"
    env["PMI_SIZE"] = "8"  # across hosts: nothing to fall back on
    with pytest.raises(ConfigError, match="built for a different MPI"):
        resolve_master(detect_identity(env), env)


def test_rank_by_hand_leaves_the_local_layout_to_rendezvous() -> None:
    ident = detect_identity({"RANK": "1", "WORLD_SIZE": "2"})
    assert ident.layout_measured
    assert not any("assuming one process" in n for n in ident.derived)
    assert not detect_identity(
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    ).layout_measured
