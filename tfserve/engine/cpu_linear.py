"""Linear layers as the lean forward multiplies them on CPU, with the weights in the format the engine runs.

A decode step multiplies every weight by only as many rows as there are running sequences, so it is bound
by reading the weights; a general GEMM reads them at about half the memory bandwidth at those shapes. An
`EngineLinear` holds its own copy of one layer's weight for the kernels in csrc/ (linear.h, quant.h):

    float32           panels of whole vectors (at one row twice the bandwidth MKL's GEMV reaches on AVX2),
                      held in 16 bits where every weight is a 16-bit number (a bfloat16 or float16
                      checkpoint loaded in float32): the same products from half the bytes
    float16/bfloat16  panels in 16 bits, widened in registers: half the bytes, float32 arithmetic; bfloat16
                      goes through the CPU's bfloat16 dot products where it has them (AVX512-BF16): the
                      inputs rounded to bfloat16, float32 sums, twice the float32 rate for many rows
    int8              GGUF Q8_0 blocks quantized from the float weight (32 weights per float16 scale)
    gguf              a GGUF file's own blocks, as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
                      Q2_K .. Q6_K (those need in_features % 256 == 0)

The block formats multiply decode tokens with activations quantized to int8 per block of 32 (integer dot
products, as llama.cpp does) and prompt tokens over the exactly dequantized weights: through the bfloat16 dot
products where the CPU has them (weights and inputs rounded to bfloat16, float32 sums: twice the float32 rate,
and no int8 rounding of the prompt's large activations), else in float32 (what the float32 engine computes).
`rows(ids)` reads weight rows back in float32, so that a token embedding tied to the LM head is looked up in the
head's own copy. Every kernel computes every row the
same way whatever the number of rows, so a request's output does not depend on the rest of its batch. The
caller's `nn.Linear` is never changed, so the model outside the engine (its own `generate`, training) runs
exactly as before.
"""

from __future__ import annotations

import torch

from tfserve.engine.kernel_paths import block_units, matmul_unit_names
from tfserve.models.gguf_weights import BLOCK_TYPES, QuantizedWeight

MAX_PACKED_BYTES = 4 << 30  # a float32 packed copy is as large as the weights
_PANEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_Q8_0 = BLOCK_TYPES["Q8_0"]
_BLOCK_NAMES = {qtype: name for name, qtype in BLOCK_TYPES.items()}


class EngineLinear:
    """`linear(x)`, x: float32 [rows, in_features] -> [rows, out_features], over one layer's weights. Without
    `ops` (the compiled kernels) it is F.linear; with them the weight is held in `weights` format (`blocks`:
    the layer's GGUF blocks for "gguf")."""

    __slots__ = ("bias", "format", "in_features", "ops", "out_features", "packed", "prompt_dot", "qtype", "weight")

    def __init__(self, layer: torch.nn.Linear, ops=None, weights: str = "float32", blocks=None) -> None:
        self.bias, self.out_features = layer.bias, layer.out_features
        self.ops, self.packed, self.qtype = ops, None, 0
        self.prompt_dot = bool(getattr(ops, "bf16_dot", False))  # blocks: prompt rows in bfloat16 dot products
        self.format = weights if ops is not None else "torch"
        weight = layer.weight.detach() if layer.weight is not None else None
        self.in_features = weight.shape[1] if weight is not None else None
        self.weight = layer.weight if self.format == "torch" else None  # the kernels' formats hold their own copy
        if self.format in _PANEL_DTYPES:
            held = exact_16_bit(weight) or "float32" if self.format == "float32" else self.format
            # (a float32 model keeps float32 arithmetic even where its weights are exactly bfloat16)
            dot = self.format == "bfloat16" and getattr(ops, "bf16_dot", False)
            self.packed = ops.pack_linear_weight(weight, _PANEL_DTYPES[held], dot=dot)
        elif self.format == "int8":
            self.packed, self.qtype = ops.repack_blocks(ops.quantize_q8_0(weight), _Q8_0), _Q8_0
        elif self.format == "gguf":  # (`blocks.blocks`: one array, or a list of several layers' stacked by `fused`)
            parts = blocks.blocks if isinstance(blocks.blocks, list) else [blocks.blocks]
            self.packed = ops.repack_block_parts([torch.from_numpy(part) for part in parts], blocks.qtype)
            self.qtype = blocks.qtype
        elif self.format != "torch":
            raise ValueError(f"weights must be float32, float16, bfloat16, int8 or gguf (got {weights!r})")

    def __call__(self, x: torch.Tensor, float_from: int = -1) -> torch.Tensor:
        """x @ W.T + bias. With blocks, rows from `float_from` on (a step's prompt tokens) multiply over the
        exactly dequantized weight (`prompt_dot`: in bfloat16), the others with int8 activations (all where it
        is -1)."""
        if self.format == "torch":  # exactly F.linear's ops
            if self.bias is None:
                return torch.mm(x, self.weight.t())
            return torch.addmm(self.bias, x, self.weight.t())
        if self.qtype:
            return self.ops.quant_linear(x, self.packed, self.qtype, self.out_features, self.bias, float_from,
                                         self.prompt_dot)
        return self.ops.linear(x, self.packed, self.out_features, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [n]) of the weight, i.e. output features, as float32 [n, in_features]: exactly the
        weights the layer multiplies by (GGUF blocks as gguf-py dequantizes them)."""
        if self.qtype:
            return self.ops.dequantize_rows(self.packed, self.qtype, self.out_features, ids)
        if self.format == "torch":
            return self.weight.detach()[ids].float()
        panel_cols = self.ops.vec_width * 2  # panels [num_panels, in_features, panel_cols]
        if self.packed.shape[2] == panel_cols:
            return self.packed[ids // panel_cols, :, ids % panel_cols].float()
        # bfloat16 dot-product panels [num_panels, in_features / 2, panel_cols * 2]: inputs i, i+1 side by side
        pairs = self.packed.view(self.packed.shape[0], self.packed.shape[1], panel_cols, 2)
        rows = pairs[ids // panel_cols, :, ids % panel_cols].reshape(len(ids), -1)
        return rows[:, :self.in_features].float()

    @property
    def label(self) -> str:
        """The format as logs show it: float32, float16, ..., int8, or the GGUF block type (Q4_1, ...)."""
        if self.format == "gguf":
            return _BLOCK_NAMES.get(self.qtype, "gguf")
        return "float32" if self.format == "torch" else self.format

    @property
    def nbytes(self) -> int:
        """Bytes of weight one step reads."""
        held = self.packed if self.packed is not None else self.weight
        return held.numel() * held.element_size()


def exact_16_bit(weight: torch.Tensor) -> str | None:
    """"float16" or "bfloat16" where every weight is exactly a number of that type (a 16-bit checkpoint loaded
    in float32: widening it back in registers gives the very same float32 weights), else None."""
    for name in ("float16", "bfloat16"):
        if torch.equal(weight.to(_PANEL_DTYPES[name]).to(weight.dtype), weight):
            return name
    return None


def fused(layers: list[torch.nn.Linear], ops, weights: str, blocks: list | None = None) -> EngineLinear:
    """One EngineLinear over several layers' weights stacked by output features (the query, key and value
    projections; the gate and up projections): one pass over the input and one kernel call instead of
    several. The kernels compute each output column on its own, so every column comes out as it would
    alone. `blocks`: each layer's GGUF blocks, all of one type, for "gguf"."""
    weight = None if blocks else torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(layer.out_features) for b, layer in zip(biases, layers)])
    stacked = LinearWeights(weight, bias, sum(layer.out_features for layer in layers))
    if blocks:  # repacked from where each layer's blocks lie: no concatenated copy of them (1 s of a 1.5B's start)
        joined = QuantizedWeight([b.blocks for b in blocks], blocks[0].qtype, blocks[0].type_name)
        return EngineLinear(stacked, ops, "gguf", joined)
    return EngineLinear(stacked, ops, weights)


