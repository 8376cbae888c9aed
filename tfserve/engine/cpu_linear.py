"""Pre-packed MKL weights for the model's linear layers on CPU.

A decode step multiplies every weight by only as many rows as there are running sequences, where MKL's
plain sgemm reaches about two thirds of what it does on MKL's own packed weight layout. So, for float32
models on CPU, each `nn.Linear` keeps packed copies of its weight for a few row counts that full decode
batches have (`max_num_seqs`, and 32 and 16 below it) and uses one when a step has exactly that many
tokens; any other shape takes the ordinary path. From 16 rows up the results are bit-identical to
`F.linear` (below 16 MKL takes another path, so those sizes are not packed).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

MAX_PACKED_BYTES = 2 << 30  # packed copies of the weights, all sizes together
MIN_PACKED_ROWS = 16


def can_pack(model: torch.nn.Module) -> bool:
    """True where packing applies: float32 weights on CPU with MKL's packed GEMM available."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and _weight_bytes(model) <= MAX_PACKED_BYTES
    )


def packed_row_counts(max_num_seqs: int, weight_bytes: int) -> list[int]:
    """The row counts to pack for, largest first, as many as the memory budget allows."""
    sizes = sorted({n for n in (max_num_seqs, 32, 16) if MIN_PACKED_ROWS <= n <= max_num_seqs}, reverse=True)
    return sizes[: max(MAX_PACKED_BYTES // max(weight_bytes, 1), 0)]


def pack_linear_weights(model: torch.nn.Module, max_num_seqs: int) -> list[int]:
    """Give every plain `nn.Linear` weights packed for full decode batches. Returns the row counts."""
    sizes = packed_row_counts(max_num_seqs, _weight_bytes(model))
    for module in _linears(model) if sizes else []:
        weight = module.weight.detach()
        module._tfserve_packed = {rows: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows) for rows in sizes}
        module.forward = types.MethodType(_packed_forward, module)
    return sizes


def _linears(model: torch.nn.Module):
    # Exact type: quantized layers (bitsandbytes) subclass nn.Linear and must keep their own forward.
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    packed = self._tfserve_packed.get(rows)
    if packed is not None and not torch.is_grad_enabled():
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, self.weight, self.bias, rows)
        return out.view(*x.shape[:-1], -1)
    return F.linear(x, self.weight, self.bias)
