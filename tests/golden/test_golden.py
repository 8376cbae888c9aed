"""Greedy outputs of the engine are token-identical to HF `generate`, on tiny random-weight models of several
architectures, also with chunked prefill, preemption, prefix caching and requests arriving mid-decode.

References are computed per prompt (batch of one, no padding) before any Engine touches the model: an
Engine switches the model to the `tfserve_paged` attention implementation.
"""

from __future__ import annotations

import pytest
import torch
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tfserve import Engine, SamplingParams

NUM_NEW = 20
VOCAB_SIZE = 256
_SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=512)


def _build(arch: str, sliding_window: bool = True) -> torch.nn.Module:
    """A tiny random model; `sliding_window=False` gives the same weights with full attention."""
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**_SIZES, num_key_value_heads=2))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_SIZES, num_key_value_heads=1))
    if arch == "qwen2-sliding":  # layer 0 full attention, layer 1 a window of 8
        config = Qwen2Config(**_SIZES, num_key_value_heads=2, use_sliding_window=sliding_window, sliding_window=8,
                             max_window_layers=1)
        if sliding_window:
            assert config.layer_types == ["full_attention", "sliding_attention"]
        return Qwen2ForCausalLM(config)
    if arch == "mistral":  # a window shorter than every sequence here
        return MistralForCausalLM(MistralConfig(**_SIZES, num_key_value_heads=2,
                                                sliding_window=8 if sliding_window else None))
    if arch == "gpt2":  # learned positions, fused qkv, biases; at the default init it repeats one token
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                          initializer_range=0.2, bos_token_id=None, eos_token_id=None))
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen2-sliding", "mistral", "gpt2"]


def _random_tokens(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist()


_gen = torch.Generator().manual_seed(1234)
PROMPTS = [_random_tokens(_gen, n) for n in (5, 17, 33, 9)]
_SHARED_PREFIX = _random_tokens(_gen, 26)
PREFIX_PROMPTS = [_SHARED_PREFIX + _random_tokens(_gen, n) for n in (3, 7, 11, 5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=NUM_NEW, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == NUM_NEW
    return tokens


_CACHE: dict[str, tuple[torch.nn.Module, dict[tuple[int, ...], list[int]]]] = {}


@pytest.fixture(params=ARCHS)
def golden(request):
    """(model, reference outputs by prompt) for one architecture, built once per session."""
    arch = request.param
    if arch not in _CACHE:
        model = _build(arch).eval()
        model.generation_config.eos_token_id = None
        references = {tuple(p): _hf_greedy(model, p) for p in PROMPTS + PREFIX_PROMPTS}
        # Outputs that repeat one token would make "identical" a weak claim.
        assert all(len(set(tokens)) >= 3 for tokens in references.values())
        _CACHE[arch] = (model, references)
    return _CACHE[arch]


def _engine(model, **kwargs) -> Engine:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_blocks", 128)
    return Engine(model, **kwargs)


def _check(engine: Engine, prompts: list[list[int]], outputs, references) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.generated_tokens == references[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
    pool = engine.block_pool
    assert not engine.has_unfinished
    assert pool.num_free_blocks == pool.num_blocks


def test_plain(golden):
    model, references = golden
    engine = _engine(model)
    outs = engine.generate_batch(PROMPTS, GREEDY)
    _check(engine, PROMPTS, outs.values(), references)


def test_one_at_a_time(golden):
    model, references = golden
    engine = _engine(model)
    for prompt in PROMPTS[:2]:
        outs = engine.generate_batch([prompt], GREEDY)
        _check(engine, [prompt], outs.values(), references)


def test_chunked_prefill(golden):
    model, references = golden
    engine = _engine(model, max_batch_tokens=8)
    outs = engine.generate_batch(PROMPTS, GREEDY)
    _check(engine, PROMPTS, outs.values(), references)
    longest = max(len(p) for p in PROMPTS)
    assert engine.num_steps >= -(-longest // 8) + NUM_NEW - 1  # its prefill alone took several steps


def test_preemption(golden):
    model, references = golden
    engine = _engine(model, num_blocks=16)  # 64 slots; the four sequences need 144 together
    outs = engine.generate_batch(PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    _check(engine, PROMPTS, outs.values(), references)


def test_preemption_without_prefix_caching(golden):
    model, references = golden
    engine = _engine(model, num_blocks=16, enable_prefix_caching=False)
    outs = engine.generate_batch(PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    _check(engine, PROMPTS, outs.values(), references)


def test_prefix_caching(golden):
    model, references = golden
    engine = _engine(model)
    first, second = PREFIX_PROMPTS[:2], PREFIX_PROMPTS[2:]
    outs = engine.generate_batch(first, GREEDY)  # the second shares the first's blocks within one step
    _check(engine, first, outs.values(), references)
    hits_first_wave = engine.block_pool.stats.num_hit_tokens
    assert hits_first_wave > 0

    outs = engine.generate_batch(second, GREEDY)  # both hit the first wave's freed, cached blocks
    _check(engine, second, outs.values(), references)
    assert engine.block_pool.stats.num_hit_tokens >= hits_first_wave + 2 * (len(_SHARED_PREFIX) // 4 * 4)
    assert all(o.metrics.num_cached_tokens >= len(_SHARED_PREFIX) // 4 * 4 for o in outs.values())


def test_everything_at_once(golden):
    """Chunked prefill, preemption and prefix hits in the same run."""
    model, references = golden
    engine = _engine(model, num_blocks=20, max_batch_tokens=8)
    prompts = PREFIX_PROMPTS + PROMPTS[:2]
    outs = engine.generate_batch(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.stats.num_hit_tokens > 0
    _check(engine, prompts, outs.values(), references)


def test_requests_added_while_others_decode(golden):
    model, references = golden
    engine = _engine(model)
    ids = {}
    for prompt in PROMPTS[:2]:
        ids[engine.add_request(prompt, GREEDY)[0]] = prompt
    finished = {}
    num_steps = 0
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        num_steps += 1
        if num_steps in (3, 7):  # join mid-decode: one at step 3, one at step 7
            prompt = PROMPTS[2] if num_steps == 3 else PROMPTS[3]
            ids[engine.add_request(prompt, GREEDY)[0]] = prompt
    assert set(finished) == set(ids)
    _check(engine, list(ids.values()), [finished[i] for i in ids], references)


@pytest.mark.parametrize("arch", ["mistral", "qwen2-sliding"])
def test_sliding_window_changes_the_reference(arch):
    """Guards the sliding-window cases above: the window really changes what HF generates here."""
    windowed, full = _build(arch).eval(), _build(arch, sliding_window=False).eval()
    for model in (windowed, full):
        model.generation_config.eos_token_id = None
    prompt = PROMPTS[2]
    assert _hf_greedy(windowed, prompt) != _hf_greedy(full, prompt)
