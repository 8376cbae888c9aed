"""A GGUF file's quantized linear weights as they are stored, for the engine's block kernels.

transformers reads a GGUF by expanding every tensor to float; the engine can instead multiply by the file's
own blocks (Q4_0, Q4_1, Q8_0), 4 to 7 times fewer bytes per token than float32. This maps the file's tensor
names to the model's module names (transformers' own GGUF name map) and hands over each quantized tensor as
a uint8 array of whole blocks, one row per output feature, rows in the model's order: llama.cpp stores the
query and key rows of Llama models permuted for its rotary layout, and permuting whole rows undoes that on
the blocks exactly as transformers undoes it on the floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # the kernels' formats, by GGUF's type ids
STORE_FILE = "model.gguf"  # where the store keeps a pulled model's original file, beside its HF files


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    blocks: Any  # numpy uint8 [out_features, bytes per row], writable
    qtype: int  # GGUF's type id: 2 Q4_0, 3 Q4_1, 8 Q8_0
    type_name: str


def gguf_source(path: str | Path) -> Path | None:
    """The GGUF file a model was loaded from: `path` itself, or the store's copy beside an HF directory."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    candidate = path / STORE_FILE
    return candidate if candidate.is_file() else None


def quantized_linear_weights(gguf_path: str | Path, model) -> dict[str, QuantizedWeight]:
    """`{module name: QuantizedWeight}` for every linear weight of `model` that the file stores as Q4_0, Q4_1
    or Q8_0 with a shape matching the module (a tied LM head takes the embedding's blocks)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(gguf_path))
    config = model.config
    names = _gguf_names(model)  # gguf tensor name (no suffix) -> hf module name
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        hf_name = names.get(tensor.name.removesuffix(".weight"))
        if type_name not in BLOCK_TYPES or hf_name is None:
            continue
        hf_name += ".weight"
        blocks = np.asarray(tensor.data)  # [rows, bytes per row], a view of the memory-mapped file
        rows = _row_order(tensor.name, blocks.shape[0], config)
        # a copy, not a view of the mapped file: the file may be replaced while the engine runs
        weight = QuantizedWeight(np.array(blocks if rows is None else blocks[rows], order="C"),
                                 BLOCK_TYPES[type_name], type_name)
        for target in _targets(hf_name, params, model):
            if tuple(params[target].shape) == _shape(tensor):
                out[target.removesuffix(".weight")] = weight
    return out


def _gguf_names(model) -> dict[str, str]:
    """gguf-py's own tensor-name map (what transformers' GGUF loader uses), for the model's linear layers and
    embedding only: `{"blk.0.attn_q": "model.layers.0.self_attn.q_proj", ...}`."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config
    model_type = {"mistral": "llama"}.get(config.model_type, config.model_type)
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model_type), None)
    if arch is None:
        return {}
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            gguf_name = name_map.get_name(name)
            if gguf_name is not None:
                names[gguf_name] = name
    return names


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
    """The row permutation that undoes llama.cpp's query/key reordering (Llama and Mistral files only)."""
    if config.model_type not in ("llama", "mistral") or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    import numpy as np

    dim = num_rows // heads // 2
    return np.arange(num_rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)
