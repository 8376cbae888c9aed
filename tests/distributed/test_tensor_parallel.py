"""Tensor parallelism: a model split across 2 gloo ranks (processes) on this CPU gives the greedy tokens of the
whole model, for tiny random models of several architectures, even and uneven splits."""

from __future__ import annotations

import pytest
from tiny import save_model

from tfserve.engine.parallel.tensor_parallel import split, why_not

pytestmark = pytest.mark.slow


def greedy(engine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    from tfserve import SamplingParams

    outputs = engine.generate_batch(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [o.generated_tokens for o in outputs.values()]


def test_split_is_contiguous_and_as_even_as_can_be():
    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(8, 2) == [(0, 4), (4, 8)]
    assert split(5, 3) == [(0, 2), (2, 4), (4, 5)]


CASES = [  # architecture, query heads, KV heads, vocabulary, tied embeddings
    ("LlamaForCausalLM", 6, 3, 321, True),  # uneven heads (2 + 1 KV heads) and vocabulary, tied head
    ("Qwen2ForCausalLM", 4, 2, 320, False),  # q/k/v biases
    ("Phi3ForCausalLM", 6, 3, 321, False),  # q/k/v in one layer, gate/up in one layer, split unevenly
    # even; scaled embedding, per-head q/k norms (Qwen3's too), norms after each block (after the all-reduce)
    ("Gemma3ForCausalLM", 4, 2, 320, False),
]


@pytest.mark.parametrize("architecture,heads,kv_heads,vocab,tie", CASES)
def test_two_ranks_give_the_whole_models_greedy_tokens(tmp_path, architecture, heads, kv_heads, vocab, tie):
    from tfserve import Engine

    path = save_model(tmp_path / "model", architecture, heads=heads, kv_heads=kv_heads, vocab=vocab, tie=tie)
    prompts = [[5, 17, 42, 7, 99, 3], [8, 8, 9], list(range(10, 60))]  # the last one prefills in chunks
    options = {"num_blocks": 64, "block_size": 4, "max_batch_tokens": 32}
    whole = greedy(Engine.from_pretrained(str(path), **options), prompts)
    engine = Engine.from_pretrained(str(path), tensor_parallel_size=2, **options)
    try:
        assert "tensor-parallel x2" in engine.runner.forward.name
        assert engine.runner.num_kv_heads == -(-kv_heads // 2)  # rank 0 holds the larger half
        assert engine.tensor_parallel.shm is not None  # one machine, CPU kernels: shared-memory collectives
        split_tokens = greedy(engine, prompts)
    finally:
        engine.close()
    assert split_tokens == whole
    assert all(not p.is_alive() for p in engine._workers.processes)


def test_models_that_cannot_split_say_why():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=1))
    assert "1 key/value heads, fewer than --tensor-parallel-size 2" in why_not(model, 2)
    assert why_not(model, 1) is None


def test_without_the_cpu_kernels_the_collectives_go_through_gloo(tmp_path):
    """Shared-memory collectives need the CPU kernels; without them every rank uses gloo, with the same tokens."""
    from tfserve import Engine

    path = save_model(tmp_path / "model", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    prompts = [[5, 17, 42, 7, 99, 3], [8, 8, 9]]
    options = {"num_blocks": 64, "block_size": 4, "cpu_kernels": False}
    whole = greedy(Engine.from_pretrained(str(path), **options), prompts)
    engine = Engine.from_pretrained(str(path), tensor_parallel_size=2, **options)
    try:
        assert engine.tensor_parallel.shm is None
        assert greedy(engine, prompts) == whole
    finally:
        engine.close()


@pytest.mark.slow
def test_an_idle_engine_keeps_its_ranks_past_the_collectives_timeout(tmp_path):
    """The worker ranks wait for the next step in a broadcast with the collectives' timeout: rank 0 keeps them
    alive while it has no step to send (an idle server's ranks all failed once --distributed-timeout passed)."""
    import time

    from tfserve import Engine

    path = save_model(tmp_path / "model", "LlamaForCausalLM", heads=4, kv_heads=2, vocab=320, tie=False)
    prompts = [[5, 17, 42, 7, 99, 3]]
    engine = Engine.from_pretrained(str(path), tensor_parallel_size=2, num_blocks=64, block_size=4,
                                    distributed_timeout_s=10.0)  # (the ranks load within it)
    try:
        first = greedy(engine, prompts)
        time.sleep(22)  # idle for more than twice the timeout
        assert not engine._workers.dead() and greedy(engine, prompts) == first
    finally:
        engine.close()
    assert all(not p.is_alive() for p in engine._workers.processes)
