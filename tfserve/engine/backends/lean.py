"""The lean forward backend: Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 2 and 3 text;
Qwen3-MoE's mixture of experts in lean_moe.py) in float32.

The model's own forward spends most of a small step outside arithmetic: module calls, keyword plumbing,
mask construction, and half a dozen element-wise ops per RMSNorm and a dozen per rotary embedding. This
walks the same modules and weights with the same operations in the same order, fewer of them: the residual
add and RMSNorm are one op, and so is the rotary embedding, all bit-identical to transformers' versions in
float32 (see csrc/cpu_ops.cpp; in torch where the kernels are off), so the engine's output is unchanged
(the golden tests compare it with `model.generate`). On CPU its linear layers may multiply through
panel-packed copies of the weights that this backend holds (cpu_linear.py); the model is never changed. Its
parts (projections, rotary tables, the torch versions of the fused ops) are in lean_layers.py.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from tfserve.engine import attention
from tfserve.engine.attention import paged_attention_forward
from tfserve.engine import cpu_linear
from tfserve.engine.backends import lean_moe
from tfserve.engine.cpu_linear import EngineLinear
from tfserve.engine.backends.lean_layers import (Attention, Projection, RopeTable, norm_weight, rms_norm,
                                                 rotary_embedding_)
from tfserve.models.gguf_weights import is_placeholder

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM",
             "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm", "Phi3RMSNorm",
          "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3MoeRMSNorm", "RMSNorm"}  # RMSNorm: tfserve.models.gguf_skeleton's
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # Gemma: tanh GELU


class LeanForward:
    """`lean(input_ids, positions, logits_index) -> logits` for one packed engine step. `ops` are the compiled
    CPU kernels (None: their torch versions); `weights` is how the linear layers hold their weights
    (cpu_linear.py; `blocks`: a GGUF file's quantized weights by module name, for "gguf"); `pack` gives float32
    layers panel-packed weights. With `tp`, the model is one rank's shard and the step's partial sums meet in
    all-reduces (tfserve.engine.parallel.tensor_parallel)."""

    name = "lean"

    def __init__(self, model: torch.nn.Module, ops=None, pack: bool = False, weights: str = "float32",
                 blocks: dict | None = None, tp=None) -> None:
        self.model = model
        self.config = config = model.config
        self.layers = list(model.model.layers[: config.num_hidden_layers])
        self.head_dim = self.layers[0].self_attn.head_dim
        self.tp = tp  # this rank's share of a model split by tfserve.engine.parallel.tensor_parallel, or None
        self.num_heads = tp.num_heads if tp is not None else config.num_attention_heads
        self.num_kv_heads = tp.num_kv_heads if tp is not None else config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # Mistral and Phi-3 pass the config's window to attention; Qwen2/3, SmolLM3 keep one per layer; Llama has none.
        self.windows = [getattr(layer.self_attn, "sliding_window", getattr(config, "sliding_window", None))
                        if type(model).__name__ != "LlamaForCausalLM" else None for layer in self.layers]
        self.ops = ops
        self.prompt_dot = False  # set below, once the layers' formats are known
        self.rotary = ops.rotary_embedding_ if ops is not None else rotary_embedding_
        self.rms_norm = ops.rms_norm if ops is not None else rms_norm
        self.act = _ACTIVATIONS[_activation(config)]

        names = {id(module): name for name, module in model.named_modules()}
        blocks = blocks or {}

        def source(layer: torch.nn.Linear):
            """(what EngineLinear reads of the layer, its GGUF blocks or None). A natively loaded GGUF's layer holds
            no weight (tfserve.models.gguf_native): a tensor the file keeps in floats comes with the blocks."""
            held = blocks.get(names[id(layer)])
            if isinstance(held, torch.Tensor):
                return cpu_linear.LinearWeights(held, layer.bias, layer.out_features), None
            return layer, held

        def format_of(layer: torch.nn.Linear) -> str:
            held = blocks.get(names[id(layer)])
            if isinstance(held, torch.Tensor):  # a float tensor of a natively loaded GGUF: panels of its type
                return str(held.dtype).removeprefix("torch.")
            if ops is None:
                return "torch"
            if layer is model.lm_head and weights in ("gguf", "int8") and not is_placeholder(layer.weight):
                # The head picks the token: int8 activations there flip near-ties (SmolLM2's first answer
                # token), 16-bit panels of its (dequantized) weights do not, and are as fast at one row: bfloat16
                # where the CPU's dot products take it (twice float16's rate for a batch's rows), else float16. A
                # natively loaded GGUF has no dequantized head: its blocks, as llama.cpp runs them
                return "bfloat16" if getattr(ops, "bf16_dot", False) else "float16"
            if weights == "gguf":  # a tensor the file keeps in another type: expanded, as transformers read it
                return "gguf" if held is not None else ("float32" if pack else "torch")
            if weights == "int8" and layer.in_features % 32:
                return "float32" if pack else "torch"  # Q8_0 blocks need whole blocks of 32 inputs
            return "torch" if weights == "float32" and not pack else weights

        def linear(*layers: torch.nn.Linear) -> Projection:
            """The layers' projections, as one stacked kernel call where their weights share a format."""
            fmts = [format_of(layer) for layer in layers]
            sources = [source(layer) for layer in layers]
            parts = [part for _, part in sources]
            if len(layers) > 1 and len(set(fmts)) == 1 and fmts[0] != "torch" and \
                    len({p.qtype for p in parts if p is not None}) <= 1:
                return Projection([cpu_linear.fused([held for held, _ in sources], ops, fmts[0],
                                                     parts if fmts[0] == "gguf" else None)],
                                   [layer.out_features for layer in layers])
            return Projection([EngineLinear(held, ops, fmt, part) for (held, part), fmt in zip(sources, fmts)])

        def fused(layer: torch.nn.Linear, sizes: list[int]) -> Projection:
            """One layer that holds several projections (Phi-3's qkv_proj, gate_up_proj), split after it."""
            held, part = source(layer)
            return Projection([EngineLinear(held, ops, format_of(layer), part)], sizes)

        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim  # this rank's

        def qkv(attn: torch.nn.Module) -> Projection:
            if hasattr(attn, "qkv_proj"):
                return fused(attn.qkv_proj, [q_size, kv_size, kv_size])
            return linear(attn.q_proj, attn.k_proj, attn.v_proj)

        def gate_up(mlp: torch.nn.Module) -> Projection:
            if hasattr(mlp, "gate_up_proj"):  # gate, then up
                return fused(mlp.gate_up_proj, [mlp.down_proj.in_features] * 2)
            return linear(mlp.gate_proj, mlp.up_proj)

        def mlp(layer: torch.nn.Module) -> tuple:
            """(gate_up, down), or a mixture of experts (lean_moe.py) and None."""
            if hasattr(layer.mlp, "experts"):
                return lean_moe.MixtureOfExperts(layer.mlp, names[id(layer.mlp)], ops, weights, pack, blocks), None
            return gate_up(layer.mlp), linear(layer.mlp.down_proj)

        # Gemma 2 and 3 normalise each block's output before the residual add ("sandwich" norms): its
        # post_attention_layernorm does that, and pre_feedforward_layernorm is the MLP's input norm
        sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")
        # Gemma 3 turns sliding-window and full layers by two rotary tables (other bases): one per layer type
        by_type = isinstance(getattr(model.model.rotary_emb, "rope_type", None), dict)
        # Per layer, in the order the forward unpacks them (columns: one list per field).
        self._layers = list(zip(*[
            (Attention(l.self_attn), qkv(l.self_attn), linear(l.self_attn.o_proj), *mlp(l),
             norm_weight(l.input_layernorm),
             norm_weight(l.pre_feedforward_layernorm if sandwich else l.post_attention_layernorm),
             norm_weight(l.post_attention_layernorm) if sandwich else None,
             norm_weight(l.post_feedforward_layernorm) if sandwich else None,
             window, l.self_attn.layer_type if by_type else None)
            for l, window in zip(self.layers, self.windows)
        ]))
        self.lm_head = linear(model.lm_head)
        self.embed = self._embedding(model.model.embed_tokens, blocks.get(names[id(model.model.embed_tokens)]))
        self.final_norm = norm_weight(model.model.norm)
        self.ropes = {kind: RopeTable(model.model.rotary_emb, kind) for kind in set(self._layers[-1])}
        self.stack = self._decoder_stack(sandwich or by_type)
        formats = Counter()
        for projection in (*(p for column in self._layers[1:5] for p in column if p is not None), self.lm_head):
            formats.update(projection.labels)
        self.weight_formats = dict(formats)  # linear layers per format, for logs and banners
        # bfloat16 weights round every linear layer's inputs to bfloat16 for the CPU's dot products, and blocks (a
        # GGUF's, int8) a prompt's rows (EngineLinear.prompt_dot); a prompt's attention then goes through them too
        # (2.0x the float32 tiles on a Zen 5 core): AttentionMetadata. An F32 file's float layers keep float32.
        rounded = set(formats) - {"float32", "float16"}
        self.prompt_dot = bool(rounded) and bool(getattr(ops, "bf16_dot", False))

    def _embedding(self, embed: torch.nn.Embedding, held):
        """`embed(input_ids) -> [num_tokens, hidden]`: the model's own module, or for a natively loaded GGUF (no
        weight of its own) rows of the file's tensor, dequantized from the blocks the LM head multiplies by
        where the two are tied (one copy), with Gemma's scale."""
        if not is_placeholder(embed.weight):
            return embed
        scale = getattr(embed, "embed_scale", None)
        if isinstance(held, torch.Tensor):
            rows = lambda ids: F.embedding(ids, held).float()  # noqa: E731
        else:
            head = self.lm_head.linears[0]
            tied = getattr(self.config, "tie_word_embeddings", False) and head.format == "gguf"
            table = head if tied else EngineLinear(cpu_linear.LinearWeights(None, None, embed.num_embeddings), self.ops,
                                                   "gguf", held)
            rows = table.rows
        return rows if scale is None else (lambda ids: rows(ids).mul_(scale))

    def weight_bytes(self) -> int:
        """Bytes of weight one decode step reads: every linear layer's as the kernels hold it (a GGUF's blocks,
        16-bit panels, float32); the norms' and one embedding row are too few to count."""
        projections = [*(p for column in self._layers[1:5] for p in column if p is not None), self.lm_head]
        return sum(projection.nbytes for projection in projections)

    def _decoder_stack(self, other_layout: bool):
        """The kernels' `DecoderStack` over every layer, for decode steps, where each layer is what it runs: the
        stacked q/k/v and gate/up projections in the kernels' formats, rotary everywhere, no per-head norms,
        SiLU, pre-norms only, one model on one rank. None where any layer is not (the loop runs)."""
        ops = self.ops
        if ops is None or not hasattr(ops, "DecoderStack") or self.tp is not None or other_layout or self.act is not F.silu:
            return None
        attns, qkvs, o_projs, gate_ups, downs, norms1, norms2 = self._layers[:7]
        if None in downs:  # a mixture of experts: the loop runs it
            return None
        if not all(a.rope and a.q_norm is None and q.packed and g.packed and len(o.linears) == len(d.linears) == 1
                   and o.linears[0].format != "torch" and d.linears[0].format != "torch"
                   for a, q, o, g, d in zip(attns, qkvs, o_projs, gate_ups, downs)):
            return None

        def held(projection: Projection) -> tuple:
            linear = projection.linears[0]
            return linear.packed, linear.qtype, linear.out_features, linear.bias

        stack = ops.DecoderStack(self.num_heads, self.num_kv_heads, self.eps)
        for attn, qkv, o_proj, gate_up, down, norm1, norm2, window in zip(
                attns, qkvs, o_projs, gate_ups, downs, norms1, norms2, self._layers[9]):
            stack.add_layer(held(qkv), held(o_proj), held(gate_up), held(down), norm1.detach(), norm2.detach(),
                            attn.scaling, window or -1)
        return stack

    def reserve_positions(self, num_positions: int) -> None:
        """Fill the rotary tables for every position below `num_positions` now (CUDA graphs capture them)."""
        embed = self.model.model.embed_tokens
        like = torch.empty(1, self.head_dim, dtype=embed.weight.dtype, device=embed.weight.device)
        for rope in self.ropes.values():
            rope.reserve(num_positions, like)

    @staticmethod
    def why_not(model: torch.nn.Module) -> str | None:
        """Why the lean forward cannot run `model`, or None when it can."""
        if type(model).__name__ not in SUPPORTED:
            return f"{type(model).__name__} is not one of {', '.join(sorted(SUPPORTED))}"
        if model.dtype != torch.float32:
            return f"its weights are {str(model.dtype).removeprefix('torch.')}, not float32"
        if getattr(model, "hf_device_map", None):
            return "it is dispatched across devices"
        config = model.config
        if _activation(config) not in _ACTIVATIONS or getattr(config, "mlp_bias", False):
            return "its MLP is not a bias-free SiLU or tanh-GELU gate"
        for module in model.modules():
            if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
                return "it has forward hooks that only its own forward would run"
        layers = model.model.layers
        norms = [model.model.norm] + [m for layer in layers for name, m in layer.named_children()
                                      if name.endswith("layernorm")]
        if any(type(norm).__name__ not in _NORMS for norm in norms):
            return "its norms are not RMSNorm"
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            return "its rotary embedding turns only part of each head"
        linears = [model.lm_head] + [m for layer in layers for block in (layer.self_attn, layer.mlp)
                                     for name, m in block.named_children() if name.endswith("_proj")]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "its linear layers are quantized"
        return lean_moe.why_not(model)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_index: [num_samples] -> logits [num_samples, vocab]."""
        model = self.model
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        rms_norm, rotary = self.rms_norm, self.rotary
        fused = self.ops is not None  # the kernels that take a stacked projection's output as it is
        meta = attention.get_metadata()
        decode = meta.groups[0] if self.ops is not None and len(meta.groups) == 1 and meta.groups[0].pad_index is None else None
        # decode tokens come first (proposals checked included); block-quantized layers take prompt tokens,
        # from here on, in float32
        num_decodes = meta.num_decode_tokens
        tp = self.tp
        x = self.embed(input_ids) if tp is None else tp.embed(model.model.embed_tokens, input_ids)
        # [num_tokens, hidden]
        ropes = {kind: rope(x, positions) for kind, rope in self.ropes.items()}  # [num_tokens, head_dim] each
        residual = None  # the last block's output, added to x by the next norm
        layers = zip(*self._layers, meta.kv_caches)
        if decode is not None and self.stack is not None:  # every layer in one kernel call
            (cos, sin), = ropes.values()
            x, residual = self.stack.forward(x, meta.kv_caches, cos, sin, decode.block_tables, decode.key_lens,
                                             meta.slot_mapping, num_decodes)
            layers = ()
        for (attn, qkv_proj, o_proj, gate_up_proj, down_proj, norm1, norm2, post_attn_norm, post_mlp_norm, window,
             kind, (k_cache, v_cache)) in layers:
            cos, sin = ropes[kind]
            h = rms_norm(x, norm1, eps, residual)
            if fused and qkv_proj.sizes is not None and attn.q_norm is None and attn.rope:  # split, copy, rotary
                q, k, v = self.ops.split_qkv_rotary(qkv_proj.linears[0](h, num_decodes), heads, kv_heads, cos, sin)
            else:
                q, k, v = qkv_proj(h, num_decodes)
                q = q.view(num_tokens, heads, head_dim)
                k = k.view(num_tokens, kv_heads, head_dim)
                v = v.view(num_tokens, kv_heads, head_dim)
                if attn.q_norm is not None:  # Qwen3, Gemma 3 normalise each head before the rotary embedding
                    q = F.rms_norm(q, (head_dim,), *attn.q_norm)
                    k = F.rms_norm(k, (head_dim,), *attn.k_norm)
                if attn.rope:  # SmolLM3 leaves it out of every fourth layer
                    rotary(q, k, cos, sin)
            if decode is not None:  # one call: cache write and attention
                o = self.ops.paged_decode_attention(q, k_cache, v_cache, decode.block_tables, decode.key_lens,
                                                    attn.scaling, window or -1, attn.softcap, k, v, meta.slot_mapping)
            else:  # [1, heads, num_tokens, head_dim] views, as transformers hands them to attention
                o, _ = paged_attention_forward(attn.module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], None, scaling=attn.scaling,
                                               sliding_window=window, softcap=attn.softcap or None)
            (residual,) = o_proj(o.view(num_tokens, heads * head_dim), num_decodes)
            if tp is not None:  # every rank's heads' share of the output
                tp.all_reduce(residual)
            if post_attn_norm is not None:
                residual = rms_norm(residual, post_attn_norm, eps)
            h = rms_norm(x, norm2, eps, residual)
            if down_proj is None:  # a mixture of experts: its router, its chosen experts, their weighted sum
                residual = gate_up_proj(h, num_decodes)
            elif gate_up_proj.packed and self.act is F.silu:  # one kernel (its exp: within rounding)
                (residual,) = down_proj(self.ops.silu_and_mul(gate_up_proj.linears[0](h, num_decodes)), num_decodes)
            else:
                gate, up = gate_up_proj(h, num_decodes)
                (residual,) = down_proj(self.act(gate).mul_(up), num_decodes)
            if tp is not None:
                tp.all_reduce(residual)
            if post_mlp_norm is not None:
                residual = rms_norm(residual, post_mlp_norm, eps)
        x, residual = x.index_select(0, logits_index), residual.index_select(0, logits_index)
        (logits,) = self.lm_head(rms_norm(x, self.final_norm, eps, residual))
        if self.final_softcap:  # Gemma 2: tanh caps the logits, in transformers' three steps
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits if tp is None else tp.gather_logits(logits)


def _activation(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
