"""Engine replicas: the router keeps a prompt's prefix on one replica, and (slow) two replicas in processes serve
streamed requests with more prefix-cache hits than random routing gets."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tfserve.serving.router import Router

PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)


def _tiny_replicas(tmp_path, num_blocks: int):
    """Two replicas of a saved tiny Llama (replica 1 a process): (path, config, the ReplicatedEngine). (Ray actors:
    test_serve_distributed.py.)"""
    from tiny import save_model

    from tfserve import Engine
    from tfserve.config import EngineConfig
    from tfserve.serving.replica import ReplicaSpec
    from tfserve.serving.replicas import start_replicas

    path = str(save_model(tmp_path / "model", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False))
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=8)
    replicated = start_replicas(ReplicaSpec(path, {}, config, 2), lambda: Engine.from_pretrained(path, config))
    return path, config, replicated


async def _stream(replicated, prompt, params):
    """One request's outputs through the replicas' router."""
    request = replicated.engine.make_requests(prompt, params)[0]
    return [output async for output in replicated.generate_request(request)]


def test_a_repeated_prefix_goes_back_to_the_replica_that_served_it():
    router = Router(block_size=4, slack=2)
    system = list(range(100, 116))  # four full blocks
    first = router.pick(system + [1, 2], loads=[0, 0])
    assert first == 0  # unseen: the least busy (the first of equals)
    assert router.pick(system + [3], loads=[1, 0]) == first  # seen: its holder, though another is idler
    assert router.pick(list(range(200, 216)), loads=[1, 0]) == 1  # a new prefix: the least busy
    assert router.pick(list(range(300, 316)), loads=[0, 0]) == 0  # equals take turns
    assert router.pick(list(range(400, 416)), loads=[0, 0]) == 1


def test_a_much_busier_holder_loses_the_prefix_to_the_least_busy():
    router = Router(block_size=4, slack=2)
    prompt = list(range(16))
    assert router.pick(prompt, loads=[0, 0]) == 0
    assert router.pick(prompt, loads=[3, 0]) == 1  # 3 > 0 + slack: moved, and now remembered there
    assert router.pick(prompt, loads=[0, 0]) == 1


def test_the_longest_shared_prefix_decides():
    router = Router(block_size=2, slack=10)
    router.pick([1, 2, 3, 4], loads=[0, 5, 5])  # blocks (1, 2) and (3, 4) -> replica 0
    router.pick([1, 2, 9, 9], loads=[5, 0, 5])  # shares the first block: replica 0 holds it (within slack)
    assert router.pick([1, 2, 9, 9, 7], loads=[0, 0, 0]) == 0
    assert router.pick([5, 6], loads=[3, 3, 0]) == 2  # short and new
    assert router.pick([7, 8], loads=[3, 3, 0]) == 2  # the least busy, whoever's turn it is


async def _through(replicated, replica, prompt, params):
    """One request's outputs from `replica` itself, past the router."""
    request = replicated.engine.make_requests(prompt, params)[0]
    return [output async for output in replicated._stream(replica, request)]


@pytest.mark.slow
def test_two_replicas_keep_prefixes_where_they_are_cached_and_a_third_comes_and_goes(tmp_path):
    """Streamed requests through two replicas (one a process) give one engine's tokens, with more prefix hits than
    random routing; a replica process added at run time serves, and stops when retired."""
    from tfserve import Engine, SamplingParams
    from tfserve.serving.process_replica import STATS_INTERVAL_S

    path, config, replicated = _tiny_replicas(tmp_path, num_blocks=256)
    params = SamplingParams(**PARAMS)
    families = [[10 + f] * 16 for f in range(4)]  # four shared 16-token prefixes (four blocks each)
    rng = random.Random(0)
    prompts = [family + [rng.randrange(20, 300) for _ in range(3)] for family in families for _ in range(4)]
    new_prefixes = [[5] * 8 + [9], [60] * 8 + [9], [70] * 8 + [9]]

    async def main():
        results = []
        for prompt in prompts:  # one at a time: each sees the replicas' state after the last
            results.append(await _stream(replicated, prompt, params))
        return results

    async def scaled():
        grown = await replicated.scale(3)
        results = [await _stream(replicated, prompt, params) for prompt in new_prefixes]  # 3 new prefixes: 1 each
        added = replicated.remotes[-1]
        shrunk = await replicated.scale(1)
        return grown, results, added, shrunk, await _stream(replicated, new_prefixes[0], params)

    try:
        results = asyncio.run(main())
        engine = Engine.from_pretrained(path, config)
        whole = engine.generate_batch(prompts, params)
        time.sleep(STATS_INTERVAL_S * 2)  # a report from the remote replica after its last request
        stats = replicated.replica_stats()
        grown, later, added, shrunk, again = asyncio.run(scaled())
    finally:
        replicated.stop()
    for outputs, expected in zip(results, whole.values()):
        assert outputs[-1].finished and [t for o in outputs for t in o.delta_tokens] == expected.generated_tokens
    assert [s["num_routed"] for s in stats] == [8, 8]  # families spread over both replicas
    assert [s["num_running"] for s in stats] == [0, 0] and [s["num_in_flight"] for s in stats] == [0, 0]
    hits = sum(s["prefix_cache_hit_tokens"] for s in stats)
    # each family's first request misses; the other three find its 16 tokens (random routing: about half)
    assert hits == 4 * 3 * 16

    assert grown["num_replicas"] == 3 and [r["num_routed"] for r in grown["replicas"]][2] == 0
    expected = list(engine.generate_batch(new_prefixes, params).values())
    assert [[t for o in outputs for t in o.delta_tokens] for outputs in later] == \
        [e.generated_tokens for e in expected]
    assert shrunk["num_replicas"] == 1
    added.process.join(10)
    assert not added.process.is_alive()
    assert [t for o in again for t in o.delta_tokens] == expected[0].generated_tokens


