"""A GGUF file's quantized linear weights as they are stored, for the engine's block kernels.

transformers reads a GGUF by expanding every tensor to float; the engine can instead multiply by the file's
own blocks (BLOCK_TYPES: Q4_0 ... Q8_0 and the K-quants), 4 to 7 times fewer bytes per token than float32. This maps the file's tensor
names to the model's module names (transformers' own GGUF name map) and hands over each quantized tensor as
a uint8 array of whole blocks, one row per output feature, rows in the model's order: llama.cpp stores the
query and key rows of Llama models permuted for its rotary layout, and permuting whole rows undoes that on
the blocks exactly as transformers undoes it on the floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the kernels' formats, by GGUF's type ids: blocks of 32 weights, and the K-quants' super-blocks of 256
BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
               "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
STORE_FILE = "model.gguf"  # where the store keeps a pulled model's original file, beside its HF files


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    blocks: Any  # numpy uint8 [out_features, bytes per row]; an expert stack's [num_experts, out_features, bytes]
    # (or a list of [out_features_i, bytes per row] arrays: several layers stacked by output features, uncopied)
    qtype: int  # GGUF's type id (BLOCK_TYPES)
    type_name: str


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file a model was loaded from: `path` itself, or the store's copy beside an HF directory."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    candidate = path / STORE_FILE
    return candidate if candidate.is_file() else None


def quantized_linear_weights(gguf_path: str | Path, model) -> dict[str, Any]:
    """`{module name: weight}` for the linear layers and embedding of `model`, from the file: a QuantizedWeight
    for every tensor stored in one of BLOCK_TYPES with a shape matching the module (a tied LM head takes the
    embedding's blocks), and where the model holds no weight of its own (a natively loaded GGUF's placeholders,
    tfserve.models.gguf_native), a float32/float16/bfloat16 tensor for a tensor the file keeps in floats. A
    mixture of experts' stacks come 3-D, [num_experts, out_features, ...], under `<experts>.gate_proj`,
    `.up_proj` and `.down_proj` (`_expert_stack`).
    Blocks are views of the mapped file; whoever keeps them past the load copies them (the kernels repack)."""
    import numpy as np

    from tfserve.models.gguf_reader import read

    reader = read(Path(gguf_path))
    config = model.config
    names = tensor_names(model)  # gguf tensor name -> hf parameter name
    params = dict(model.named_parameters(remove_duplicate=False))
    held = held_weights(model)
    out: dict[str, Any] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        hf_name = names.get(tensor.name)
        if hf_name not in held:
            continue
        if tensor.name.endswith("_exps.weight"):
            out.update(_expert_stack(tensor, hf_name, params[hf_name]))
            continue
        rows = _row_order(tensor.name, tensor.data.shape[0], config)
        data = tensor.data if rows is None else tensor.data[rows]
        for target in _targets(hf_name, params, model):
            if tuple(params[target].shape) != _shape(tensor):
                continue
            if type_name in BLOCK_TYPES:
                out[target.removesuffix(".weight")] = QuantizedWeight(data, BLOCK_TYPES[type_name], type_name)
            elif type_name in _FLOAT_TYPES and is_placeholder(params[target]):
                out[target.removesuffix(".weight")] = _float_tensor(np.ascontiguousarray(data), type_name)
    return out


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _expert_stack(tensor, hf_name: str, param) -> dict[str, Any]:
    """`{"<experts>.gate_proj": weight}` (or up_proj, down_proj) for one of the file's ffn_{gate,up,down}_exps
    stacks [num_experts, out, in] where its shape fits the model's (transformers' gate_up_proj holds gate and up
    as one [num_experts, 2 * inner, hidden]); empty where it does not, or where the model holds the floats."""
    part = tensor.name.rpartition(".ffn_")[2].removesuffix("_exps.weight")  # gate, up, down
    num_experts, out_features, in_features = param.shape
    if part != "down":
        out_features //= 2
    if tuple(int(d) for d in reversed(tensor.shape)) != (num_experts, out_features, in_features):
        return {}
    key, type_name = f"{hf_name.rpartition('.')[0]}.{part}_proj", tensor.tensor_type.name
    if type_name in BLOCK_TYPES:
        return {key: QuantizedWeight(tensor.data, BLOCK_TYPES[type_name], type_name)}
    if type_name in _FLOAT_TYPES and is_placeholder(param):
        import numpy as np

        return {key: _float_tensor(np.ascontiguousarray(tensor.data), type_name)}
    return {}


def held_weights(model) -> set[str]:
    """The parameters whose values the engine takes from the file's tensors itself: the weights of the linear
    layers and the embedding, and a mixture of experts' stacked expert weights (3-D parameters of an `experts`
    module, as transformers' Qwen3-MoE holds them)."""
    import torch

    held = {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    held.update(name for name, param in model.named_parameters(remove_duplicate=False)
                if name.rpartition(".")[0].endswith("experts") and param.dim() == 3)
    return held


def placeholder(shape) -> Any:
    """A float32 tensor of `shape` that takes 4 bytes: zeros seen through zero strides, where a natively loaded
    GGUF's model (tfserve.models.gguf_native) holds a weight the engine reads from the file."""
    import torch

    return torch.zeros(1).expand(tuple(shape))


def is_placeholder(tensor) -> bool:
    """True for a `placeholder`."""
    return tensor.dim() > 0 and tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())


