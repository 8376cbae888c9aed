"""A mixture-of-experts MLP for the lean forward (Qwen3-MoE): a router picks each token's top-k experts, and
the token's output is their outputs weighted by the router's probabilities.

It repeats transformers' Qwen3MoeSparseMoeBlock op for op: router logits in float32, softmax, top-k (weights
renormalised to sum to 1 where `norm_topk_prob`), then for each expert some token chose, in ascending order,
SiLU(gate) * up and down over those tokens, times their weights, added into the output (`index_add_`). Every
token's sum is so taken in HF's order whatever else its batch holds, and each kernel computes a row the same
way whatever the number of rows: a request's output does not depend on its batch.

Each expert is its own EngineLinear pair (gate and up stacked, then down). A GGUF file stores each projection
of every expert as one 3-D tensor [num_experts, out, in]: num_experts contiguous block matrices, each handed
to the same block kernels as any linear layer; a float model's stacks are sliced per expert. A decode token
costs its k experts' GEMVs, not all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tfserve.engine.cpu_linear import EngineLinear, LinearWeights
from tfserve.models.gguf_weights import QuantizedWeight, is_placeholder


class MixtureOfExperts:
    """`moe(h, float_from) -> [num_tokens, hidden]` for one layer's `mlp` (a SparseMoeBlock: `gate`, the
    router, and `experts`, 3-D gate_up_proj and down_proj). `blocks`: the GGUF file's stacks by
    `<name>.experts.{gate,up,down}_proj` (tfserve.models.gguf_weights), which replace the model's own;
    `weights`, `pack`: how a float expert is held, as for every linear layer (cpu_linear.py)."""

    __slots__ = ("experts", "norm_topk_prob", "num_experts", "ops", "router", "top_k")

    def __init__(self, mlp: torch.nn.Module, name: str, ops, weights: str, pack: bool, blocks: dict) -> None:
        router, stacks = mlp.gate, mlp.experts
        self.ops, self.top_k, self.norm_topk_prob = ops, router.top_k, router.norm_topk_prob
        self.num_experts, inner = stacks.down_proj.shape[0], stacks.down_proj.shape[2]
        # the router's logits pick the experts: float32 as HF's, in panels where the kernels run (a small matrix,
        # [num_experts, hidden]; the kernels compute a row alike in any batch, torch's GEMM may not)
        self.router = EngineLinear(LinearWeights(router.weight.detach().float(), None, self.num_experts), ops,
                                   "float32")
        held = {part: blocks.get(f"{name}.experts.{part}_proj") for part in ("gate", "up", "down")}
        if None in held.values() and is_placeholder(stacks.down_proj):  # a native GGUF's model holds no experts
            raise ValueError(f"{name}: the GGUF file has no expert stack of the model's shape")
        own = stacks.gate_up_proj.detach()  # [num_experts, 2 * inner, hidden]: gate rows, then up rows
        self.experts = []
        for e in range(self.num_experts):
            gate = _expert(held["gate"], e) if held["gate"] is not None else own[e, :inner]
            up = _expert(held["up"], e) if held["up"] is not None else own[e, inner:]
            down = _expert(held["down"], e) if held["down"] is not None else stacks.down_proj.detach()[e]
            fmts = [_format(part, held[kind] is not None, ops, weights, pack)
                    for part, kind in ((gate, "gate"), (up, "up"), (down, "down"))]
            if fmts[0] == fmts[1] and _qtype(gate) == _qtype(up):  # one kernel call for both, as a dense MLP's
                both = own[e] if held["gate"] is None and held["up"] is None else _stacked(gate, up)
                gate_up = [_linear(both, ops, fmts[0])]
            else:
                gate_up = [_linear(gate, ops, fmts[0]), _linear(up, ops, fmts[1])]
            self.experts.append((gate_up, _linear(down, ops, fmts[2])))

    def __call__(self, h: torch.Tensor, float_from: int = -1) -> torch.Tensor:
        """h: [num_tokens, hidden] -> the experts' weighted sum, [num_tokens, hidden]. Rows from `float_from` on
        (prompt tokens; all where it is 0, none where -1) take the block kernels' float32 road."""
        logits = self.router(h)  # [num_tokens, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)  # [num_tokens, top_k]
        if self.norm_topk_prob:
            top_weights /= top_weights.sum(dim=-1, keepdim=True)
        chosen = top_experts.flatten()
        order = chosen.argsort(stable=True)  # each expert's slots together, its tokens in ascending order
        tokens, slot_weights = order // self.top_k, top_weights.flatten()[order]
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        # decode tokens come first: each expert's first rows, as many as chose it among them
        decodes = (torch.bincount(top_experts[:float_from].flatten(), minlength=self.num_experts).tolist()
                   if float_from >= 0 else [-1] * self.num_experts)
        out = torch.zeros_like(h)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start:start + count]
            gate_up, down = self.experts[e]
            y = self._expert_forward(h.index_select(0, rows), gate_up, down, decodes[e])
            out.index_add_(0, rows, y.mul_(slot_weights[start:start + count, None]))
            start += count
        return out

    def _expert_forward(self, x: torch.Tensor, gate_up: list[EngineLinear], down: EngineLinear,
                        float_from: int) -> torch.Tensor:
        """down(SiLU(gate(x)) * up(x)) for one expert's rows."""
        if len(gate_up) == 1:
            y = gate_up[0](x, float_from)  # [rows, 2 * inner]: gate, then up
            if self.ops is not None:
                return down(self.ops.silu_and_mul(y), float_from)
            gate, up = y.chunk(2, dim=-1)
        else:
            gate, up = (linear(x, float_from) for linear in gate_up)
        return down(F.silu(gate).mul_(up), float_from)

    @property
    def linears(self) -> list[EngineLinear]:
        """The router and every expert's layers."""
        return [self.router] + [linear for gate_up, down in self.experts for linear in (*gate_up, down)]

    @property
    def labels(self) -> list[str]:
        """Each layer's weight format."""
        return [linear.label for linear in self.linears]

    @property
    def nbytes(self) -> int:
        """Bytes of weight one decode token reads: the router's and its top_k experts' (on average)."""
        experts = sum(linear.nbytes for gate_up, down in self.experts for linear in (*gate_up, down))
        return self.router.nbytes + experts * self.top_k // self.num_experts


