"""Panel-packed weights for the model's linear layers on CPU (float32, AVX-512).

A decode step multiplies every weight by only as many rows as there are running sequences, so it is bound
by reading the weights, and MKL's general GEMM reads them at about half the memory bandwidth at those
shapes (at 8 rows it is 2x slower than at 1). Each `nn.Linear` keeps a copy of its weight in panels of 32
output columns for the `linear` kernel in csrc/cpu_ops.cpp, used for every input of 2 rows or more; one
row keeps `F.linear` (a matrix-vector product already at the bandwidth, and bit-identical to what
`model.generate` computes for one sequence). The kernel computes every row the same way whatever the
number of rows, so a request's output does not depend on the rest of its batch.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from tfserve.engine import kernels

MAX_PACKED_BYTES = 4 << 30  # the packed copy is as large as the weights


def can_pack(model: torch.nn.Module) -> bool:
    """True where packing applies: float32 weights on CPU and the kernel built with AVX-512."""
    param = next(model.parameters())
    ops = kernels.cpu_ops() if param.device.type == "cpu" else None
    return (
        ops is not None
        and hasattr(ops, "linear")
        and param.dtype == torch.float32
        and 0 < _weight_bytes(model) <= MAX_PACKED_BYTES
    )


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Give every plain float32 `nn.Linear` a panel-packed weight and the forward that uses it. Returns how
    many layers were packed."""
    ops = kernels.cpu_ops()
    layers = _linears(model)
    for module in layers:
        module._tfserve_panels = ops.pack_linear_weight(module.weight.detach())
        module._tfserve_linear = ops.linear
        module.forward = types.MethodType(_packed_forward, module)
    return len(layers)


def packed_linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """`F.linear(x, layer.weight, layer.bias)` for a 2-D `x` through the packed weight (2+ rows) or MKL."""
    panels = getattr(layer, "_tfserve_panels", None)
    if panels is None or x.shape[0] < 2:
        return F.linear(x, layer.weight, layer.bias)
    return layer._tfserve_linear(x, panels, layer.out_features, layer.bias)


def _linears(model: torch.nn.Module):
    # Exact type: quantized layers (bitsandbytes) subclass nn.Linear and must keep their own forward.
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32]


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():  # the kernel has no backward
        return F.linear(x, self.weight, self.bias)
    return packed_linear(x.reshape(x.numel() // x.shape[-1], x.shape[-1]), self).view(*x.shape[:-1], self.out_features)