@pytest.mark.slow
def test_a_replica_that_hangs_or_dies_leaves_the_others_serving_and_scale_replaces_it(tmp_path, caplog):
    """A replica process stopped (SIGSTOP) never blocks the caller that sends it a request (the event loop: a full
    pipe blocked it); one killed is said once in the log with its signal, its requests fail, its gauges go to 0,
    the router avoids it, and scale() to the same count starts another in its place, which serves."""
    import os
    import signal

    from tfserve import SamplingParams

    path, config, replicated = _tiny_replicas(tmp_path, num_blocks=64)
    remote = replicated.remotes[0]
    params = SamplingParams(**PARAMS)
    try:
        os.kill(remote.process.pid, signal.SIGSTOP)
        big = replicated.engine.make_requests([7] * 200, SamplingParams(max_tokens=2))[0]
        big.token_ids = big.token_ids * 2000  # 400,000 ids: far past a pipe's buffer
        failed = []
        started = time.monotonic()
        remote.add_requests([big], sink=failed.append)
        assert time.monotonic() - started < 1.0
        os.kill(remote.process.pid, signal.SIGCONT)
        os.kill(remote.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while replicated.states() != ["ready", "dead"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replicated.states() == ["ready", "dead"]
        assert failed and failed[-1].finish_reason == "error" and "killed by SIGKILL" in failed[-1].error
        assert [r.getMessage() for r in caplog.records].count(
            f"{failed[-1].error}: its requests fail and it takes no new ones (POST /admin/replicas starts another)") == 1
        assert replicated.replica_stats()[1]["num_running"] == 0
        served = asyncio.run(_stream(replicated, [1, 2, 3, 4, 5], params))  # the router avoids the dead one
        assert served[-1].finished and served[-1].finish_reason == "length"
        described = asyncio.run(replicated.scale(2))
        assert [r["state"] for r in described["replicas"]] == ["ready", "ready"]
        again = asyncio.run(_through(replicated, replicated.remotes[0], [1, 2, 3, 4, 5], params))
        assert [t for o in again for t in o.delta_tokens] == [t for o in served for t in o.delta_tokens]
    finally:
        replicated.stop()


def test_a_dead_replica_fails_what_it_is_sent_and_the_router_avoids_it():
    from tfserve.engine.request import Request
    from tfserve.sampling_params import SamplingParams
    from tfserve.serving.replica import Replica
    from tfserve.serving.replicas import DEAD

    replica = Replica()
    replica.error = "replica 1 exited (code -9)"
    outputs = []
    replica.add_requests([Request("r1", [1, 2, 3], SamplingParams(max_tokens=2))], sink=outputs.append)
    assert outputs[0].finished and outputs[0].error == "replica 1 exited (code -9)"
    router = Router(block_size=4, slack=2)
    prompt = list(range(16))
    assert router.pick(prompt, loads=[0, 0]) == 0
    assert router.pick(prompt, loads=[DEAD, 0]) == 1


def test_a_prefix_held_by_a_replica_since_retired_counts_as_unseen():
    router = Router(block_size=4, slack=2)
    prompt = list(range(16))
    assert router.pick(prompt, loads=[5, 5, 0]) == 2
    assert router.pick(prompt, loads=[0, 1]) == 0  # replica 2 is gone: the least busy


def test_scaling_starts_replicas_and_retires_the_last_once_their_requests_end():
    """Up: the new replicas take requests. Down: the retiring one takes no new request, and is stopped only
    after the one it holds has finished."""
    from tiny import build_engine, build_tokenizer

    from tfserve import SamplingParams
    from tfserve.serving.replica import Replica, ReplicaSpec, failed_output
    from tfserve.serving.replicas import ReplicatedEngine

    class Held(Replica):  # keeps what it is sent until the test finishes it
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index, self.held, self.stopped = index, [], False

        def _submit(self, requests: list) -> None:
            self.held += requests

        def finish(self) -> None:
            self._dispatch([failed_output(request.request_id, "done") for request in self.held])

        def abort(self, request_id: str) -> None:
            pass

        def stop(self, timeout: float = 10.0) -> None:
            self.stopped = True

    engine = build_engine(build_tokenizer(), num_blocks=64)
    replicated = ReplicatedEngine(engine, [], ReplicaSpec("tiny", {}, engine.config, 1))
    replicated._start_remote = Held
    replicated.start()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run(prompt):
        return _stream(replicated, prompt, params)

    async def main():
        assert (await replicated.scale(3))["num_replicas"] == 3
        one, two = replicated.remotes
        first = [asyncio.create_task(run([10 * i + 1] * 8)) for i in range(3)]  # new prefixes: 0, 1, 2 in turn
        await asyncio.sleep(0.1)
        assert len(one.held) == len(two.held) == 1
        retiring = asyncio.create_task(replicated.scale(2))
        await asyncio.sleep(0.2)
        assert not retiring.done() and not two.stopped
        assert replicated.describe()["replicas"][2]["state"] == "retiring"
        later = [asyncio.create_task(run([50 + i] * 8)) for i in range(3)]
        await asyncio.sleep(0.1)
        assert len(two.held) == 1  # nothing new for the retiring replica
        one.finish()
        two.finish()
        state = await retiring
        assert state["num_replicas"] == 2 and two.stopped and not one.stopped
        one.finish()  # what it took meanwhile
        return await asyncio.gather(*first, *later)

    try:
        results = asyncio.run(main())
    finally:
        replicated.stop()
    assert all(outputs[-1].finished for outputs in results)
    with pytest.raises(ValueError, match="at least 1"):
        asyncio.run(replicated.scale(0))


@pytest.mark.slow
def test_replicas_each_split_over_two_ranks_give_one_engines_tokens(tmp_path):
    """`-dp 2 -tp 2`: replica 0 here and replica 1 in its process each start their second rank themselves."""
    from tiny import save_model

    from tfserve import Engine, SamplingParams
    from tfserve.config import EngineConfig
    from tfserve.serving.replica import ReplicaSpec
    from tfserve.serving.replicas import start_replicas

    path = str(save_model(tmp_path / "model", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False))
    config = EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, tensor_parallel_size=2)
    replicated = start_replicas(ReplicaSpec(path, {}, config, 2), lambda: Engine.from_pretrained(path, config))
    params = SamplingParams(**PARAMS)
    prompts = [[5] * 8 + [9], [60] * 8 + [9]]  # new prefixes: replica 0, then replica 1

    async def main():
        return [await _stream(replicated, prompt, params) for prompt in prompts]

    try:
        results = asyncio.run(main())
        stats = replicated.replica_stats()
        process = replicated.remotes[0].process
    finally:
        replicated.stop()
    assert not process.is_alive()
    whole = Engine.from_pretrained(path, EngineConfig(num_blocks=64, block_size=4)).generate_batch(prompts, params)
    for outputs, expected in zip(results, whole.values()):
        assert [t for o in outputs for t in o.delta_tokens] == expected.generated_tokens
    assert [s["num_routed"] for s in stats] == [1, 1]


def test_replicas_take_the_gpus_in_turn():
    from tfserve.serving.replica import gpus_per_actor, replica_device

    assert [replica_device("auto", i, 4) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    assert [replica_device("cuda", i, 2) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert replica_device("auto", 1, 0) == "auto" and replica_device("cuda", 1, 0) == "cuda"  # none: as given
    assert replica_device("cpu", 1, 4) == "cpu" and replica_device("cuda:3", 1, 4) == "cuda:3"  # explicit
    assert gpus_per_actor("cuda") == gpus_per_actor("cuda:1") == 1 and gpus_per_actor("cpu") == 0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_two_replicas_on_a_gpu_serve_one_engines_tokens(tmp_path):
    """Replica 1 (a process) loads on the GPU as replica 0 does, and both replay CUDA graphs."""
    from tiny import save_model

    from tfserve import Engine, SamplingParams
    from tfserve.config import EngineConfig
    from tfserve.serving.process_replica import STATS_INTERVAL_S
    from tfserve.serving.replica import ReplicaSpec
    from tfserve.serving.replicas import start_replicas

    path = str(save_model(tmp_path / "model", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False))
    config = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=8)
    load = {"device": "cuda", "dtype": "float32"}
    replicated = start_replicas(ReplicaSpec(path, load, config, 2),
                                lambda: Engine.from_pretrained(path, config, **load))
    params = SamplingParams(**PARAMS)
    prompts = [[10 + i] * 16 + [7] for i in range(4)]

    async def main():
        return await asyncio.gather(*(_stream(replicated, prompt, params) for prompt in prompts))

    try:
        results = asyncio.run(main())
        time.sleep(STATS_INTERVAL_S * 2)
        stats = replicated.replica_stats()
        assert replicated.engine.device.startswith("cuda")
    finally:
        replicated.stop()
    expected = Engine.from_pretrained(path, config, **load).generate_batch(prompts, params)
    for outputs, want in zip(results, expected.values()):
        assert [t for o in outputs for t in o.delta_tokens] == want.generated_tokens
    assert all(s["num_routed"] > 0 for s in stats)  # both replicas served