class LinearWeights:
    """What EngineLinear reads of a layer (`weight`, `bias`, `out_features`), for weights no nn.Linear holds:
    several layers' stacked, or a tensor a GGUF file keeps in floats for a layer that holds none."""

    __slots__ = ("weight", "bias", "out_features")

    def __init__(self, weight, bias, out_features: int) -> None:
        self.weight, self.bias, self.out_features = weight, bias, out_features


def stored_in_bfloat16(model: torch.nn.Module) -> bool:
    """True where the checkpoint holds bfloat16 numbers (a model trained and saved in bfloat16, loaded in float32):
    every linear weight of its first decoder layer exactly a bfloat16 (a float32 checkpoint's never all are)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    weights = [m.weight for m in layers[0].modules() if type(m) is torch.nn.Linear and m.weight is not None]
    return bool(weights) and all(w.dtype == torch.float32 and w.device.type == "cpu" and
                                 torch.equal(w.detach(), w.detach().bfloat16().float()) for w in weights)


def can_pack(model: torch.nn.Module, ops) -> bool:
    """True where float32 panels apply: float32 weights on CPU, the kernels built, and a model small enough
    for a second copy of its weights."""
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


def matmul_units(formats, ops) -> dict[str, str]:
    """Which instructions multiply each weight format in use (`formats`: the lean forward's labels, e.g.
    float32, bfloat16, int8, Q4_K), for the banner, the log and /metrics: empty without the kernels. GGUF
    blocks and int8 multiply decode rows in integers and prompt rows as `block_units` says."""
    paths = matmul_unit_names(ops)  # bfloat16 on AMX tiles where amx.py chose them
    if not paths:
        return {}
    decode, prompt = block_units(ops)
    return {fmt: paths[fmt] if fmt in _PANEL_DTYPES else f"{decode} (decode rows), {prompt} (prompt rows)"
            for fmt in formats}


class PackedLinear(torch.nn.Module):
    """An nn.Linear's place in a model run outside the engine (the sentence encoder), multiplied by the kernels'
    float32 panels: 1.5-2x torch's GEMM at a sentence's dozen rows, 1.1-1.2x at a batch's hundreds (Zen 5)."""

    def __init__(self, layer: torch.nn.Linear, ops) -> None:
        super().__init__()
        self.linear, self.out_features = EngineLinear(layer, ops, "float32"), layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return self.linear(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module, ops) -> int:
    """Every nn.Linear of `model` (float32, CPU) replaced by a PackedLinear, where the kernels are built and the
    model small enough for a packed copy (`can_pack`); the number replaced."""
    if not can_pack(model, ops):
        return 0
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if type(child) is torch.nn.Linear]
    for parent, name, child in places:
        setattr(parent, name, PackedLinear(child, ops))
    return len(places)
