"""A GGUF file run natively (tfserve.models.gguf_native + the lean forward multiplying by the file's own
tensors) gives HF's own forward, per architecture, token by token.

Each tiny random-weight model is written as llama.cpp's converter would (tests/gguf_writer.py): metadata
under the architecture's keys, gguf-py's tensor names, Llama's permuted query/key rows, Gemma's norms + 1.
Norms and biases are random too, so a norm or bias read wrong shows. The engine reports every prompt
position's and every output step's top-20 logprobs, compared with log_softmax of HF's logits over the same
tokens (teacher-forced on the engine's own output, so one flipped near-tie does not cascade).

- An F32 file: greedy tokens identical to `model.generate`, logprobs within float32 rounding (F32_ATOL).
- A quantized file (2-D weights Q8_0, Q4_0, Q5_0): within QUANT_ATOL of HF's forward over the same blocks
  expanded back to float32 (`dequantized_copy`); each greedy token HF's top-1 up to a near-tie.
  (gguf-py cannot write K-quants: no such case here; tests/engine/test_gguf_block_kernels.py covers them.)
  Qwen3-MoE's experts are 3-D stacks in that type (its router F32, as llama.cpp keeps it); where HF's router
  all but ties between two experts, the engine may pick the other, and that position is held to FLIP_ATOL.
  tests/golden/test_gguf_moe.py holds its continuous batching and per-expert blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from gguf_writer import dequantized_copy, write_gguf
from kernel_builds import kernel_build
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from tfserve import Engine, SamplingParams
from tfserve.models.gguf_weights import is_native

NUM_NEW = 8
VOCAB_SIZE = 384
TOP = 20  # logprobs compared per position (the most SamplingParams gives)
# Weights of std 0.1 (initializer_range): logits of std ~0.8, so that a mistake shows: Llama's query/key rows
# left permuted move logprobs by ~2.5 (at transformers' default 0.02, by 0.008: under any quantized tolerance).
# An F32 file: the same float32 operations in another order; seen <= 3e-6, the bound 30x that.
F32_ATOL = 1e-4
# A quantized file: the block kernels take int8 activations (as llama.cpp's dot products), so logprobs differ
# from HF's over the same dequantized weights by up to (seen over every case here) Q8_0 0.05, Q5_0 0.048,
# Q4_0 0.15 (Phi-3's 32k-row head; 0.06-0.09 elsewhere): the bounds are about 2x. Quantizing the weights
# itself moves Q4_0 logprobs by ~1.3, so the engine is measurably on the dequantized weights, not near them.
QUANT_ATOL = {"Q8_0": 0.1, "Q4_0": 0.3, "Q5_0": 0.1}
# A mixture of experts, where HF's router all but ties (`_router_near_ties`): another expert's output, but not
# garbage
FLIP_ATOL = 1.0
_SIZES = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 0,
          "eos_token_id": 1, "pad_token_id": None, "initializer_range": 0.1}


def _build(case: str) -> torch.nn.Module:
    """A tiny random model, norms and biases random as well."""
    torch.manual_seed(0)
    if case == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_SIZES, tie_word_embeddings=False))
    elif case == "llama-tied":
        model = LlamaForCausalLM(LlamaConfig(**_SIZES, tie_word_embeddings=True))
    elif case == "mistral":
        model = MistralForCausalLM(MistralConfig(**_SIZES, tie_word_embeddings=False))
    elif case == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**_SIZES, tie_word_embeddings=True))
    elif case == "qwen3":  # per-head q/k norms; a head size the file states (Qwen3Config's default is 128)
        model = Qwen3ForCausalLM(Qwen3Config(**_SIZES, head_dim=32, tie_word_embeddings=True))
    elif case == "gemma3":  # 6 layers: 5 sliding (a window of 8, shorter than the sequences), then 1 full
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**_SIZES, "num_hidden_layers": 6}, head_dim=32,
                                                   sliding_window=8, tie_word_embeddings=True))
        assert model.config.layer_types[-2:] == ["sliding_attention", "full_attention"]
    elif case == "gemma2":  # windows on alternate layers; attention scores and logits capped by tanh
        model = Gemma2ForCausalLM(Gemma2Config(**{**_SIZES, "num_hidden_layers": 4}, head_dim=32, sliding_window=8,
                                               attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                               tie_word_embeddings=True))
    elif case == "phi3":  # fused qkv and gate_up. The file states no pad id, so Phi3Config's 32000 applies on
        # loading: the vocabulary must hold it
        model = Phi3ForCausalLM(Phi3Config(**{**_SIZES, "vocab_size": 32064}, tie_word_embeddings=False))
    elif case == "smollm3":  # 4 layers: the rotary embedding left out of the fourth (llama.cpp's fixed rule)
        model = SmolLM3ForCausalLM(SmolLM3Config(**{**_SIZES, "num_hidden_layers": 4}, tie_word_embeddings=True))
        assert model.config.no_rope_layers == [1, 1, 1, 0]
    elif case == "qwen3_moe":  # 8 experts of width 32, 2 per token, weights renormalised (llama.cpp's qwen3moe
        # always does: norm_topk_prob); per-head q/k norms as Qwen3
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**_SIZES, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, norm_topk_prob=True,
                                                   tie_word_embeddings=False))
    else:
        raise ValueError(case)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # Gemma's norms are offsets from 1, as biases are from 0
                base = 0.0 if case.startswith("gemma") or name.endswith("bias") else 1.0
                param.copy_(base + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):  # a router as decisive as trained ones (logits of std ~3):
                param.mul_(4.0)  # near-ties, where the engine may pick another expert, at few positions
    model.generation_config.eos_token_id = None
    return model.eval()


CASES = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "qwen3_moe"]
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(0, VOCAB_SIZE, (n,), generator=_gen).tolist() for n in (12, 5)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="module", autouse=True)
def _kernels_and_home(tmp_path_factory):
    """The CPU kernels (a GGUF file loads natively only where they run), and a store of this module's own."""
    kernel_build("native")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TFSERVE_HOME", str(tmp_path_factory.mktemp("gguf-arch-home")))
        yield


