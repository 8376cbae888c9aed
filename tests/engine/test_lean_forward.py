"""The lean forward computes, bit for bit, the logits the model's own forward computes inside an engine step."""

import pytest

torch = pytest.importorskip("torch")

from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tfserve import Engine, SamplingParams  # noqa: E402
from tfserve.config import EngineConfig  # noqa: E402
from tfserve.engine.backends import lean_layers, select_backend  # noqa: E402
from tfserve.engine.backends.hf import HFForward  # noqa: E402
from tfserve.engine.backends.lean import LeanForward  # noqa: E402
from tfserve.engine.kernels import cpu_ops  # noqa: E402

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
    if arch == "smollm3":  # layer 1 without rotary embedding, layer 0 a sliding window
        config = SmolLM3Config(**SIZES, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1,
                               eos_token_id=2)
        model = SmolLM3ForCausalLM(config)
        assert [layer.self_attn.use_rope for layer in model.model.layers] == [1, 0]
        return model
    if arch == "phi3":  # q/k/v in one layer, gate/up in one layer
        return Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0))
    if arch == "gemma3":  # sandwich norms of (1 + weight), per-head norms, tanh GELU, two rotary tables, windows
        config = Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=6, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2,
                                  layer_types=["sliding_attention", "full_attention"])
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # initialised to zeros: make (1 + weight) matter
                    param.normal_(0, 0.3)
        return model
    if arch == "gemma2":  # sandwich norms, windows on alternate layers, tanh-capped attention scores and logits
        config = Gemma2Config(**SIZES, head_dim=16, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        model = Gemma2ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0, 0.3)
                elif name.endswith("proj.weight"):  # scores large enough for the caps to bite
                    param.mul_(8)
        return model
    raise ValueError(arch)


def _step_logits(model, use_lean: bool, kernels: bool = True, pack: bool = False) -> list[torch.Tensor]:
    """The logits of every step of a small mixed workload (prefills, chunks, decodes)."""
    engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=24,
                    forward_backend="lean" if use_lean else "hf", pack_weights=pack)
    assert engine.runner.forward.name == ("lean" if use_lean else "hf")
    if use_lean and not kernels:  # the torch versions of the fused ops
        engine.runner.forward.rotary = lean_layers.rotary_embedding_
        engine.runner.forward.rms_norm = lean_layers.rms_norm
    captured = []
    sampler = engine.runner.sampler
    engine.runner.sampler = lambda logits, requests: (captured.append(logits.clone()), sampler(logits, requests))[1]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 19, 30, 8)]
    engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return captured


@pytest.mark.parametrize("arch,kernels", [("llama", True), ("mistral", True), ("qwen3", True), ("smollm3", True),
                                         ("phi3", True), ("phi3", False), ("gemma3", True), ("gemma3", False),
                                         ("gemma2", True), ("gemma2", False), ("llama", False)])
def test_lean_logits_are_bit_identical(arch, kernels):
    model = _model(arch).eval()
    assert LeanForward.why_not(model) is None
    fast, reference = _step_logits(model, use_lean=True, kernels=kernels), _step_logits(model, use_lean=False)
    assert len(fast) == len(reference) > 10
    for a, b in zip(fast, reference):
        assert torch.equal(a, b)


def test_packed_weights_keep_the_logits_within_float_rounding():
    """Panel-packed weights (steps of 2+ rows) sum in another order than F.linear: equal up to rounding."""
    if cpu_ops() is None:
        pytest.skip("CPU kernels unavailable here")
    model = _model("llama").eval()
    packed, reference = _step_logits(model, use_lean=True, pack=True), _step_logits(model, use_lean=False)
    assert len(packed) == len(reference) > 10
    for a, b in zip(packed, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_other_models_keep_their_own_forward(monkeypatch):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "GPT2LMHeadModel is not one of" in LeanForward.why_not(gpt2)
    assert "bfloat16" in LeanForward.why_not(_model("llama").to(torch.bfloat16))
    assert isinstance(select_backend(gpt2, EngineConfig(), None), HFForward)
    with pytest.raises(ValueError, match="forward_backend lean cannot run this model: GPT2LMHeadModel"):
        select_backend(gpt2, EngineConfig(forward_backend="lean"), None)
    monkeypatch.setenv("TFSERVE_LEAN_FORWARD", "0")  # what operators set: the config's default follows it
    assert isinstance(select_backend(_model("llama"), EngineConfig(), None), HFForward)


def test_the_engine_leaves_the_callers_model_as_it_was():
    model = _model("llama").eval()
    Engine(model, block_size=4, num_blocks=16)
    for module in model.modules():
        assert "forward" not in vars(module)
        assert not [name for name in vars(module) if name.startswith("_tfserve")]


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "dynamic", "factor": 2.0}])
def test_rotary_table_gives_the_modules_own_bits_at_any_position(scaling):
    """cos/sin looked up in the table (grown past its first size) are what the model's rotary module computes
    for the same positions; a scaling that depends on the sequence length is computed every step instead."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(**{**SIZES, "rope_scaling": scaling}))
    rope = lean_layers.RopeTable(rotary)
    assert rope.static == (scaling is None or scaling["rope_type"] != "dynamic")
    x = torch.randn(5, SIZES["hidden_size"])
    for positions in ([0, 1, 2, 3, 4], [1023, 5, 7, 1500, 3000], [17]):
        p = torch.tensor(positions)
        cos, sin = rope(x[: len(positions)], p)
        want_cos, want_sin = rotary(x[None, : len(positions)], p[None])
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), positions
    if rope.static:
        assert rope.cos.shape[0] >= 3001


@pytest.mark.parametrize("arch,weights", [("llama", "float32"), ("mistral", "float16"), ("qwen2", "int8"),
                                          ("phi3", "float32"), ("qwen3", "float32")])
def test_the_decoder_stack_computes_the_python_loops_bits(arch, weights):
    """Decode steps run every layer in one kernel call (`DecoderStack`) where each layer is of the kind it runs
    (Qwen3's per-head norms are not: the loop runs them); the logits are the loop's to the bit, whatever the weight
    format, sliding windows and q/k/v biases included."""
    if cpu_ops() is None:
        pytest.skip("CPU kernels unavailable here")
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))  # biases on q, k and v
    else:
        model = _model(arch)
    model.eval()

    def logits(use_stack: bool) -> list[torch.Tensor]:
        engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=24, forward_backend="lean",
                        weights=weights, pack_weights=weights == "float32")
        forward, calls = engine.runner.forward, []
        assert (forward.stack is not None) == (arch != "qwen3")
        if not use_stack:
            forward.stack = None
        elif forward.stack is not None:  # count the steps it runs
            stack = forward.stack
            forward.stack = type("Counted", (), {"forward": lambda self, *args: (calls.append(1), stack.forward(*args))[1]})()
        captured, sampler = [], engine.runner.sampler
        engine.runner.sampler = lambda x, requests: (captured.append(x.clone()), sampler(x, requests))[1]
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 19, 30, 8)]
        engine.generate_batch(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert len(calls) > (5 if use_stack and arch != "qwen3" else -1)  # the decode steps
        return captured

    stacked, looped = logits(True), logits(False)
    assert len(stacked) == len(looped) > 10
    for a, b in zip(stacked, looped):
        assert torch.equal(a, b)
