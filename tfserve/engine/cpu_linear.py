"""Pre-packed MKL weights for the model's linear layers on CPU.

A decode step multiplies every weight by only `max_num_seqs` rows, where MKL's plain sgemm reaches about
two thirds of what it does on MKL's own packed weight layout. So, for float32 models on CPU, each
`nn.Linear` keeps a packed copy of its weight for that row count and uses it when a step has exactly that
many tokens (a full decode batch); any other shape takes the ordinary path. Results are bit-identical.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

MAX_PACKED_BYTES = 2 << 30  # packing copies the weights; not worth it (or affordable) for big models


def can_pack(model: torch.nn.Module) -> bool:
    """True where packing applies: float32 weights on CPU with MKL's packed GEMM available."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and sum(m.weight.numel() * 4 for m in _linears(model)) <= MAX_PACKED_BYTES
    )


def pack_linear_weights(model: torch.nn.Module, num_rows: int) -> int:
    """Give every plain `nn.Linear` a weight packed for `num_rows` input rows. Returns how many."""
    count = 0
    for module in _linears(model):
        module._tfserve_packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), num_rows)
        module._tfserve_packed_rows = num_rows
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    return count


def _linears(model: torch.nn.Module):
    # Exact type: quantized layers (bitsandbytes) subclass nn.Linear and must keep their own forward.
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows == self._tfserve_packed_rows and not torch.is_grad_enabled():
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), self._tfserve_packed, self.weight, self.bias, rows)
        return out.view(*x.shape[:-1], -1)
    return F.linear(x, self.weight, self.bias)
