"""A lean forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) in float32.

The model's own forward spends most of a small step outside arithmetic: module calls, keyword plumbing,
mask construction, and half a dozen element-wise ops per RMSNorm and a dozen per rotary embedding. This
walks the same modules and weights with the same operations in the same order, fewer of them: the residual
add and RMSNorm are one op, and so is the rotary embedding, all bit-identical to transformers' versions in
float32 (see csrc/cpu_ops.cpp; in torch where the kernels are off), so the
engine's output is unchanged (the golden tests compare it with `model.generate`). Models it does not
recognise keep the transformers forward.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tfserve.engine import kernels
from tfserve.engine.attention import paged_attention_forward

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


class LeanForward:
    """`lean(input_ids, positions, logits_index) -> logits` for one packed engine step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = config = model.config
        self.layers = list(model.model.layers[: config.num_hidden_layers])
        self.head_dim = self.layers[0].self_attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        # Mistral passes the config's window to attention; Qwen2/3 keep one per layer; Llama has none.
        self.windows = [getattr(layer.self_attn, "sliding_window", getattr(config, "sliding_window", None))
                        if type(model).__name__ != "LlamaForCausalLM" else None for layer in self.layers]
        ops = kernels.cpu_ops() if next(model.parameters()).device.type == "cpu" else None
        self.rotary = ops.rotary_embedding_ if ops is not None else _rotary_embedding_
        self.rms_norm = ops.rms_norm if ops is not None else _rms_norm

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> LeanForward | None:
        """A lean forward for `model`, or None where it does not apply (another architecture or dtype,
        hooks that the model's own forward would run, or `TFSERVE_LEAN_FORWARD=0`)."""
        if os.environ.get("TFSERVE_LEAN_FORWARD", "1") == "0" or type(model).__name__ not in SUPPORTED:
            return None
        if model.dtype != torch.float32 or getattr(model, "hf_device_map", None):
            return None
        config = model.config
        if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
            return None
        for module in model.modules():
            if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
                return None
        norms = [model.model.norm] + [m for layer in model.model.layers
                                      for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        if any(type(norm).__name__ not in _NORMS for norm in norms):
            return None
        return cls(model)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_index: [num_samples] -> logits [num_samples, vocab]."""
        model = self.model
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        x = model.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = model.model.rotary_emb(x[None], positions[None])  # [1, num_tokens, head_dim]
        cos, sin = cos[0], sin[0]
        rms_norm = self.rms_norm
        residual = None  # the last block's output, added to x by the next norm
        for layer, window in zip(self.layers, self.windows):
            attn, mlp = layer.self_attn, layer.mlp
            h = rms_norm(x, layer.input_layernorm.weight, eps, residual)
            q = attn.q_proj.forward(h).view(num_tokens, heads, head_dim)
            k = attn.k_proj.forward(h).view(num_tokens, kv_heads, head_dim)
            v = attn.v_proj.forward(h).view(num_tokens, kv_heads, head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotary embedding
                q = F.rms_norm(q, (head_dim,), attn.q_norm.weight, attn.q_norm.variance_epsilon)
                k = F.rms_norm(k, (head_dim,), attn.k_norm.weight, attn.k_norm.variance_epsilon)
            self.rotary(q, k, cos, sin)
            # [1, heads, num_tokens, head_dim] views, as transformers hands them to attention
            o, _ = paged_attention_forward(attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], None, scaling=attn.scaling, sliding_window=window)
            residual = attn.o_proj.forward(o.view(num_tokens, heads * head_dim))
            h = rms_norm(x, layer.post_attention_layernorm.weight, eps, residual)
            residual = mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        x, residual = x.index_select(0, logits_index), residual.index_select(0, logits_index)
        return model.lm_head.forward(rms_norm(x, model.model.norm.weight, eps, residual))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's contract in torch: `x += residual` in place (if given), then transformers' RMSNorm."""
    if residual is not None:
        x.add_(residual)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, transformers' `q * cos + rotate_half(q) * sin` (and for k). q: [num_tokens, heads, head_dim],
    cos/sin: [num_tokens, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)