def _model(case: str) -> torch.nn.Module:
    if case not in _MODELS:
        _MODELS[case] = _build(case)
    return _MODELS[case]


def _run(path) -> list:
    """The engine's outputs for PROMPTS from the file, checked to run natively through the lean forward."""
    engine = Engine.from_pretrained(str(path), num_blocks=32, block_size=4, max_num_seqs=2)
    assert is_native(engine.model), "the file loaded through transformers, not natively"
    # the module tree tfserve builds itself (no transformers model class), held to HF's forward by these tests
    assert type(engine.model).__module__ == "tfserve.models.gguf_skeleton", type(engine.model)
    assert engine.runner.forward.name == "lean"
    return list(engine.generate_batch(PROMPTS, PARAMS).values())


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=NUM_NEW, min_new_tokens=None, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _compare(model: torch.nn.Module, output, atol: float) -> tuple[float, list[tuple[int, torch.Tensor, float]]]:
    """(max |logprob error| over the engine's top-20 at every position, [(greedy token, HF's logprobs there,
    the bound there)]);
    each of the engine's top 20 in HF's, up to a near-tie (two errors of `atol`) at the 20th. A mixture of
    experts' position where HF's router all but ties (`_router_near_ties`) is held to FLIP_ATOL only."""
    prompt = output.prompt_token_ids
    tokens = prompt + output.generated_tokens
    with torch.inference_mode(), _router_near_ties(model, atol) as near_ties:
        logprobs = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)  # [len(tokens), vocab]
    # logits at position p predict token p + 1: prompt entry p + 1 and output step i (at len(prompt) - 1 + i)
    entries = [(p, entry) for p, entry in enumerate(output.prompt_logprobs[1:])]
    entries += [(len(prompt) - 1 + i, entry) for i, entry in enumerate(output.logprobs)]
    assert len(entries) == len(tokens) - 1
    error = 0.0
    for position, entry in entries:
        assert len(entry["top"]) == TOP
        kth = logprobs[position].topk(TOP).values[-1].item()
        bound = FLIP_ATOL if position in near_ties else atol
        for token_id, value in entry["top"]:
            here = abs(value - logprobs[position, token_id].item())
            error = max(error, here if position not in near_ties else 0.0)
            assert here <= FLIP_ATOL, f"logprobs {here:.4f} from HF's at {position}"
            assert logprobs[position, token_id] >= kth - 2 * bound, f"{token_id} is not in HF's top {TOP}"
    steps = [(token, logprobs[len(prompt) - 1 + i], FLIP_ATOL if len(prompt) - 1 + i in near_ties else atol)
             for i, token in enumerate(output.generated_tokens)]
    return error, steps