def is_native(model) -> bool:
    """True for a model of a natively loaded GGUF (its weights are placeholders for the file's blocks)."""
    return any(is_placeholder(param) for param in model.parameters())


def _float_tensor(data, type_name: str):
    """A float tensor of the file's own type (a BF16 tensor's bytes read as bfloat16)."""
    import numpy as np
    import torch

    if type_name == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def runs_as_stored(type_name: str) -> bool:
    """Whether the engine multiplies by a tensor of this GGUF type as the file stores it."""
    return type_name in BLOCK_TYPES or type_name in _FLOAT_TYPES


def tensor_names(model) -> dict[str, str]:
    """gguf-py's own tensor-name map (what transformers' GGUF loader uses) over every parameter of `model`:
    `{"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight", ...}`; empty for an architecture gguf-py
    does not know. One map for the whole model (transformers builds one per submodule: seconds)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config
    model_type = _GGUF_ARCHITECTURES.get(config.model_type, config.model_type)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model_type), None)
    if arch is None:
        return {}
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        base, _, suffix = name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = name
            continue
        for part in _EXPERT_PARTS.get(suffix, ()):
            stack_name = name_map.get_name(f"{base}.{part}")  # blk.N.ffn_gate_exps ...
            if stack_name is not None:
                names[f"{stack_name}.weight"] = name
    return names


# a mixture of experts' stacks are parameters of their own (model.layers.N.mlp.experts.gate_up_proj), not the
# weight of a module: the names gguf-py knows them by (transformers' fused gate_up_proj is two GGUF tensors)
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


# transformers' model types whose GGUF architecture is named otherwise
_GGUF_ARCHITECTURES = {"mistral": "llama", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _targets(hf_name: str, params: dict, model) -> list[str]:
    """The parameter itself, and the LM head where it is tied to the embedding."""
    targets = [hf_name] if hf_name in params else []
    if hf_name.endswith("embed_tokens.weight") and getattr(model.config, "tie_word_embeddings", False):
        targets.append("lm_head.weight")
    return [t for t in targets if t in params]


def _shape(tensor) -> tuple[int, int]:
    """GGUF lists dimensions innermost first: [in_features, out_features]."""
    dims = [int(d) for d in tensor.shape]
    return (dims[1], dims[0]) if len(dims) == 2 else tuple(dims)


def _row_order(name: str, num_rows: int, config):
    """The row permutation that undoes llama.cpp's query/key reordering (Llama, Mistral and SmolLM3 files only: its
    converter writes SmolLM3 as Llama)."""
    if config.model_type not in ("llama", "mistral", "smollm3") or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    import numpy as np

    dim = num_rows // heads // 2
    return np.arange(num_rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)
