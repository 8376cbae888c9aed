"""The module tree of a natively loaded GGUF model, made without transformers' model classes.

Importing a transformers model class imports `transformers.modeling_utils`, and with it torch's distributed
tensors and dynamo: 3.4 s of a 2-core machine's start, for a model whose weights the engine never hands to
transformers. A GGUF file loaded natively is only ever run by the engine's lean forward, which reads a
model's modules by their transformers names (model.layers.N.self_attn.q_proj ...), its norms' weights, its
attention's scaling and windows, and calls its rotary embedding. This builds exactly that tree, named as
transformers names it (so gguf-py's tensor-name map finds every tensor), for the architectures below; every
other model, and a rotary embedding that changes with the sequence (dynamic, longrope), is built from its
transformers class. The rotary embedding computes what transformers' does, op for op (the golden tests hold
both against transformers' own forward).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from torch import nn

# transformers' model type -> the class the lean forward knows the architecture by
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
_GEMMA = ("gemma2", "gemma3_text")


def build_skeleton(config: Any) -> nn.Module | None:
    """The model's module tree (parameters on the meta device, buffers real), or None where the architecture or
    its rotary embedding is not one this module builds."""
    if config.model_type not in ARCHITECTURES or not _static_rope(config):
        return None
    model = _causal_lm_class(ARCHITECTURES[config.model_type])(config)
    model.model.rotary_emb = Rotary(config)  # real buffers, made on the CPU
    if config.model_type in _GEMMA:  # embeddings scaled by sqrt(hidden), in float32 as transformers' buffer
        model.model.embed_tokens.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5),
                                                 persistent=False)
    return model


def _static_rope(config: Any) -> bool:
    params = config.rope_parameters or {}
    kinds = params.values() if config.model_type == "gemma3_text" else [params]
    return all(kind is None or kind.get("rope_type", "default") not in ("dynamic", "longrope")
               and kind.get("partial_rotary_factor", 1.0) == 1.0 for kind in kinds)


class CausalLM(nn.Module):
    """`model` (embeddings, layers, final norm, rotary embedding) and `lm_head`, with what the engine reads of a
    transformers model: `config`, `generation_config`, `dtype`, `device`."""

    def __init__(self, config: Any) -> None:
        from transformers import GenerationConfig

        super().__init__()
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        self.model = Decoder(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


@cache
def _causal_lm_class(name: str) -> type:
    """CausalLM under the architecture's class name, by which the lean forward tells architectures apart."""
    return type(name, (CausalLM,), {"__module__": __name__, "__qualname__": name})


class Decoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, device="meta"))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config, config.hidden_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoE(config) if _is_moe_layer(config, layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config, config.hidden_size)
        if config.model_type in _GEMMA:  # "sandwich" norms around each block
            self.pre_feedforward_layernorm = RMSNorm(config, config.hidden_size)
            self.post_feedforward_layernorm = RMSNorm(config, config.hidden_size)


class Attention(nn.Module):
    """The projections, per-head norms, scaling and window of one layer, as transformers' attention has them."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        kind = config.model_type
        self.layer_idx = layer_idx
        self.head_dim = head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = (config.query_pre_attn_scalar if kind in _GEMMA else head_dim) ** -0.5
        self.attn_logit_softcapping = getattr(config, "attn_logit_softcapping", None)
        layer_types = getattr(config, "layer_types", None)
        self.layer_type = layer_types[layer_idx] if layer_types else None
        if kind in ("mistral", "phi3", "qwen3_moe"):  # every layer, where the config sets a window
            self.sliding_window = getattr(config, "sliding_window", None)
        elif kind == "smollm3":  # the "sliding_attention" layers, where the config turns windows on
            self.sliding_window = config.sliding_window if config.use_sliding_window and \
                self.layer_type == "sliding_attention" else None
        else:
            self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        bias = getattr(config, "attention_bias", False)
        qkv_bias, o_bias = (True, False) if kind == "qwen2" else (bias, bias)
        if kind == "phi3":  # queries, keys and values in one projection
            self.qkv_proj = _linear(config.hidden_size, (heads + 2 * kv_heads) * head_dim, bias=False)
            o_bias = False
        else:
            self.q_proj = _linear(config.hidden_size, heads * head_dim, bias=qkv_bias)
            self.k_proj = _linear(config.hidden_size, kv_heads * head_dim, bias=qkv_bias)
            self.v_proj = _linear(config.hidden_size, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = _linear(heads * head_dim, config.hidden_size, bias=o_bias)
        if kind == "smollm3":  # 0: a "NoPE" layer, without the rotary embedding (every fourth by default)
            self.use_rope = config.no_rope_layers[layer_idx]
        if kind in ("qwen3", "gemma3_text", "qwen3_moe"):  # each head normalised before the rotary embedding
            self.q_norm = RMSNorm(config, head_dim)
            self.k_norm = RMSNorm(config, head_dim)


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        if config.model_type == "phi3":  # gate and up in one projection
            self.gate_up_proj = _linear(hidden, 2 * inner, bias=False)
        else:
            self.gate_proj = _linear(hidden, inner, bias=False)
            self.up_proj = _linear(hidden, inner, bias=False)
        self.down_proj = _linear(inner, hidden, bias=False)


def _is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Whether the layer's MLP is a mixture of experts, as transformers' Qwen3-MoE decides it."""
    return (getattr(config, "num_experts", 0) > 0 and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class SparseMoE(nn.Module):
    """A mixture of experts as transformers' Qwen3MoeSparseMoeBlock holds it: `gate`, the router ([num_experts,
    hidden] weight, top_k, norm_topk_prob), and `experts`, every expert's projections stacked in two 3-D
    parameters: gate_up_proj [num_experts, 2 * inner, hidden] (gate rows, then up rows) and down_proj
    [num_experts, hidden, inner]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden, device="meta"))
        self.gate.top_k, self.gate.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden, device="meta"))
        self.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner, device="meta"))


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon; Gemma's multiply by (1 + weight) (`plus_one`)."""

    def __init__(self, config: Any, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.variance_epsilon = config.rms_norm_eps
        self.plus_one = config.model_type in _GEMMA


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An nn.Linear whose parameters are on the meta device, made without initialising them: `nn.Linear(...,
    device="meta")` runs its random init through torch's reference ops, which import dynamo (1 s)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = in_features, out_features
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"))
    layer.register_parameter("bias", nn.Parameter(torch.empty(out_features, device="meta")) if bias else None)
    return layer


class Rotary(nn.Module):
    """transformers' rotary embedding for position-only tables: `rotary(x, position_ids[, layer_type]) -> (cos,
    sin)`, one table per layer type where the config has rotary parameters per type (Gemma 3)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        params = config.rope_parameters
        by_type = config.model_type == "gemma3_text"
        kinds = {kind: params[kind] for kind in sorted(set(config.layer_types)) if params[kind] is not None} \
            if by_type else {None: params}
        self.rope_type = {kind: p["rope_type"] for kind, p in kinds.items()} if by_type else params["rope_type"]
        self.scaling: dict[str | None, float] = {}
        for kind, p in kinds.items():
            inv_freq, self.scaling[kind] = _rope_init(config, p, kind)
            self.register_buffer(f"{kind}_inv_freq" if kind else "inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv_freq = getattr(self, f"{layer_type}_inv_freq" if layer_type else "inv_freq")
        scaling = self.scaling[layer_type]
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _rope_init(config: Any, params: dict, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) as transformers' rotary embedding computes them."""
    if params["rope_type"] != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kwargs = {"layer_type": layer_type} if layer_type else {}
        return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, **kwargs)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