@contextmanager
def _router_near_ties(model: torch.nn.Module, atol: float) -> Iterator[set[int]]:
    """The positions (filled in after the model's forward) where, in any layer, HF's router logits for the
    token's last chosen expert and the next are within `atol`: the engine's own rounding (int8 activations, as
    llama.cpp's) may pick the other expert there, and that one position's logprobs move by a few tenths (seen:
    0.29 in Q5_0, 0.34 in Q4_0, each where the top-k probabilities differed by 0.001-0.01); the next positions
    read its keys and values, and stay within `atol`."""
    near_ties: set[int] = set()
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: _add_ties(near_ties, out[0], module, atol))
             for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    try:
        yield near_ties
    finally:
        for hook in hooks:
            hook.remove()


def _add_ties(near_ties: set[int], router_logits: torch.Tensor, router, atol: float) -> None:
    top = router_logits.topk(router.top_k + 1, dim=-1).values  # [num_tokens, top_k + 1]
    near_ties.update((top[:, -2] - top[:, -1] < atol).nonzero().flatten().tolist())


@pytest.mark.parametrize("case", CASES)
def test_an_f32_file_gives_hf_logits_and_greedy_tokens(case, tmp_path):
    model = _model(case)
    path = write_gguf(model, tmp_path / f"{case}.gguf")
    outputs = _run(path)
    # a second start reads the config from tfserve's cache, not through the transformers class: the same outputs
    again = _run(path)
    assert type(Engine.from_pretrained(str(path), num_blocks=8, block_size=4).model.config).__module__ == \
        "tfserve.models.gguf_native"
    assert [o.generated_tokens for o in again] == [o.generated_tokens for o in outputs]
    assert [o.logprobs for o in again] == [o.logprobs for o in outputs]
    for prompt, output in zip(PROMPTS, outputs):
        assert output.generated_tokens == _hf_greedy(model, prompt)
        error, _ = _compare(model, output, F32_ATOL)
        assert error <= F32_ATOL, f"logprobs {error:.2e} from HF's"


@pytest.mark.parametrize("tensor_type", list(QUANT_ATOL))
@pytest.mark.parametrize("case", CASES)
def test_a_quantized_file_gives_hf_logits_over_its_dequantized_weights(case, tensor_type, tmp_path):
    model = _model(case)
    reference = dequantized_copy(model, tensor_type)
    outputs = _run(write_gguf(model, tmp_path / f"{case}-{tensor_type}.gguf", tensor_type))
    tolerance = QUANT_ATOL[tensor_type]
    for output in outputs:
        error, steps = _compare(reference, output, tolerance)
        assert error <= tolerance, f"logprobs {error:.4f} from HF's over the dequantized weights"
        for i, (token, logprobs, bound) in enumerate(steps):  # top-1, or a near-tie: two errors of the bound
            assert logprobs[token] >= logprobs.max() - 2 * bound, f"step {i}: {token}, HF {logprobs.argmax()}"


# transformers' own GGUF loader cannot read these back (its limits, not the file's): a "llama" file named
# "mistral" has no gguf-py name map under "mistral"; Qwen3's head size is not in its metadata mapping
_TRANSFORMERS_CANNOT = {"mistral": "transformers' GGUF loader has no tensor-name map for mistral",
                        "qwen3": "transformers' GGUF mapping drops attention.key_length: head_dim 128 applies",
                        "smollm3": "transformers' GGUF loader has no smollm3 (tfserve maps its config itself)"}


@pytest.mark.parametrize("case", CASES)
def test_transformers_reads_the_written_file_as_the_reference(case, tmp_path, monkeypatch):
    """The writer checked by transformers' independent reading of the file: its Q4_0 file expands to
    exactly the reference the quantized test compares with (permutations, norms + 1 and names undone)."""
    from transformers import AutoModelForCausalLM

    if case in _TRANSFORMERS_CANNOT:
        pytest.skip(_TRANSFORMERS_CANNOT[case])
    if case == "qwen3_moe":  # its mapping reads no expert width (Qwen3MoeConfig's 768 would apply): told it here
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        monkeypatch.setitem(GGUF_CONFIG_MAPPING["qwen3_moe"], "expert_feed_forward_length", "moe_intermediate_size")
    model = _model(case)
    path = write_gguf(model, tmp_path / f"{case}.gguf", "Q4_0")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    assert type(loaded) is type(model)
    expected = dict(dequantized_copy(model, "Q4_0").named_parameters())
    assert {name for name, _ in loaded.named_parameters()} == set(expected)
    for name, param in loaded.named_parameters():  # Gemma's norms: (w + 1) - 1 in float32, within an ulp
        torch.testing.assert_close(param, expected[name], rtol=0, atol=1e-7, msg=name)
