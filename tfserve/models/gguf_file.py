"""A GGUF file's header and tensor table, read without loading any weight (tfserve.models.gguf_reader): what
`tfserve models info FILE.gguf` shows, and why a file that is no whole GGUF cannot load."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tfserve.errors import ModelLoadError
from tfserve.models.folder import ModelInfo
from tfserve.models.gguf_reader import read


def unreadable_error(path: Path) -> ModelLoadError | None:
    """The one-line error for a `path` that cannot be read whole (truncated, no GGUF at all, not readable);
    None where it reads."""
    try:
        read(path)
    except ModelLoadError as exc:
        return exc
    return None


def gguf_info(path: Path) -> ModelInfo:
    """`models info` of a .gguf file: architecture, sizes, context, tensor types, chat template presence."""
    reader = read(path)
    arch = _value(reader, "general.architecture")
    heads = _value(reader, f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return ModelInfo(
        name=path.stem,
        architecture=arch,
        model_type=arch,
        num_hidden_layers=_value(reader, f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_value(reader, f"{arch}.attention.head_count_kv") or heads,
        max_position_embeddings=_value(reader, f"{arch}.context_length"),
        vocab_size=_value(reader, f"{arch}.vocab_size") or (len(tokens.parts) if tokens is not None else None),
        dtype=_file_type(_value(reader, "general.file_type")),
        num_parameters=sum(int(tensor.n_elements) for tensor in reader.tensors),
        size_bytes=path.stat().st_size,
        has_chat_template=bool(_value(reader, "tokenizer.chat_template")),
        path=str(path),
        gguf_file=str(path),
        tensor_types=dict(types.most_common()),
    )


def _value(reader, key: str) -> Any:
    """A scalar metadata value (int, float, bool or str); None where the key is missing or holds an array."""
    value = reader.value(key)
    return None if isinstance(value, list) else value


def _file_type(value: int | None) -> str | None:
    """`general.file_type` by its llama.cpp name: 3 -> "Q4_1" (most tensors; a few stay F32)."""
    import gguf

    if value is None:
        return None
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)
