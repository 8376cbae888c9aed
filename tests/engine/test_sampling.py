"""Sampling through the engine on a tiny random llama: seeds, greedy equivalences, n, logprobs, penalties,
and parameter validation at `add_request`."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tfserve import SamplingParams
from tiny import run_engine as run

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 23]
OTHER_PROMPTS = [[9, 8, 7, 6, 5, 4, 3], [200, 201, 202], list(range(30, 55)), [77] * 9]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def sampled(seed: int | None = None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 1.0)
    return SamplingParams(seed=seed, ignore_eos=True, **kwargs)


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


def test_seeded_sampling_reproducible_across_batch_compositions(make_engine):
    engine = make_engine()
    params = sampled(seed=1234)
    (alone,) = run(engine, [(PROMPT, params)])
    assert len(alone.generated_tokens) == 16

    mixed = [(p, sampled()) for p in OTHER_PROMPTS[:2]] + [(PROMPT, params)] + [(p, sampled()) for p in OTHER_PROMPTS[2:]]
    outputs = run(engine, mixed)
    assert outputs[2].generated_tokens == alone.generated_tokens

    # A different engine (fresh state), a chunked prefill and other seeded neighbours: still the same.
    engine = make_engine(max_batch_tokens=8)
    outputs = run(engine, [(OTHER_PROMPTS[0], sampled(seed=7)), (PROMPT, params), (OTHER_PROMPTS[2], sampled())])
    assert outputs[1].generated_tokens == alone.generated_tokens

    # Preempted and recomputed midway: its generator carries on where it was.
    engine = make_engine(num_blocks=12)
    outputs = run(engine, [(PROMPT, params), (OTHER_PROMPTS[2], sampled()), (OTHER_PROMPTS[3], sampled())])
    assert engine.scheduler.num_preemptions > 0
    assert outputs[0].generated_tokens == alone.generated_tokens


def test_a_seeded_request_samples_the_same_whatever_its_neighbours_ask(make_engine):
    """A top-p row whose nucleus lies among its 256 likeliest tokens samples there, another over the whole
    vocabulary: each row takes its own road, so a neighbour without top-p (once the whole batch's road) or a
    greedy one changes nothing; and sample i of n (seeded seed + i) is the request of its own with that seed."""
    engine = make_engine()
    params = sampled(seed=42, top_p=0.5)
    (alone,) = run(engine, [(PROMPT, params)])
    for neighbour in (sampled(top_p=1.0), sampled(seed=3, top_p=0.5), sampled(min_p=0.1), greedy()):
        outputs = run(engine, [(OTHER_PROMPTS[0], neighbour), (PROMPT, params)])
        assert outputs[1].generated_tokens == alone.generated_tokens, neighbour
    children = run(engine, [(PROMPT, sampled(seed=42, top_p=0.5, n=3)), (OTHER_PROMPTS[1], sampled())])[:3]
    for i, child in enumerate(children):
        (own,) = run(engine, [(PROMPT, sampled(seed=42 + i, top_p=0.5))])
        assert child.generated_tokens == own.generated_tokens


def test_different_seeds_differ(make_engine):
    engine = make_engine()
    a, b = run(engine, [(PROMPT, sampled(seed=1)), (PROMPT, sampled(seed=2))])
    assert a.generated_tokens != b.generated_tokens


def test_temperature_zero_equals_hf_greedy(make_engine, llama):
    reference = hf_greedy(llama, PROMPT, 16)
    engine = make_engine()
    (out,) = run(engine, [(PROMPT, greedy())])
    assert out.generated_tokens == reference


def test_top_k_1_equals_greedy(make_engine):
    engine = make_engine()
    (reference,) = run(engine, [(PROMPT, greedy())])
    # Mixed with sampled rows, so the vectorised sampling path (not the all-greedy shortcut) runs.
    outputs = run(engine, [(OTHER_PROMPTS[0], sampled()), (PROMPT, sampled(top_k=1)),
                           (PROMPT, SamplingParams(temperature=1.7, top_k=1, seed=3, max_tokens=16, ignore_eos=True))])
    assert outputs[1].generated_tokens == reference.generated_tokens
    assert outputs[2].generated_tokens == reference.generated_tokens


def test_greedy_row_in_a_sampled_batch_stays_greedy(make_engine):
    engine = make_engine()
    (reference,) = run(engine, [(PROMPT, greedy())])
    outputs = run(engine, [(OTHER_PROMPTS[1], sampled(top_p=0.9, min_p=0.05, top_k=50)), (PROMPT, greedy())])
    assert outputs[1].generated_tokens == reference.generated_tokens


def test_a_temperature_too_small_to_divide_by_is_greedy(make_engine):
    """Logits divided by 1e-30 overflow float32 to inf (NaN probabilities): below MIN_TEMPERATURE is greedy."""
    engine = make_engine()
    (reference,) = run(engine, [(PROMPT, greedy())])
    outputs = run(engine, [(OTHER_PROMPTS[0], sampled()), (PROMPT, sampled(temperature=1e-30)),
                           (PROMPT, sampled(temperature=1e-45, seed=5))])
    assert outputs[1].generated_tokens == reference.generated_tokens
    assert outputs[2].generated_tokens == reference.generated_tokens


def test_a_tiny_repetition_penalty_stays_finite(make_engine):
    """A repetition penalty of 1e-42 divides the seen tokens' positive logits past float32: they are bounded, so
    the seen tokens win (what such a penalty asks) instead of NaN probabilities giving token 0."""
    engine = make_engine()
    for params in [sampled(repetition_penalty=1e-42, seed=2), greedy(repetition_penalty=1e-42)]:
        (out,) = run(engine, [(PROMPT, params)])
        seen = set(PROMPT) | set(out.generated_tokens[:1])
        assert 0 not in out.generated_tokens and set(out.generated_tokens) <= seen


def test_tiny_top_p_and_full_min_p_reduce_to_greedy(make_engine):
    engine = make_engine()
    (reference,) = run(engine, [(PROMPT, greedy())])
    outputs = run(engine, [(PROMPT, sampled(top_p=1e-6)), (PROMPT, sampled(min_p=1.0))])
    assert outputs[0].generated_tokens == reference.generated_tokens
    assert outputs[1].generated_tokens == reference.generated_tokens


def test_top_p_min_p_top_k_sample_valid_tokens(make_engine, llama):
    engine = make_engine()
    outputs = run(engine, [(PROMPT, sampled(seed=1, top_p=0.5)), (PROMPT, sampled(seed=2, min_p=0.2)),
                           (PROMPT, sampled(seed=3, top_k=5, top_p=0.9, min_p=0.01, temperature=0.7))])
    for out in outputs:
        assert len(out.generated_tokens) == 16
        assert all(0 <= t < llama.config.vocab_size for t in out.generated_tokens)
        assert out.finish_reason == "length"


def test_top_k_restricts_to_the_k_most_likely(make_engine, llama):
    engine = make_engine()
    (out,) = run(engine, [(PROMPT, sampled(seed=11, top_k=3, max_tokens=1, logprobs=3))])
    allowed = {token for token, _ in out.logprobs[0]["top"]}
    assert out.generated_tokens[0] in allowed


def test_n_gives_children_sharing_the_prompt_blocks(make_engine):
    engine = make_engine()
    ids = engine.add_request(PROMPT, sampled(seed=5, n=2, max_tokens=8), request_id="r")
    assert ids == ["r-0", "r-1"]
    results = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
    assert set(results) == {"r-0", "r-1"}
    assert results["r-0"].generated_tokens != results["r-1"].generated_tokens
    assert all(len(r.generated_tokens) == 8 for r in results.values())
    assert all(r.prompt_token_ids == PROMPT for r in results.values())
    # The second child reuses the first's full prompt blocks.
    assert engine.block_pool.stats.num_hit_tokens >= (len(PROMPT) - 1) // 4 * 4
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks

    outs = make_engine().generate_batch([PROMPT, OTHER_PROMPTS[0]], sampled(n=2, max_tokens=4))
    assert list(outs) == ["0-0", "0-1", "1-0", "1-1"]


def test_logprobs(make_engine, llama):
    engine = make_engine()
    (out,) = run(engine, [(PROMPT, greedy(max_tokens=5, logprobs=3))])
    assert len(out.logprobs) == 5
    for token, entry in zip(out.generated_tokens, out.logprobs):
        assert entry["token_id"] == token
        assert len(entry["top"]) == 3
        top_ids = [t for t, _ in entry["top"]]
        top_values = [v for _, v in entry["top"]]
        assert top_ids[0] == token  # greedy picks the most likely
        assert top_values == sorted(top_values, reverse=True)
        assert entry["logprob"] == pytest.approx(top_values[0])
        assert entry["logprob"] <= 0

    with torch.inference_mode():
        logits = llama(torch.tensor([PROMPT])).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0]["logprob"] == pytest.approx(expected[out.generated_tokens[0]].item(), abs=1e-4)
    expected_top = expected.topk(3)
    assert [t for t, _ in out.logprobs[0]["top"]] == expected_top.indices.tolist()

    (none,) = run(engine, [(PROMPT, greedy(max_tokens=2))])
    assert none.logprobs is None
    (only_chosen,) = run(engine, [(PROMPT, greedy(max_tokens=2, logprobs=0))])
    assert [e["top"] for e in only_chosen.logprobs] == [[], []]


def test_repetition_penalty_matches_hf(make_engine, llama):
    reference = hf_greedy(llama, PROMPT, 16, repetition_penalty=1.5)
    engine = make_engine()
    plain, penalised = run(engine, [(PROMPT, greedy()), (PROMPT, greedy(repetition_penalty=1.5))])
    assert penalised.generated_tokens == reference
    assert penalised.generated_tokens != plain.generated_tokens


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}])
def test_presence_and_frequency_penalties_change_output(make_engine, penalty):
    engine = make_engine()
    plain, penalised = run(engine, [(PROMPT, greedy(max_tokens=24)), (PROMPT, greedy(max_tokens=24, **penalty))])
    assert penalised.generated_tokens != plain.generated_tokens
    # Repeats cost more, so the penalised output repeats no more than the plain one.
    assert len(set(penalised.generated_tokens)) >= len(set(plain.generated_tokens))


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("temperature", -1), ("top_p", -0.1), ("n", 0),
                                          ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0),
                                          ("presence_penalty", 3), ("logprobs", 21), ("stop", [""]), ("stop", 0),
                                          ("stop", False), ("stop_token_ids", 0)])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_replace_validates_again():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams().replace(max_tokens=0)


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "prompt"),
    (list(range(10)), SamplingParams(max_tokens=510), "max_tokens"),
    ([1] * 600, SamplingParams(max_tokens=1), "the prompt is 600 tokens"),  # ContextLengthError, param prompt
    ([1, 2, 100000], None, "vocab"),
    ([1, -1], None, "vocab"),
    ([1, 2], {"max_tokens": 3}, "params"),
    ("text", None, "tokenizer"),
    ([1, 2], SamplingParams(stop=["x"]), "stop"),
])
def test_add_request_rejects_bad_input_before_queueing(make_engine, prompt, params, match):
    engine = make_engine(with_tokenizer=False)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert engine.requests == {}
    assert not engine.has_unfinished
    assert engine.step() == []


def test_add_request_rejects_more_blocks_than_the_pool_has(make_engine):
    engine = make_engine(num_blocks=4)  # 16 tokens at block_size 4
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(list(range(10)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished


def test_duplicate_request_id_rejected(make_engine):
    engine = make_engine()
    engine.add_request(PROMPT, greedy(), request_id="x")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(PROMPT, greedy(), request_id="x")
    assert engine.num_waiting == 1


def test_generation_config_accepted(make_engine):
    engine = make_engine()
    (reference,) = run(engine, [(PROMPT, greedy(max_tokens=6))])
    (out,) = run(engine, [(PROMPT, GenerationConfig(max_new_tokens=6, do_sample=False))])
    assert out.generated_tokens == reference.generated_tokens
    assert out.finish_reason == "length"

    (stopped,) = run(engine, [(PROMPT, GenerationConfig(max_new_tokens=6, do_sample=False,
                                                        eos_token_id=reference.generated_tokens[2]))])
    first = reference.generated_tokens.index(reference.generated_tokens[2])
    assert stopped.generated_tokens == reference.generated_tokens[: first + 1]
    assert stopped.finish_reason == "stop"

    (sampled_out,) = run(engine, [(PROMPT, GenerationConfig(max_new_tokens=5, do_sample=True, top_k=10))])
    assert len(sampled_out.generated_tokens) == 5


def test_n_with_a_clashing_child_id_queues_nothing(make_engine):
    engine = make_engine()
    engine.add_request(PROMPT, greedy(), request_id="r-1")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(PROMPT, sampled(n=2), request_id="r")
    assert set(engine.requests) == {"r-1"}
    assert engine.num_waiting == 1


def test_top_p_over_candidates_equals_sorting_the_whole_vocabulary():
    import torch

    from tfserve.engine.sampler import _nucleus, _nucleus_candidates
    from tfserve.sampling_params import SamplingParams

    def reference(probs, top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before > top_p[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)

    gen = torch.Generator().manual_seed(0)
    peaked = (torch.randn(3, 5000, generator=gen) * 8).softmax(-1)  # nucleus among the first 256
    flat = torch.randn(3, 5000, generator=gen).softmax(-1)  # it is not: the whole vocabulary is sorted
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 6
    for probs in (peaked, torch.cat([peaked, flat])):
        top_p = torch.full((probs.shape[0],), 0.9)
        rows, values, ids = _nucleus_candidates(probs, params[: probs.shape[0]], [False] * probs.shape[0])
        assert rows == [0, 1, 2]  # the peaked rows, each judged on its own
        # (scatter_add: a row's zero padding points at token 0, which may be a candidate of its own)
        assert torch.equal(torch.zeros_like(probs[rows]).scatter_add_(1, ids, _nucleus(values, top_p[rows])),
                           reference(probs[rows], top_p[rows]))
    assert _nucleus_candidates(flat, params[:3], [False] * 3)[0] == []
    # rows whose tokens above 1/1024 hold the nucleus, rows that need their 256 likeliest, rows that need more
    # one token of 0.7 and 240 just under the floor: the floor holds 0.7 only, the 256 likeliest 0.93
    middling = torch.full((3, 5000), (1 - 0.7 - 240 * 0.00095) / 4759)
    middling[:, 0], middling[:, 1:241] = 0.7, 0.00095
    middling = middling * (1 + 0.01 * torch.rand(3, 5000, generator=gen))  # no ties: sort and top-k agree
    middling = (middling / middling.sum(-1, keepdim=True))[:, torch.randperm(5000, generator=gen)]
    probs = torch.cat([flat[:1], middling, peaked])
    above = (probs > 1 / 1024).float() * probs
    assert (above.sum(-1) > 0.9).tolist() == [False, False, False, False, True, True, True]
    rows, values, ids = _nucleus_candidates(probs, params + params[:1], [False] * 7)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    top_p = torch.full((len(rows),), 0.9)
    assert torch.equal(torch.zeros_like(probs[rows]).scatter_add_(1, ids, _nucleus(values, top_p)),
                       reference(probs[rows], top_p))


def test_top_p_by_buckets_equals_sorting_the_whole_vocabulary():
    import torch

    from tfserve.engine.sampler import _apply_top_p

    gen = torch.Generator().manual_seed(1)
    vocab = 12288
    peaked = (torch.randn(2, vocab, generator=gen) * 8).softmax(-1)
    medium = (torch.randn(2, vocab, generator=gen) * 2.5).softmax(-1)
    flat = torch.rand(2, vocab, generator=gen).softmax(-1)  # a nucleus of thousands of tokens
    probs = torch.cat([peaked, medium, flat])
    probs[0, :100] = 0.0  # zeros, and a row of a few equal values
    probs[1] = torch.tensor([0.25] * 4 + [0.0] * (vocab - 4))[torch.randperm(vocab, generator=gen)]
    top_p = torch.tensor([0.9, 0.6, 0.9, 0.5, 0.9, 0.99])
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.double().cumsum(dim=-1) - sorted_probs.double()  # the mass before, in float64
    kept = sorted_probs.masked_fill(before > top_p.double()[:, None], 0.0)
    reference = torch.zeros_like(probs).scatter_(1, order, kept)
    sizes = (reference > 0).sum(dim=-1).tolist()
    assert sizes[1] == 3 and sizes[4] > 4096 and sizes[5] > sizes[4]
    assert torch.equal(_apply_top_p(probs, top_p), reference)
    assert torch.equal(_apply_top_p(probs[4:], top_p[4:]), reference[4:])


def test_inverse_cdf_draws_each_token_at_its_probability_and_never_a_zero():
    import torch

    from tfserve.engine.sampler import inverse_cdf

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])  # unnormalised rows too
    gen = torch.Generator().manual_seed(0)
    draws = 20_000
    counts = torch.zeros(2, 5)
    for _ in range(draws // 1000):
        u = torch.rand(1000, 2, dtype=torch.float64, generator=gen)
        for row in range(2):
            tokens = inverse_cdf(probs[row].expand(1000, 5), u[:, row])
            counts[row] += torch.bincount(tokens, minlength=5)
    frequency = counts / draws
    assert counts[0, 1] == counts[0, 4] == 0 and counts[1, :4].sum() == 0
    assert torch.allclose(frequency[0], torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]), atol=0.015)
    # the ends of [0, 1): the first and the last token of positive probability
    edges = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs[:1].expand(2, 5), edges).tolist() == [0, 3]


def test_keep_freed_memory_respects_the_users_choice(monkeypatch):
    from tfserve.engine import host_memory

    for name, value in (("TFSERVE_KEEP_FREED_MEMORY", "0"), ("MALLOC_TRIM_THRESHOLD_", "1000"),
                        ("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")):
        host_memory.keep_freed_memory.cache_clear()
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert host_memory.keep_freed_memory() is False
    host_memory.keep_freed_memory.cache_clear()
    import sys
    expected = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())
    assert host_memory.keep_freed_memory() is expected


def test_the_nucleus_kernel_draws_what_the_candidate_road_draws_to_the_bit():
    """`nucleus_sample` (the CPU kernels) against `_nucleus_candidates` + `_sample_among` on the same probabilities
    and uniforms: the same token for every row whose tokens above 1/1024 hold its top-p, and -1 for the others."""
    from kernel_builds import kernel_build
    from tfserve.engine.sampler import _CANDIDATE_FLOOR, Sampler, _nucleus_candidates
    from tfserve.sampling_params import SamplingParams

    ops = kernel_build("native")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for scale in (2.0, 4.0, 8.0, 16.0):
        rows.append(torch.randn(40, 3000, generator=gen) * scale)
    logits = torch.cat(rows)
    logits[5, :40] = logits[5, 40]  # ties: drawn in token order
    logits[6] = torch.randn(3000, generator=gen).round()  # many equal values
    probs = logits.softmax(dim=-1)
    top_ps = [0.5, 0.8, 0.9, 0.95, 0.99, 0.999]
    params = [SamplingParams(temperature=1.0, top_p=top_ps[i % len(top_ps)]) for i in range(len(probs))]
    top_p = torch.tensor([p.top_p for p in params])
    u = torch.rand(len(probs), dtype=torch.float64, generator=gen)
    u[:3] = torch.tensor([0.0, 1 - 2 ** -53, 0.5])
    picked = ops.nucleus_sample(probs, top_p, u, _CANDIDATE_FLOOR)
    held = (((probs > _CANDIDATE_FLOOR) * probs).sum(-1) > top_p).tolist()
    assert picked.tolist().count(-1) == held.count(False) > 0 and held.count(True) > 80
    among, values, ids = _nucleus_candidates(probs, params, [False] * len(probs))
    sampler = Sampler(torch.device("cpu"))
    python = sampler._sample_among(values, ids, [type("R", (), {"params": params[i]}) for i in among], u[among])
    by_row = dict(zip(among, python.tolist()))
    for row, (token, is_held) in enumerate(zip(picked.tolist(), held)):
        assert (token == by_row[row]) if is_held else token == -1, row