def why_not(model: torch.nn.Module) -> str | None:
    """Why the lean forward cannot run `model`'s mixture-of-experts layers (None also where it has none)."""
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    if not moe:
        return None
    if model.device.type != "cpu":  # which experts run is data the host reads: no CUDA graph captures that
        return "its mixture-of-experts layers run on CPU only"
    for mlp in moe:
        router = getattr(mlp, "gate", None)
        stacks = [getattr(mlp.experts, name, None) for name in ("gate_up_proj", "down_proj")]
        if {name for name, _ in mlp.named_children()} != {"gate", "experts"} or \
                not all(hasattr(router, attr) for attr in ("weight", "top_k", "norm_topk_prob")) or \
                not all(isinstance(stack, torch.Tensor) and stack.dim() == 3 for stack in stacks):
            return "its mixture of experts is not Qwen3-MoE's (a router, experts' gate_up_proj and down_proj stacks)"
    return None


def _expert(stack, e: int):
    """Expert `e`'s matrix of a GGUF stack: a 2-D block matrix of a QuantizedWeight, a row of a float tensor."""
    if isinstance(stack, QuantizedWeight):
        return QuantizedWeight(stack.blocks[e], stack.qtype, stack.type_name)
    return stack[e]


def _qtype(part) -> int:
    return part.qtype if isinstance(part, QuantizedWeight) else 0


def _stacked(gate, up):
    """Gate rows, then up rows: one matrix for one kernel call."""
    if isinstance(gate, QuantizedWeight):
        import numpy as np

        return QuantizedWeight(np.concatenate([gate.blocks, up.blocks]), gate.qtype, gate.type_name)
    return torch.cat([gate, up])


def _format(part, from_file: bool, ops, weights: str, pack: bool) -> str:
    """How an expert's matrix is held, as lean.py's format_of decides for a linear layer: a GGUF file's blocks
    as stored, its float stack in panels of its type; the model's own weights as `weights` says."""
    if isinstance(part, QuantizedWeight):
        return "gguf"
    if ops is None:
        return "torch"
    if from_file:
        return str(part.dtype).removeprefix("torch.")
    # a weight the file holds in no block type, or one Q8_0's blocks of 32 inputs do not fit: float32
    if weights == "gguf" or weights == "int8" and part.shape[1] % 32:
        return "float32" if pack else "torch"
    return "torch" if weights == "float32" and not pack else weights


def _linear(part, ops, fmt: str) -> EngineLinear:
    if isinstance(part, QuantizedWeight):
        return EngineLinear(LinearWeights(None, None, part.blocks.shape[0]), ops, "gguf", part)
    return EngineLinear(LinearWeights(part, None, part.shape[0]), ops, fmt)
