"""Prompt logprobs (vLLM's `prompt_logprobs`) equal a plain HF forward of a tiny random llama over the prompt, on
the model's own forward and the lean CPU one, also with chunked prefill, a prefix cached by an earlier request,
preemption and a step retried one request at a time; and they change nothing a request samples.

References are computed before any Engine touches the model (an Engine switches its attention implementation).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tfserve import Engine, SamplingParams  # noqa: E402
from tfserve.engine.kv_cache import BlockPool  # noqa: E402
from tfserve.engine.request import Request  # noqa: E402

VOCAB_SIZE = 256
NUM_TOP = 3
TOLERANCE = 1e-4
WITH = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=NUM_TOP)
PLAIN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BACKENDS = {"hf": dict(forward_backend="hf", cpu_kernels=False), "hf-kernels": dict(forward_backend="hf"),
            "lean": dict(forward_backend="lean")}

_gen = torch.Generator().manual_seed(7)


def _tokens(n: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=_gen).tolist()


PROMPTS = [_tokens(n) for n in (1, 6, 19, 37)]
SHARED = _tokens(24)  # six full blocks of 4
PREFIXED = [SHARED + _tokens(n) for n in (5, 9)]


@pytest.fixture(scope="module")
def reference():
    """(model, prompt -> the log-softmax of a plain forward's logits, [num_tokens, vocab])."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    with torch.inference_mode():
        logprobs = {tuple(p): model(input_ids=torch.tensor([p])).logits[0].float().log_softmax(-1)
                    for p in PROMPTS + PREFIXED}
    return model, logprobs


@pytest.fixture(params=list(BACKENDS))
def make_engine(request, reference):
    model, _ = reference
    backend = BACKENDS[request.param]

    def make(**kwargs) -> Engine:
        engine = Engine(model, None, **{"block_size": 4, "num_blocks": 128, **backend, **kwargs})
        assert engine.runner.forward.name == backend["forward_backend"]
        return engine

    return make


def _run(engine: Engine, items: list[tuple[list[int], SamplingParams]]) -> list:
    """Final outputs of every (prompt, params), in order; every KV block is free again at the end."""
    ids = [engine.add_request(prompt, params)[0] for prompt, params in items]
    finished = {}
    while engine.has_unfinished:
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return [finished[i] for i in ids]


def _check(prompt: list[int], entries: list | None, reference: torch.Tensor) -> None:
    """One entry per prompt token (None first), each as a plain forward scores it."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry = reference[i - 1], entries[i]  # the logits at i - 1 predict token i
        assert entry["token_id"] == prompt[i]
        assert entry["logprob"] == pytest.approx(row[prompt[i]].item(), abs=TOLERANCE), f"token {i}"
        assert entry["rank"] == int((row > row[prompt[i]]).sum()) + 1
        values, ids = row.topk(NUM_TOP)
        assert [t for t, _ in entry["top"]] == ids.tolist()
        assert [lp for _, lp in entry["top"]] == pytest.approx(values.tolist(), abs=TOLERANCE)


def test_prompt_logprobs_match_a_plain_forward(reference, make_engine):
    _, logprobs = reference
    outputs = _run(make_engine(), [(p, WITH) for p in PROMPTS] + [(p, PLAIN) for p in PROMPTS])
    scored, plain = outputs[:len(PROMPTS)], outputs[len(PROMPTS):]
    for prompt, output in zip(PROMPTS, scored):
        _check(prompt, output.prompt_logprobs, logprobs[tuple(prompt)])
    # the extra logits rows move no sampled row: the same greedy tokens as requests that asked for nothing
    assert [o.generated_tokens for o in scored] == [o.generated_tokens for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_chunked_prefill_scores_every_chunk(reference, make_engine):
    _, logprobs = reference
    engine = make_engine(max_batch_tokens=8)
    outputs = _run(engine, [(p, WITH) for p in PROMPTS])
    assert engine.num_steps >= -(-sum(len(p) for p in PROMPTS) // 8)  # the prompts took several steps
    for prompt, output in zip(PROMPTS, outputs):
        _check(prompt, output.prompt_logprobs, logprobs[tuple(prompt)])


def test_a_cached_prefix_is_computed_again(reference, make_engine):
    """A prefix cached by an earlier request is not read: its logits are needed. Requests that ask for no prompt
    logprobs still hit it."""
    _, logprobs = reference
    engine = make_engine()
    (first,) = _run(engine, [(PREFIXED[0], PLAIN)])
    (scored,) = _run(engine, [(PREFIXED[1], WITH)])
    _check(PREFIXED[1], scored.prompt_logprobs, logprobs[tuple(PREFIXED[1])])
    assert scored.metrics.num_cached_tokens == 0
    (again,) = _run(engine, [(PREFIXED[1], PLAIN)])
    assert again.metrics.num_cached_tokens >= len(SHARED)
    assert again.generated_tokens == scored.generated_tokens
    # the hit rate counts the requests that looked the prefix up, not the one that could not
    assert engine.block_pool.stats.num_queried_tokens == len(PREFIXED[0]) + len(PREFIXED[1])


@pytest.mark.parametrize("max_batch_tokens", [512, 8], ids=["whole", "chunked"])
def test_preemption_scores_each_token_once(reference, make_engine, max_batch_tokens):
    _, logprobs = reference
    # 64 slots; the prompts and outputs need 143 together: requests are preempted and recomputed
    engine = make_engine(num_blocks=16, max_batch_tokens=max_batch_tokens)
    outputs = _run(engine, [(p, WITH.replace(max_tokens=20)) for p in PROMPTS])
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(PROMPTS, outputs):
        _check(prompt, output.prompt_logprobs, logprobs[tuple(prompt)])


def test_a_step_retried_one_by_one_scores_each_token_once(reference, make_engine):
    _, logprobs = reference
    engine = make_engine()
    sampler, calls = engine.runner.sampler, []

    def fails_once(logits, requests):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return sampler(logits, requests)

    engine.runner.sampler = fails_once
    outputs = _run(engine, [(p, WITH) for p in PROMPTS[1:]])
    assert calls[0] == len(PROMPTS) - 1  # the first step failed whole, after its prompt logits were computed
    for prompt, output in zip(PROMPTS[1:], outputs):
        _check(prompt, output.prompt_logprobs, logprobs[tuple(prompt)])


def test_a_request_for_prompt_logprobs_reads_no_cached_prefix():
    """Model-free: the block pool hands a cached prefix to a plain request only."""
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(10))
    earlier = Request("a", tokens, PLAIN)
    assert pool.allocate(earlier, len(tokens))
    pool.commit()
    pool.free_request(earlier)
    assert len(pool.find_cached_prefix(Request("b", tokens, PLAIN))) == 2
    assert pool.find_cached_prefix(Request("c", tokens, WITH)) == []
    done = Request("d", tokens, WITH)
    done.prompt_logprobs.extend([{}] * (len(tokens) - 1))  # all gathered (a recompute after preemption): it may
    assert len(pool.find_cached_prefix(done)) == 2


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_prompt_logprobs_is_validated(value):
    with pytest.raises(ValueError, match="^prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
