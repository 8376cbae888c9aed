"""The config of a GGUF file whose architecture transformers' GGUF mapping has no entry for, read by tfserve itself.

transformers reads a GGUF file's config through one table of metadata keys per architecture
(`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`) and refuses any architecture missing from it. Some that it
lacks are written by llama.cpp's converter exactly as it writes another one, so that other's keys say everything:
SmolLM3 is one (its converter class is the Llama one under another name). The tokenizer needs no such help:
transformers' GGUF tokenizer conversion goes by the tokenizer the file names (`tokenizer.ggml.model`), whatever
the architecture.
"""

from __future__ import annotations

from typing import Any

# GGUF architecture -> (transformers' model type, the architecture whose metadata keys llama.cpp writes for it)
LLAMA_LIKE = {"smollm3": ("smollm3", "llama")}


def mapped_here(reader) -> bool:
    """Whether tfserve maps the config of the file `reader` reads (tfserve.models.gguf_reader), not transformers."""
    return reader.value("general.architecture") in LLAMA_LIKE


def config_dict(reader) -> dict[str, Any]:
    """The transformers config dict of a file of a LLAMA_LIKE architecture, as transformers' mapping reads the
    architecture it is written like: the same keys under the file's own architecture, the token ids, the LM head
    tied where the file has no `output.weight`.

    SmolLM3 leaves the rotary embedding out of every fourth layer (its "NoPE" layers). llama.cpp writes no key for
    that: its model code fixes the step at 4 (`n_no_rope_layer_step = 4`, rotary where `(layer + 1) % 4 != 0`),
    the rule SmolLM3Config applies by default (`no_rope_layer_interval` 4), so the config leaves it to that."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = reader.value("general.architecture")
    model_type, written_like = LLAMA_LIKE[arch]
    keys = {"general": {"name": "_model_name_or_path"}, "tokenizer": GGUF_CONFIG_MAPPING["tokenizer"],
            arch: GGUF_CONFIG_MAPPING[written_like]}
    config: dict[str, Any] = {"model_type": model_type}
    for prefix, fields in keys.items():
        for key, field in fields.items():
            value = reader.value(f"{prefix}.{key}")
            if field is not None and value is not None:
                config[field] = value
    if "vocab_size" not in config:  # the token list's length, without reading its strings
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    config["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in reader.tensors)
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta", 10000.0), **scaling}
    return config


def _rope_scaling(reader, arch: str) -> dict[str, Any] | None:
    """The rotary scaling llama.cpp's converter writes (linear, YaRN) as transformers' rope parameters, or None."""
    kind = reader.value(f"{arch}.rope.scaling.type")
    factor = reader.value(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        return None
    scaling = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = reader.value(f"{arch}.rope.scaling.original_context_length")
    return scaling
