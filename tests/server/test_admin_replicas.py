"""GET/POST /admin/replicas: the replicas of a `--data-parallel-size` server, scaled at run time. The replicas
past the first are stand-ins here (tests/serving has real replica processes); what is checked is the
endpoint: its answers, its errors and its API key."""

from __future__ import annotations

import pytest

from tiny import build_engine, make_state

from tfserve.serving.replica import Replica

ADMIN = {"Authorization": "Bearer admin"}


class StandIn(Replica):
    """A replica that is never sent anything in these tests."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index, self.stopped = index, False

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped = True


@pytest.fixture
def replicated(tokenizer):
    from tfserve.serving.replica import ReplicaSpec
    from tfserve.serving.replicas import ReplicatedEngine

    engine = build_engine(tokenizer, num_blocks=64)
    async_engine = ReplicatedEngine(engine, [], ReplicaSpec("tiny", {}, engine.config, 1))
    async_engine._start_remote = StandIn
    async_engine.start()
    yield async_engine
    async_engine.stop()


def test_replicas_are_listed_added_and_retired(start_server, replicated):
    live = start_server(state=make_state(replicated), admin_key="admin")
    status, _, body = live.request("GET", "/admin/replicas", headers=ADMIN)
    assert status == 200 and body["num_replicas"] == 1 and body["replicas"][0]["state"] == "ready"
    assert body["autoscale"] is None
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 3}, headers=ADMIN)
    assert status == 200 and body["num_replicas"] == 3
    assert [r["index"] for r in body["replicas"]] == [0, 1, 2]
    added = list(replicated.remotes)
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 2}, headers=ADMIN)
    assert status == 200 and body["num_replicas"] == 2
    assert added[1].stopped and not added[0].stopped
    metrics = live.request("GET", "/metrics")[2]
    assert 'tfserve_replica_num_routed{replica="1"}' in metrics
    assert 'replica="2"' not in metrics
    health = live.request("GET", "/health")[2]
    assert health["status"] == "ok" and health["replicas"] == {"ready": 2, "retiring": 0, "dead": 0}
    replicated.remotes[0]._died("replica 1 exited (killed by SIGKILL)")  # /health says so; the others serve on
    status, _, health = live.request("GET", "/health")
    assert status == 200 and health["status"] == "degraded" and health["replicas"]["dead"] == 1
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 2}, headers=ADMIN)  # another in its place
    assert status == 200 and [r["state"] for r in body["replicas"]] == ["ready", "ready"]
    assert replicated.remotes[0] is not added[0] and added[0].stopped


@pytest.mark.parametrize("body", [{"num_replicas": 0}, {"num_replicas": "2"}, {"num_replicas": True}, {},
                                  {"num_replicas": 100000}, {"num_replicas": 2, "min": 1}, {"num_replicas": None},
                                  {"num_replicas": 2.0}, {"num_replicas": [2]}])
def test_a_bad_count_is_a_400_naming_the_field(start_server, replicated, body):
    live = start_server(state=make_state(replicated), admin_key="admin")
    status, _, answer = live.request("POST", "/admin/replicas", body, headers=ADMIN)
    assert status == 400
    assert answer["error"]["param"] == ("min" if "min" in body else "num_replicas")
    assert live.request("GET", "/admin/replicas", headers=ADMIN)[2]["num_replicas"] == 1


def test_one_engine_has_no_replicas_to_scale(start_server):
    live = start_server(admin_key="admin")
    status, _, body = live.request("POST", "/admin/replicas", {"num_replicas": 2}, headers=ADMIN)
    assert status == 400 and body["error"]["code"] == "not_replicated"
    assert "--data-parallel-size" in body["error"]["message"]


def test_the_admin_key_guards_the_admin_endpoints(start_server, replicated):
    """The admin key opens /admin/*, the API key does not (any API client could start 256 engine processes);
    without an admin key the admin endpoints are off (issue 43)."""
    live = start_server(state=make_state(replicated), api_key="secret", admin_key="admin")
    api_client = {"Authorization": "Bearer secret"}
    assert live.request("POST", "/admin/replicas", {"num_replicas": 2}, headers=api_client)[0] == 401
    assert live.request("GET", "/admin/replicas", headers=api_client)[0] == 401
    assert live.request("GET", "/admin/replicas")[0] == 401
    status, _, body = live.request("GET", "/admin/replicas", headers=ADMIN)
    assert status == 200 and body["num_replicas"] == 1
    off = start_server(state=make_state(replicated), api_key="secret")
    for headers in (api_client, ADMIN, {}):
        status, _, body = off.request("POST", "/admin/replicas", {"num_replicas": 2}, headers=headers)
        assert status == 403 and body["error"]["code"] == "admin_disabled" and "--admin-key" in body["error"]["message"]
    assert len(replicated.remotes) == 0


def test_the_replicas_follow_the_load(replicated):
    """`autoscale`: more requests in flight than the target per replica add replicas once the delay has passed;
    none retires them after theirs."""
    import asyncio

    from tfserve.serving.autoscale import AutoscalePolicy

    policy = AutoscalePolicy(1, 3, target_requests=2, upscale_delay_s=0.2, downscale_delay_s=0.4)

    async def main():
        scaling = asyncio.ensure_future(replicated.autoscale(policy, period_s=0.02))
        try:
            replicated.in_flight[0] = 5  # asks for 3
            await asyncio.sleep(0.1)
            assert len(replicated.remotes) == 0  # not yet
            assert replicated.describe()["autoscale"]["max_replicas"] == 3
            await _until(lambda: len(replicated.remotes) == 2)
            added = list(replicated.remotes)
            replicated.in_flight[0] = 0
            await _until(lambda: len(replicated.remotes) == 0)
            assert all(remote.stopped for remote in added)
        finally:
            scaling.cancel()
        await asyncio.gather(scaling, return_exceptions=True)
        assert replicated.describe()["autoscale"] is None  # (the loop ended)

    asyncio.run(main())


async def _until(condition, timeout: float = 5.0):
    import asyncio

    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not within the timeout")


def test_the_server_applies_the_policy_while_it_serves(replicated):
    """`tfserve serve --min-replicas 2 --max-replicas 2` from one replica: the server's loop scales to two."""
    import asyncio

    from tiny import free_port

    from tfserve.serving.autoscale import AutoscalePolicy
    from tfserve.server.app import create_app
    from tfserve.server.run import serve
    from tfserve.server.runtime.state import ServerState

    async def main():
        stop = asyncio.Event()
        serving = asyncio.ensure_future(serve(
            create_app(ServerState()), "127.0.0.1", free_port(), load=lambda: replicated, stop_event=stop,
            drain_timeout=1, autoscale=AutoscalePolicy(2, 2, upscale_delay_s=0)))
        try:
            await _until(lambda: len(replicated.remotes) == 1, timeout=10)
        finally:
            stop.set()
            await serving

    asyncio.run(main())


@pytest.mark.parametrize("body, param, words", [
    ({}, "num_replicas", "num_replicas is required"),
    ({"num_replicas": "2"}, "num_replicas", "num_replicas must be an integer, not a string"),
    ({"num_replicas": 0}, "num_replicas", "num_replicas must be an integer from 1 to"),
    ({"num_replicas": 2, "replicas": 3}, "replicas", "unknown field 'replicas'"),
])
def test_the_body_is_a_typed_request(body, param, words):
    """POST /admin/replicas' body parsed once (ReplicasRequest): each mistake an OpenAI 400 naming its field."""
    from tfserve.server.errors import ApiError
    from tfserve.server.requests.admin import ReplicasRequest

    with pytest.raises(ApiError) as caught:
        ReplicasRequest.parse(body)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message
    assert ReplicasRequest.parse({"num_replicas": 2}).num_replicas == 2
