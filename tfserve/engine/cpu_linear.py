"""Linear layers as the lean forward multiplies them, with panel-packed weights on CPU (float32, AVX-512).

A decode step multiplies every weight by only as many rows as there are running sequences, so it is bound
by reading the weights, and MKL's general GEMM reads them at about half the memory bandwidth at those
shapes (at 8 rows it is 2x slower than at 1). An `EngineLinear` may keep a copy of its layer's weight in
panels of 32 output columns for the `linear` kernel in csrc/cpu_ops.cpp, used for every input of 2 rows or
more; one row keeps `F.linear`'s own ops (a matrix-vector product already at the bandwidth, and
bit-identical to what `model.generate` computes for one sequence). The kernel computes every row the same
way whatever the number of rows, so a request's output does not depend on the rest of its batch.

The packed copy belongs to the engine's backend: the caller's `nn.Linear` is never changed, so the model
outside the engine (its own `generate`, training) runs exactly as before.
"""

from __future__ import annotations

import torch

MAX_PACKED_BYTES = 4 << 30  # the packed copy is as large as the weights


class EngineLinear:
    """`linear(x)`, x: [rows, in_features] -> [rows, out_features], over one layer's weights; with `ops`
    (the compiled kernels) its weight is packed into panels for steps of 2+ rows."""

    __slots__ = ("weight", "bias", "out_features", "panels", "kernel")

    def __init__(self, layer: torch.nn.Linear, ops=None) -> None:
        self.weight, self.bias, self.out_features = layer.weight, layer.bias, layer.out_features
        self.panels = ops.pack_linear_weight(layer.weight.detach()) if ops is not None else None
        self.kernel = ops.linear if ops is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is None or x.shape[0] < 2:  # exactly F.linear's ops
            if self.bias is None:
                return torch.mm(x, self.weight.t())
            return torch.addmm(self.bias, x, self.weight.t())
        return self.kernel(x, self.panels, self.out_features, self.bias)


def can_pack(model: torch.nn.Module, ops) -> bool:
    """True where packing applies: float32 weights on CPU, the kernel built with AVX-512, and a model small
    enough for a second copy of its weights."""
    param = next(model.parameters())
    return (
        ops is not None
        and hasattr(ops, "linear")
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and 0 < _weight_bytes(model) <= MAX_PACKED_BYTES
    )


def _weight_bytes(model: torch.nn.Module) -> int:
    # Exact type: quantized layers (bitsandbytes) subclass nn.Linear and are never packed.
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32)
