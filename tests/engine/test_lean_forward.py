"""The lean forward computes, bit for bit, the logits the model's own forward computes inside an engine step."""

import pytest

torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tfserve import Engine, SamplingParams  # noqa: E402
from tfserve.engine import lean_forward  # noqa: E402
from tfserve.engine.lean_forward import LeanForward  # noqa: E402

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _model(arch):
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES))
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=6))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=32))
    raise ValueError(arch)


def _step_logits(model, lean: bool, kernels: bool = True) -> list[torch.Tensor]:
    """The logits of every step of a small mixed workload (prefills, chunks, decodes)."""
    engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=24)
    if not lean:
        engine.runner.lean_forward = None
    elif not kernels:  # the torch versions of the fused ops
        engine.runner.lean_forward.rotary = lean_forward._rotary_embedding_
        engine.runner.lean_forward.rms_norm = lean_forward._rms_norm
    captured = []
    sampler = engine.runner.sampler
    engine.runner.sampler = lambda logits, requests: (captured.append(logits.clone()), sampler(logits, requests))[1]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 19, 30, 8)]
    engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return captured


@pytest.mark.parametrize("arch,kernels", [("llama", True), ("mistral", True), ("qwen3", True), ("llama", False)])
def test_lean_logits_are_bit_identical(arch, kernels):
    model = _model(arch).eval()
    assert LeanForward.for_model(model) is not None
    lean, reference = _step_logits(model, lean=True, kernels=kernels), _step_logits(model, lean=False)
    assert len(lean) == len(reference) > 10
    for a, b in zip(lean, reference):
        assert torch.equal(a, b)


def test_other_models_keep_their_own_forward(monkeypatch):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert LeanForward.for_model(gpt2) is None
    assert LeanForward.for_model(_model("llama").to(torch.bfloat16)) is None
    monkeypatch.setenv("TFSERVE_LEAN_FORWARD", "0")
    assert LeanForward.for_model(_model("llama")) is None
