"""The lean forward's parts (backends/lean.py): projections held as the kernels hold them, rotary tables, what it
reads of an attention module, and the torch versions of the kernels' RMSNorm and rotary embedding (the kernels'
contracts, bit-identical to transformers' in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tfserve.engine.cpu_linear import EngineLinear

_GEMMA_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm")  # they multiply by (1 + weight)


class Projection:
    """`projection(x) -> (y, ...)`: one output per layer, from one stacked EngineLinear (`sizes`: each layer's
    output features) or one EngineLinear per layer. Outputs are contiguous, as the kernels take them."""

    __slots__ = ("linears", "sizes")

    def __init__(self, linears: list[EngineLinear], sizes: list[int] | None = None) -> None:
        self.linears, self.sizes = linears, sizes

    def __call__(self, x: torch.Tensor, float_from: int = -1) -> tuple[torch.Tensor, ...]:
        if self.sizes is None:
            return tuple(linear(x, float_from) for linear in self.linears)
        return tuple(part.contiguous() for part in self.linears[0](x, float_from).split(self.sizes, dim=1))

    @property
    def nbytes(self) -> int:
        """Bytes of weight one decode step reads."""
        return sum(linear.nbytes for linear in self.linears)

    @property
    def packed(self) -> bool:
        """One stacked layer whose weights the kernels hold."""
        return self.sizes is not None and self.linears[0].format != "torch"

    @property
    def labels(self) -> list[str]:
        """Each layer's weight format."""
        if self.sizes is None:
            return [linear.label for linear in self.linears]
        return [self.linears[0].label] * len(self.sizes)


class RopeTable:
    """`rope(x, positions) -> (cos, sin)`, [num_tokens, head_dim] each, as the model's rotary embedding computes
    them: where they depend on the position alone (not on the sequence length, as dynamic scaling does), looked
    up in a table the module filled once for positions 0..n (grown as positions grow), not recomputed every step.
    Every entry is the module's own arithmetic for that position (one product and its cosine or sine), so the
    values are the same bits."""

    def __init__(self, rotary: torch.nn.Module, layer_type: str | None = None) -> None:
        self.rotary = rotary
        self.kind = {} if layer_type is None else {"layer_type": layer_type}  # Gemma 3's tables by layer type
        rope_type = getattr(rotary, "rope_type", "default")
        rope_type = str(rope_type[layer_type] if isinstance(rope_type, dict) else rope_type)
        self.static = "dynamic" not in rope_type and rope_type != "longrope"
        self.cos = self.sin = None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static:
            cos, sin = self.rotary(x[None], positions[None], **self.kind)
            return cos[0], sin[0]
        # a CUDA graph being captured cannot read positions on the host: its tables were reserved before
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.reserve(int(positions.max()) + 1 if positions.numel() else 0, x)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def reserve(self, num_positions: int, x: torch.Tensor) -> None:
        """Fill the tables for positions 0..num_positions - 1 at least (`x`: their dtype and device)."""
        if self.static and (self.cos is None or num_positions > self.cos.shape[0]):
            size = max(num_positions, 2 * (self.cos.shape[0] if self.cos is not None else 1024))
            cos, sin = self.rotary(x[None], torch.arange(size, device=x.device)[None], **self.kind)
            self.cos, self.sin = cos[0], sin[0]


class Attention:
    """What the lean forward reads of an attention module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.scaling = module.scaling
        # (weight, eps) of Qwen3's and Gemma 3's per-head norms
        self.q_norm = norm_args(module.q_norm) if hasattr(module, "q_norm") else None
        self.k_norm = norm_args(module.k_norm) if hasattr(module, "k_norm") else None
        self.rope = bool(getattr(module, "use_rope", True))
        self.softcap = float(getattr(module, "attn_logit_softcapping", None) or 0.0)  # Gemma 2: tanh-capped scores


def norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """The weight an RMSNorm multiplies by: Gemma's (1 + weight), in float32 as its forward adds it."""
    plus_one = getattr(norm, "plus_one", type(norm).__name__ in _GEMMA_NORMS)
    return norm.weight.float() + 1.0 if plus_one else norm.weight


def norm_args(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    return norm_weight(norm), getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's contract in torch: `x += residual` in place (if given), then transformers' RMSNorm."""
    if residual is not None:
        x.add_(residual)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place, transformers' `q * cos + rotate_half(q) * sin` (and for k). q: [num_tokens, heads, head_dim],
    cos/sin: [num_tokens, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)
