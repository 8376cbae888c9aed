"""GET/POST /admin/replicas: the replicas of a `--data-parallel-size` server, scaled at run time. The replicas
past the first are stand-ins here (tests/distributed has real replica processes); what is checked is the
endpoint: its answers, its errors and its API key."""

from __future__ import annotations

import pytest

from tiny import build_engine, make_state

from tfserve.distributed.replicas import Replica


class StandIn(Replica):
    """A replica that is never sent anything in these tests."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index, self.stopped = index, False

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped = True


@pytest.fixture
def replicated(tokenizer):
    from tfserve.distributed.replicas import ReplicaSpec, ReplicatedEngine

    engine = build_engine(tokenizer, num_blocks=64)
    async_engine = ReplicatedEngine(engine, [], ReplicaSpec("tiny", {}, engine.config, 1))
    async_engine._start_remote = StandIn
    async_engine.start()
    yield async_engine
    async_engine.stop()


def test_replicas_are_listed_added_and_retired(start_server, replicated):
    live = start_server(state=make_state(replicated))
    status, _, body = live.request("GET", "/admin/replicas")
    assert status == 200 and body["num_replicas"] == 1 and body["replicas"][0]["state"] == "ready"
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 3})
    assert status == 200 and body["num_replicas"] == 3
    assert [r["index"] for r in body["replicas"]] == [0, 1, 2]
    added = list(replicated.remotes)
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 2})
    assert status == 200 and body["num_replicas"] == 2
    assert added[1].stopped and not added[0].stopped
    metrics = live.request("GET", "/metrics")[2]
    assert 'tfserve_replica_num_routed{replica="1"}' in metrics
    assert 'replica="2"' not in metrics


@pytest.mark.parametrize("body", [{"num_replicas": 0}, {"num_replicas": "2"}, {"num_replicas": True}, {},
                                  {"num_replicas": 100000}, {"num_replicas": 2, "min": 1}])
def test_a_bad_count_is_a_400_naming_the_field(start_server, replicated, body):
    live = start_server(state=make_state(replicated))
    status, _, answer = live.request("POST", "/admin/replicas", body)
    assert status == 400
    assert answer["error"]["param"] == ("min" if "min" in body else "num_replicas")
    assert live.request("GET", "/admin/replicas")[2]["num_replicas"] == 1


def test_one_engine_has_no_replicas_to_scale(server):
    status, _, body = server.request("POST", "/admin/replicas", {"num_replicas": 2})
    assert status == 400 and body["error"]["code"] == "not_replicated"
    assert "--data-parallel-size" in body["error"]["message"]


def test_the_api_key_guards_the_admin_endpoints(start_server, replicated):
    live = start_server(state=make_state(replicated), api_key="secret")
    assert live.request("POST", "/admin/replicas", {"num_replicas": 2})[0] == 401
    assert live.request("GET", "/admin/replicas")[0] == 401
    status, _, body = live.request("GET", "/admin/replicas", headers={"Authorization": "Bearer secret"})
    assert status == 200 and body["num_replicas"] == 1
