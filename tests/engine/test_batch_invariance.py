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
