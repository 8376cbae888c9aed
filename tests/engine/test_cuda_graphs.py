"""CUDA graphs of decode steps (engine/backends/cuda_graphs.py).

On CPU the same buffers, buckets, padding and scratch block run with a "graph" that replays by running its step
again, so what a graph adds to a step is checked in CI; on a CUDA device (skipped without one) real graphs are
captured and replayed against eager runs."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tfserve import SamplingParams
from tfserve.engine.backends import cuda_graphs
from tfserve.engine.backends.cuda_graphs import DecodeGraphs, batch_buckets
from tiny import run_engine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["hello world", "Once upon a time there was", "the quick brown fox jumps over the lazy dog. " * 3,
           "héllo", "stop here. The end!", "a tiny model that served", "many requests", "at once"]


class ReplayByRunning:
    """A captured step on CPU: replaying it runs it again, over the same buffers."""

    def __init__(self, step, pool) -> None:
        step()  # the warm-up, as a capture does
        self.step = step

    def replay(self) -> None:
        self.step()

    @staticmethod
    def pool():
        return None


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Graphs on CPU: the runner builds DecodeGraphs there, whose captures replay by running."""
    monkeypatch.setattr(cuda_graphs, "why_not", lambda *args: None)
    monkeypatch.setattr(cuda_graphs, "CudaGraph", ReplayByRunning)


def _generate(engine, max_tokens=(3, 9, 17, 5, 12, 30, 1, 8), **params):
    """Greedy generations of PROMPTS, each to its own length: the batch shrinks step by step across buckets."""
    outputs = run_engine(engine, [(p, SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, **params))
                                  for p, n in zip(PROMPTS, max_tokens)])
    assert [o.finish_reason for o in outputs] == ["length"] * len(outputs), [o.error for o in outputs]
    return outputs


def test_buckets_cover_every_batch_up_to_the_largest():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(65)[-1] == 72
    graphs = DecodeGraphs(lambda *a: None, [], block_size=16, scratch_block=10, max_batch=20, max_model_len=1000,
                          device=torch.device("cpu"))
    assert graphs.max_blocks == 64  # 63 blocks hold 1000 tokens: a power of two
    assert graphs.bucket(1, 1) == (1, 1)
    assert graphs.bucket(3, 5) == (4, 8)
    assert graphs.bucket(17, 33) == (24, 64)
    assert graphs.bucket(25, 1) is None and graphs.bucket(2, 65) is None  # eager: past the largest bucket


def test_decode_steps_replay_graphs_and_give_the_eager_tokens(cpu_graphs, make_engine):
    eager = _generate(make_engine(cpu_kernels=False, cuda_graph=False))
    engine = make_engine(cpu_kernels=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.failed is None
    # the spare rows' scratch block is in the cache but never in the pool
    assert engine.runner.kv_caches[0][0].shape[0] == engine.block_pool.num_blocks + 1 == graphs.scratch_block + 1
    graphed = _generate(engine)
    assert [o.generated_tokens for o in graphed] == [o.generated_tokens for o in eager]
    for a, b in zip(graphed, eager):
        assert [e["logprob"] for e in a.logprobs] == pytest.approx([e["logprob"] for e in b.logprobs], abs=1e-5)
    batches = {batch for batch, _ in graphs.graphs}
    assert {8, 4, 2, 1} <= batches  # the batch shrank from 8 through every bucket
    assert graphs.num_replays >= 25  # the longest request decodes alone for its last steps


@pytest.mark.parametrize("backend", ["hf", "lean"])
@pytest.mark.parametrize("arch", ["mistral", "qwen3", "smollm3", "phi3", "gemma3"])
def test_every_architecture_replays_the_eager_tokens(cpu_graphs, arch, backend):
    """Sliding windows (in the padded keys' mask), layers without rotary, fused projections, per-head norms."""
    from test_lean_forward import _model

    from tfserve import Engine

    model = _model(arch).eval()
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 19, 9, 30, 5)]

    def run(**kwargs):
        engine = Engine(model, None, block_size=4, num_blocks=128, max_num_seqs=8, cpu_kernels=False,
                        forward_backend=backend, **kwargs)
        outputs = run_engine(engine, [(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                                      for p, n in zip(prompts, (4, 11, 16, 7, 13))])
        return [o.generated_tokens for o in outputs], engine

    expected, _ = run(cuda_graph=False)
    tokens, engine = run()
    assert tokens == expected
    assert engine.runner.forward.name == backend and engine.runner.graphs.num_replays >= 8


def test_metrics_count_the_graphs_captured_and_replayed(cpu_graphs, make_engine):
    from types import SimpleNamespace

    from tfserve.server.runtime.metrics import ServerMetrics

    engine = make_engine(cpu_kernels=False)
    _generate(engine)
    registry = ServerMetrics(SimpleNamespace(engine=engine, num_waiting=0, num_queued=0, speech=None)).registry
    graphs = engine.runner.graphs
    assert registry.get_sample_value("tfserve_cuda_graphs_captured") == len(graphs.graphs) >= 4
    assert registry.get_sample_value("tfserve_cuda_graph_replays") == graphs.num_replays >= 25


def test_a_failed_capture_turns_graphs_off_and_steps_run_eagerly(cpu_graphs, make_engine, monkeypatch, caplog):
    class Failing(ReplayByRunning):
        def __init__(self, step, pool) -> None:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    eager = _generate(make_engine(cpu_kernels=False, cuda_graph=False))
    monkeypatch.setattr(cuda_graphs, "CudaGraph", Failing)
    engine = make_engine(cpu_kernels=False)
    with caplog.at_level(logging.WARNING, logger="tfserve.engine.backends.cuda_graphs"):
        outputs = _generate(engine)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in eager]
    assert engine.runner.graphs.failed == "operation not permitted when stream is capturing"
    warnings = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(warnings) == 1 and "more" not in warnings[0]  # once, in one line


