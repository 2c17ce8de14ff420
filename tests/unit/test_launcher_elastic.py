"""Elastic membership and liveness without processes: the pure decisions, then rounds with agents as threads."""

from __future__ import annotations

import json
import threading
from typing import Optional

import pytest

from procgroup.errors import RendezvousError
from procgroup.launcher.elastic import admit, assign_elastic, join_elastic, parse_closed
from procgroup.launcher.gang import AgentInfo, Gang, GangAborted
from procgroup.launcher.liveness import UsrOneRelay, beat_interval


def info(host: str, pid: int, *, store: bool = False, nproc: int = 2, nnodes: int = 3, mn: int = 2) -> AgentInfo:
    return AgentInfo(
        host=host,
        pid=pid,
        nproc=nproc,
        nnodes=nnodes,
        run_id="j",
        max_restarts=3,
        node_rank=None,
        hosts_store=store,
        worker_port=4000 if store else None,
        min_nodes=mn,
    )


# ----------------------------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    "joined, coord, mx, want",
    [(2, 0, 3, [0, 1]), (3, 0, 3, [0, 1, 2]), (4, 0, 3, [0, 1, 2]), (4, 3, 3, [0, 1, 3]), (5, 2, 1, [2])],
)
def test_admit_takes_the_coordinator_then_the_earliest(joined: int, coord: int, mx: int, want: list[int]) -> None:
    assert admit(joined, coord, mx) == want


def test_assign_elastic_store_host_first_then_by_host_and_pid() -> None:
    infos = [info("h3", 7), info("h1", 9, store=True), info("h2", 5, nproc=1), info("h2", 4)]
    a = assign_elastic(infos, [0, 1, 2, 3])
    assert [(n.host, n.pid, n.slot) for n in a.nodes] == [("h1", 9, 1), ("h2", 4, 3), ("h2", 5, 2), ("h3", 7, 0)]
    assert [n.rank_offset for n in a.nodes] == [0, 2, 4, 5] and a.world_size == 7 and a.worker_port == 4000
    # the same membership in another join order: the same ranks
    b = assign_elastic(list(reversed(infos)), [3, 2, 1, 0])
    assert [(n.host, n.pid) for n in b.nodes] == [(n.host, n.pid) for n in a.nodes]


def test_assign_elastic_refuses_disagreement_and_a_missing_store_host() -> None:
    with pytest.raises(RendezvousError, match="disagree on --nnodes"):
        assign_elastic([info("h1", 1, store=True), info("h2", 2, mn=1)], [0, 1])
    with pytest.raises(RendezvousError, match="hosts the store"):
        assign_elastic([info("h1", 1), info("h2", 2)], [0, 1])


def test_parse_closed() -> None:
    assert parse_closed(b'{"slots": [0, 2]}') == {"slots": [0, 2]}
    assert parse_closed(json.dumps({"error": "too few"}).encode())["error"] == "too few"
    for bad in (b"[]", b'{"slots": 3}', b"nonsense"):
        with pytest.raises(ValueError):
            parse_closed(bad)


def test_usr1_relay_counts_only_the_other_agents() -> None:
    r = UsrOneRelay()
    assert r.remote(5) == 0  # the first look sets the baseline: history is not replayed

    class St:
        v = 5

        def add(self, key: str, n: int) -> int:
            self.v += n
            return self.v

    st = St()
    r.publish(st)  # ours: 6
    assert r.remote(6) == 0
    assert r.remote(8) == 2  # 7 and 8 came from other agents
    st.v = 8
    r.publish(st)  # ours: 9
    assert r.remote(10) == 1  # 10 is another agent's


def test_usr1_baseline_before_the_first_look() -> None:
    r = UsrOneRelay()
    r.baseline(3)
    assert r.remote(4) == 1
    r.baseline(10)  # already counting: ignored
    assert r.remote(4) == 0


def test_beat_interval() -> None:
    assert beat_interval(3.0) == 0.5 and beat_interval(0.6) == pytest.approx(0.1) and beat_interval(0.01) == 0.02


# ----------------------------------------------------------------------------------------------- rounds


class Cluster:
    """A store hosted by the coordinator's Gang; more Gangs join as threads."""

    def __init__(self) -> None:
        self.gangs: list[Gang] = []
        self.port = 0

    def gang(self, k: int) -> Gang:
        g = Gang(
            host=f"h{k + 1}",
            master_addr="127.0.0.1",
            port=self.port,
            nnodes=3,
            node0=k == 0,
            join_timeout=5,
            interrupted=lambda: False,
            wakeup=lambda: None,
            progress=lambda m: None,
        )
        if k == 0:
            self.port = g.serve("s", bind_host="127.0.0.1")
        g.connect(lambda: "s")
        self.gangs.append(g)
        return g

    def join(
        self, ks: list[int], gen: int, lost: tuple[str, ...] = (), expect: Optional[int] = None
    ) -> dict[int, object]:
        out: dict[int, object] = {}

        def go(k: int) -> None:
            me = info(f"h{k + 1}", 100 + k, store=k == 0)
            try:
                out[k] = join_elastic(
                    self.gangs[k], gen, me, min_nodes=2, max_nodes=3, window=0.3, lost=lost, expect=expect
                )
            except BaseException as e:  # noqa: BLE001 - returned to the test
                out[k] = e

        ts = [threading.Thread(target=go, args=(k,)) for k in ks]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        return out

    def close(self) -> None:
        for g in reversed(self.gangs):
            g.close(None, None)


@pytest.fixture
def cluster():  # type: ignore[no-untyped-def]
    c = Cluster()
    yield c
    c.close()


@pytest.mark.timeout(30)
def test_rounds_grow_on_arrival_and_fail_below_min(cluster: Cluster) -> None:
    for k in range(3):
        cluster.gang(k)
    got = cluster.join([0, 1], 0)
    assert all(isinstance(v, tuple) for v in got.values()), got
    a0, node0, gen0 = got[0]  # type: ignore[misc]
    assert gen0 == 0 and node0 == 0 and len(a0.nodes) == 2
    # h3 arrives while generation 0 runs: it stops generation 0 and joins generation 1
    arrival: dict[int, object] = {}
    t = threading.Thread(target=lambda: arrival.update(cluster.join([2], 0)))
    t.start()
    rec: Optional[bytes] = None
    for _ in range(100):
        st = cluster.gangs[0].store
        assert st is not None
        if st.check(["launch/g0/abort"]):
            rec = st.get("launch/g0/abort")
            break
        threading.Event().wait(0.05)
    assert rec is not None and json.loads(rec)["membership"] == "join"
    again = cluster.join([0, 1], 1)
    t.join(20)
    a1, _, gen1 = again[0]  # type: ignore[misc]
    assert gen1 == 1 and [n.host for n in a1.nodes] == ["h1", "h2", "h3"]
    assert isinstance(arrival[2], tuple) and arrival[2][2] == 1  # type: ignore[index]
    # only h1 comes back for generation 2: below MIN, the round fails naming what was lost
    lost = ("node 1 (h2, agent pid 101) is lost", "node 2 (h3, agent pid 102) is lost")
    res = cluster.join([0], 2, lost=lost, expect=1)[0]
    assert isinstance(res, GangAborted) and "below the minimum of 2 (--nnodes 2:3)" in str(res), res
    assert "lost: node 1 (h2, agent pid 101) is lost; node 2 (h3" in str(res)
