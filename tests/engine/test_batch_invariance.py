"""A request's results do not depend on what else the engine runs: the same prompt gives the very same
log-probabilities (bit for bit, float32 on the CPU kernels) alone, prefilled in one step beside a prompt of
another length, in chunks, and after a cached prefix. (Prompt attention through SDPA, padded to the step's
longest prompt, failed the neighbour cases here: its CPU kernel tiles by the padded shapes.)"""

from __future__ import annotations

import random

import pytest

from tfserve import SamplingParams
from tiny import run_engine as run


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def bits(output) -> list[tuple[int, float]]:
    return [(entry["token_id"], entry["logprob"]) for entry in output.logprobs]


@pytest.mark.parametrize("length,other", [(11, 13), (150, 200), (100, 400)])
def test_a_prompt_gets_the_same_bits_whatever_runs_beside_it(make_engine, length, other):
    rng = random.Random(length)
    prompt, neighbour = ([rng.randrange(3, 320) for _ in range(n)] for n in (length, other))

    def engine(**kwargs):
        return make_engine(**{"num_blocks": 400, "max_batch_tokens": 1024, **kwargs})

    (alone,) = run(engine(), [(prompt, params())])
    (_, beside) = run(engine(), [(neighbour, params()), (prompt, params())])  # one step, padded to the longest
    assert bits(beside) == bits(alone)
    (_, chunked) = run(engine(max_batch_tokens=24), [(neighbour[:30], params()), (prompt, params())])
    assert bits(chunked) == bits(alone)
    cached_engine = engine()
    run(cached_engine, [(prompt[:length * 2 // 3] + neighbour[:5], params())])
    (cached,) = run(cached_engine, [(prompt, params())])
    assert cached.metrics.num_cached_tokens > 0
    assert bits(cached) == bits(alone)


@pytest.fixture
def sharp_engine(llama, tokenizer):
    """An engine over a copy of the tiny llama whose attention matters: its random weights give scores and
    outputs well below the residual's rounding, where a last-bit difference in attention vanishes (a prompt
    tile summing one score's products in another order passed); scaled up, it shows."""
    import copy

    import torch

    from tfserve import Engine

    model = copy.deepcopy(llama)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, scale in (("q_proj", 6.0), ("k_proj", 6.0), ("v_proj", 8.0), ("o_proj", 8.0)):
                getattr(layer.self_attn, proj).weight.mul_(scale)

    def make(**kwargs):
        return Engine(model, tokenizer, **{"block_size": 4, "num_blocks": 400, "max_num_seqs": 8,
                                           "max_batch_tokens": 64, **kwargs})

    return make


@pytest.mark.parametrize("length,reply", [(9, 30), (140, 130)])
def test_a_reply_from_the_prefix_cache_gives_a_later_prompt_the_bits_of_computing_it_afresh(sharp_engine, length,
                                                                                            reply):
    """A multi-turn chat: the first reply's keys and values were computed as decodes (one row a step) and sit in
    the prefix cache; the next turn's prompt contains them. Computed afresh, the same positions are prompt rows
    (the prompt tiles): either way the next turn gets the same bits."""
    rng = random.Random(length)
    first, question = [rng.randrange(3, 320) for _ in range(length)], [rng.randrange(3, 320) for _ in range(7)]
    replying = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    warm = sharp_engine()
    (answer,) = run(warm, [(first, replying)])
    second = first + answer.generated_tokens + question
    (from_cache,) = run(warm, [(second, params())])
    assert from_cache.metrics.num_cached_tokens > length  # the reply's full blocks came from the cache
    (afresh,) = run(sharp_engine(), [(second, params())])
    assert afresh.metrics.num_cached_tokens == 0
    assert bits(from_cache) == bits(afresh)