def test_steps_a_graph_cannot_take_run_eagerly(cpu_graphs, make_engine):
    """Prefills, checked proposals and prompt logprobs go eagerly; the rest of the same requests' steps replay."""
    eager = _generate(make_engine(cpu_kernels=False, cuda_graph=False, speculative="ngram"), prompt_logprobs=1)
    engine = make_engine(cpu_kernels=False, speculative="ngram")
    graphed = _generate(engine, prompt_logprobs=1)
    assert [o.generated_tokens for o in graphed] == [o.generated_tokens for o in eager]
    assert engine.runner.graphs.num_replays > 0


def test_on_cpu_there_are_no_graphs_and_asking_for_them_says_so(make_engine, caplog):
    assert make_engine().runner.graphs is None  # auto: a CUDA device only
    with caplog.at_level(logging.WARNING, logger="tfserve.engine.runner"):
        engine = make_engine(cuda_graph=True)
    assert engine.runner.graphs is None
    assert engine.runner.kv_caches[0][0].shape[0] == engine.block_pool.num_blocks  # no scratch block
    assert any("cuda_graph has no effect: the model is on cpu" in r.getMessage() for r in caplog.records)


def test_prompts_attend_whatever_layout_sdpa_returns(make_engine, monkeypatch):
    """CUDA's SDPA kernels return [seqs, heads, queries, dim] laid out as [seqs, queries, heads, dim], which a
    view of the prefill group's output could not take: every float32 prompt on CUDA failed."""
    from tfserve.engine import attention

    expected = _generate(make_engine(cpu_kernels=False))
    sdpa = attention.F.scaled_dot_product_attention

    def as_cuda_lays_it_out(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", as_cuda_lays_it_out)
    outputs = _generate(make_engine(cpu_kernels=False))
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in expected]


