"""Write a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does, for the tests that
check tfserve's native GGUF path against HF's own forward (tests/golden/test_gguf_architectures.py).

What llama.cpp's converter does and this repeats: the hyperparameters under the architecture's own keys (the
inverse of transformers' GGUF_CONFIG_MAPPING, plus the head size llama.cpp always states), tensors under
gguf-py's names, Llama's query/key rows permuted for its rotary layout, Gemma's norms stored as weight + 1,
1-D tensors in F32 and 2-D ones in the chosen type, no `output.weight` where the LM head is tied; a
mixture of experts' router in F32 (llama.cpp never quantizes ffn_gate_inp) and its experts as 3-D tensors
[num_experts, out, in] in the chosen type, gate and up apart (transformers' fused gate_up_proj split). The
tokenizer is a byte-level BPE trained here (`tokenizer.ggml.model` "gpt2", which transformers' GGUF converter
accepts for every architecture), padded to the model's vocabulary. Independent of tfserve on purpose: it
uses gguf-py's name map, not tfserve's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

# transformers' model type -> the architecture llama.cpp writes (Mistral is a "llama" file named "mistral")
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe",
                      "smollm3": "smollm3"}
# architectures llama.cpp's converter writes as Llama (its SmolLM3 class is its Llama one): Llama's keys, Llama's
# permuted query/key rows
_WRITTEN_AS_LLAMA = {"llama", "smollm3"}
# metadata keys llama.cpp writes as floats (every other number: uint32)
_FLOAT_KEYS = {"rope.freq_base", "attention.layer_norm_rms_epsilon", "attn_logit_softcapping",
               "final_logit_softcapping"}
_CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.",
           "Once upon a time there was a tiny model that served many requests at once.",
           "The capital of France is Paris. What is the weather like in Tokyo today?"] * 4


def write_gguf(model, path: Path, tensor_type: str = "F32", name: str | None = None) -> Path:
    """Write `model` (a float32 transformers causal LM of GGUF_ARCHITECTURES) to `path`; 2-D weights and 3-D
    expert stacks (but a router) in `tensor_type` (F32, or a type gguf-py quantizes: Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1), the rest in F32."""
    import gguf

    config = model.config
    arch = GGUF_ARCHITECTURES[config.model_type]
    if config.model_type == "qwen3_moe" and not config.norm_topk_prob:  # no key says otherwise
        raise ValueError("llama.cpp's qwen3moe always renormalises the top-k routing weights: norm_topk_prob")
    if config.model_type == "smollm3" and config.no_rope_layers != [int((i + 1) % 4 != 0)
                                                                    for i in range(config.num_hidden_layers)]:
        raise ValueError("llama.cpp's smollm3 always leaves the rotary embedding out of every fourth layer, "
                         "and no key says otherwise: no_rope_layers")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    # transformers reads a "llama" file as Mistral only where general.name is exactly "mistral"
    writer.add_name(name or ("mistral" if config.model_type == "mistral" else f"tiny-{config.model_type}"))
    for key, value in hyperparameters(config).items():
        (writer.add_float32 if key in _FLOAT_KEYS else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32 if tensor_type == "F32" else
                             gguf.LlamaFileType[f"MOSTLY_{tensor_type}"]))
    _add_tokenizer(writer, config.vocab_size)

    name_map = gguf.get_tensor_name_map(_arch_enum(arch), config.num_hidden_layers)
    for hf_name, param in model.named_parameters():  # a tied LM head is not listed apart from the embedding
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for gguf_name, data in _stored_tensors(name_map, hf_name, param.detach().float().numpy(), config):
            if _quantized(hf_name, data) and qtype != gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hyperparameters(config) -> dict[str, int | float]:
    """`{key under the architecture: value}`: every key transformers maps back to a config field, and the
    head size (rope.dimension_count, attention.key_length/value_length) that llama.cpp always writes."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    values = {"rope_theta": _rope_theta(config), "head_dim": head_dim}
    out: dict[str, int | float] = {"rope.dimension_count": head_dim, "attention.key_length": head_dim,
                                   "attention.value_length": head_dim}
    mapped = "llama" if config.model_type == "smollm3" else config.model_type.removesuffix("_text")
    for key, field in GGUF_CONFIG_MAPPING[mapped].items():
        value = values[field] if field in values else getattr(config, field, None) if field else None
        if value is not None:
            out[key] = value
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's, as llama.cpp writes them
        if getattr(config, key, None) is not None:
            out[key] = getattr(config, key)
    if getattr(config, "moe_intermediate_size", None):  # each expert's width, which transformers does not map
        out["expert_feed_forward_length"] = config.moe_intermediate_size
    return out