# -- on a CUDA device ---------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype,backend", [(torch.float32, "hf"), (torch.float32, "lean"), (torch.bfloat16, "hf")])
def test_cuda_graphs_replay_decode_steps(llama, tokenizer, dtype, backend):
    from tfserve import Engine

    model = llama.to("cuda", dtype)
    try:
        def make(**kwargs):
            return Engine(model, tokenizer, block_size=4, num_blocks=128, max_num_seqs=8, forward_backend=backend,
                          **kwargs)

        eager = _generate(make(cuda_graph=False))
        engine = make()
        graphs = engine.runner.graphs
        assert engine.runner.forward.name == backend
        outputs = _generate(engine)
        assert graphs.failed is None, graphs.failed
        assert all(isinstance(g, cuda_graphs.CudaGraph) for g in graphs.graphs.values())
        assert {8, 4, 2, 1} <= {batch for batch, _ in graphs.graphs} and graphs.num_replays >= 25
        tokens = [t for o in outputs for t in o.generated_tokens]
        expected = [t for o in eager for t in o.generated_tokens]
        assert len(tokens) == len(expected)
        if dtype == torch.float32:
            assert tokens == expected
        else:  # bfloat16: another batch shape may flip a near-tie, and what follows it
            assert sum(a == b for a, b in zip(tokens, expected)) >= 0.8 * len(expected)
    finally:
        llama.to("cpu", torch.float32)


@cuda
def test_a_forward_that_syncs_falls_back_to_eager_on_cuda(llama, tokenizer, caplog):
    from tfserve import Engine

    model = llama.to("cuda")
    try:
        eager = _generate(Engine(model, tokenizer, block_size=4, num_blocks=128, max_num_seqs=8, cuda_graph=False))
        engine = Engine(model, tokenizer, block_size=4, num_blocks=128, max_num_seqs=8)
        graphs = engine.runner.graphs
        forward = graphs.forward

        def syncing(ids, positions, index):
            int(positions.max())  # a host read: not capturable
            return forward(ids, positions, index)

        graphs.forward = syncing
        with caplog.at_level(logging.WARNING, logger="tfserve.engine.backends.cuda_graphs"):
            outputs = _generate(engine)
        assert graphs.failed is not None and not graphs.graphs
        assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in eager]
    finally:
        llama.to("cpu")


@cuda
def test_cuda_graphs_on_the_engine_thread_with_arrivals_and_an_abort(llama, tokenizer):
    """As the server runs it: the engine steps on its own thread, requests arrive while others decode (batches
    change bucket), one is aborted mid-way; the rest get the tokens of an eager engine."""
    from tfserve import Engine
    from tfserve.engine.manager import BatchingManager

    model = llama.to("cuda")
    try:
        def make(**kwargs):
            return Engine(model, tokenizer, block_size=4, num_blocks=512, max_num_seqs=8, **kwargs)

        expected = _generate(make(cuda_graph=False), max_tokens=(20,) * len(PROMPTS))
        engine = make()
        with BatchingManager(engine) as manager:
            ids = []
            for i, prompt in enumerate(PROMPTS):
                ids.append(manager.add_request(prompt, params=SamplingParams(max_tokens=400 if i == 3 else 20,
                                                                             temperature=0.0)))
                time.sleep(0.005)
            manager.abort(ids[3])
            results = [manager.get_result(i, timeout=120) for i in ids]
            after = manager.get_result(manager.add_request(PROMPTS[0], params=SamplingParams(
                max_tokens=20, temperature=0.0)), timeout=120)
        assert results[3].finish_reason == "abort"
        kept = [i for i in range(len(PROMPTS)) if i != 3]
        assert [results[i].generated_tokens for i in kept] == [expected[i].generated_tokens for i in kept]
        assert after.generated_tokens == expected[0].generated_tokens
        assert engine.runner.graphs.failed is None and engine.runner.graphs.num_replays > 0
    finally:
        llama.to("cpu")


@cuda
def test_a_compiled_forward_is_captured_too(llama, tokenizer):
    from tfserve import Engine

    model = llama.to("cuda")
    try:
        def make(**kwargs):
            return Engine(model, tokenizer, block_size=4, num_blocks=128, max_num_seqs=8, forward_backend="hf",
                          **kwargs)

        expected = [t for o in _generate(make(cuda_graph=False)) for t in o.generated_tokens]
        engine = make(compile=True)
        assert engine.runner.forward.name == "compiled" and not engine.runner.forward.eager
        tokens = [t for o in _generate(engine) for t in o.generated_tokens]
        graphs = engine.runner.graphs
        assert graphs.failed is None, graphs.failed
        assert graphs.num_replays >= 25
        # inductor fuses in its own order: float32 sums may part in the last bits, and a near-tie with them
        assert sum(a == b for a, b in zip(tokens, expected)) >= 0.9 * len(expected)
    finally:
        llama.to("cpu")