def _stored_tensors(name_map, hf_name: str, data: np.ndarray, config) -> list[tuple[str, np.ndarray]]:
    """[(GGUF tensor name, data as stored)] for one parameter: a mixture of experts' fused gate_up_proj
    [num_experts, 2 * inner, hidden] as its gate and up halves (ffn_gate_exps, ffn_up_exps), as llama.cpp
    stacks a checkpoint's per-expert gate_proj and up_proj."""
    if hf_name.endswith("experts.gate_up_proj"):
        base = hf_name.removesuffix("gate_up_proj")
        gate, up = (np.ascontiguousarray(half) for half in np.split(data, 2, axis=1))
        return [(f"{name_map.get_name(base + 'gate_proj')}.weight", gate),
                (f"{name_map.get_name(base + 'up_proj')}.weight", up)]
    if hf_name.endswith("experts.down_proj"):  # a parameter itself, no ".weight" of a module
        return [(f"{name_map.get_name(hf_name)}.weight", data)]
    base, _, suffix = hf_name.rpartition(".")
    gguf_name = name_map.get_name(base)
    assert gguf_name is not None, f"gguf-py has no name for {hf_name}"
    return [(f"{gguf_name}.{suffix}", _as_stored(hf_name, data, config))]


def _quantized(hf_name: str, data) -> bool:
    """Whether llama.cpp stores the tensor in the file's type: every matrix (experts' stacks included) but a
    mixture of experts' router."""
    return data.ndim >= 2 and not hf_name.endswith("mlp.gate.weight")


def dequantized_copy(model, tensor_type: str):
    """A copy of `model` whose 2-D weights are what a `tensor_type` file holds, expanded back to float32: the
    reference a quantized file's logits are compared with. (Quantization blocks run along a row, so quantizing
    before or after the row permutations is the same.)"""
    import copy

    import gguf
    import torch

    qtype = gguf.GGMLQuantizationType[tensor_type]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if _quantized(name, param):
                data = param.numpy()
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)))
    return reference


def _as_stored(hf_name: str, data: np.ndarray, config) -> np.ndarray:
    """The tensor as llama.cpp's converter stores it."""
    if GGUF_ARCHITECTURES[config.model_type] in _WRITTEN_AS_LLAMA and hf_name.endswith(("q_proj.weight", "k_proj.weight",
                                                                              "q_proj.bias", "k_proj.bias")):
        heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
        return permute(data, heads)
    if config.model_type in ("gemma2", "gemma3_text") and hf_name.endswith("norm.weight"):
        return data + 1  # Gemma's RMSNorm multiplies by (1 + weight); llama.cpp's by the stored weight
    return data


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from rotate-half order to interleaved pairs."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:  # Gemma 3: the global layers' base; llama.cpp keeps the local 10000 itself
        params = params["full_attention"]
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _arch_enum(arch: str):
    from gguf import MODEL_ARCH_NAMES

    return next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch)


@functools.cache
def _bpe(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE trained on a tiny corpus, padded to `vocab_size` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(bpe.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    assert len(tokens) <= vocab_size, f"a vocabulary of {vocab_size} is too small for the byte alphabet"
    tokens += [f"<|pad{i}|>" for i in range(vocab_size - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tokens, merges


def _add_tokenizer(writer, vocab_size: int) -> None:
    tokens, merges = _bpe(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
