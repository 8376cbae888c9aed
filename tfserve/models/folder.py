"""What a model folder holds, read from its JSON files and safetensors headers only (never torch or transformers,
so listing and completion answer at once): architecture, sizes, parameter count, chat template, speech or vision."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path

from tfserve.errors import ModelStoreError
from tfserve.models.gguf_weights import STORE_FILE


@dataclass(slots=True)
class ModelInfo:
    """What `tfserve models info` shows; read from config.json and the tokenizer files."""

    name: str
    architecture: str | None
    model_type: str | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    max_position_embeddings: int | None  # the context length
    vocab_size: int | None
    dtype: str | None  # as saved in config.json ("dtype", or "torch_dtype" in older files)
    num_parameters: int | None
    size_bytes: int
    has_chat_template: bool
    path: str
    gguf_file: str | None = None  # the original GGUF kept beside the HF files, whose blocks the engine runs
    vision_tower: str | None = None  # a vision-language model's encoder: type, layers, width
    image_tokens: str | None = None  # how many tokens one image takes in the prompt
    tensor_types: dict[str, int] | None = None  # a GGUF file's tensors by their storage type: {"Q4_1": 210, ...}

    def to_dict(self) -> dict:
        return asdict(self)


def folder_info(path: Path) -> ModelInfo:
    """Architecture, sizes, dtype and chat-template presence of the model folder `path`."""
    config = read_json(path / "config.json")
    if config is None:
        raise ModelStoreError(f"cannot read {path / 'config.json'}: not a JSON object")
    text = config.get("text_config") or config  # multimodal configs nest the language model's

    def get(*keys: str):
        return next((src[k] for k in keys for src in (text, config) if src.get(k) is not None), None)

    num_heads = get("num_attention_heads", "n_head", "encoder_attention_heads")  # Whisper: the encoder's
    return ModelInfo(
        name=path.name,
        architecture=architecture(config),
        model_type=config.get("model_type"),
        num_hidden_layers=get("num_hidden_layers", "n_layer", "encoder_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=get("num_key_value_heads") or num_heads,
        max_position_embeddings=get("max_position_embeddings", "n_positions", "max_sequence_length",
                                    "max_target_positions"),
        vocab_size=get("vocab_size"),
        dtype=get("dtype", "torch_dtype"),
        num_parameters=count_parameters(path),
        size_bytes=dir_size(path),
        has_chat_template=has_chat_template(path),
        path=str(path),
        gguf_file=str(path / STORE_FILE) if (path / STORE_FILE).is_file() else None,
        **_vision_facts(config, path),
    )


def _vision_facts(config: dict, path: Path) -> dict:
    """The vision tower and image token count of a vision-language model's config (and its processor's)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return {}
    layers = vision.get("num_hidden_layers") or vision.get("depth")
    width = vision.get("embed_dim") or vision.get("hidden_size")  # Qwen2-VL: hidden_size is its output
    tower = ", ".join(str(part) for part in (vision.get("model_type"), layers and f"{layers} layers",
                                             width and f"{width} wide") if part)
    processor = {**(read_json(path / "preprocessor_config.json") or {}),
                 **(read_json(path / "processor_config.json") or {})}
    size, patch = vision.get("image_size"), vision.get("patch_size")
    tokens = None
    if config.get("mm_tokens_per_image"):  # Gemma 3
        tokens = f"{config['mm_tokens_per_image']} per image"
    elif processor.get("image_seq_len"):  # Idefics3 / SmolVLM: per tile, and a large image is cut into tiles
        tokens = f"{processor['image_seq_len']} per tile (a large image: several tiles and a global view)"
    elif isinstance(size, int) and isinstance(patch, int) and config.get("model_type") == "llava":
        tokens = f"{(size // patch) ** 2} per image"
    elif vision.get("spatial_merge_size"):  # Qwen2-VL: by the image's size
        tokens = "by image size (one per 2x2 merged patches)"
    return {"vision_tower": tower or None, "image_tokens": tokens}


def is_speech_dir(path: Path) -> bool:
    """Whether the model directory `path` holds a speech-to-text (Whisper) model."""
    return is_speech_config(read_json(path / "config.json") or {})


def is_speech_config(config: dict) -> bool:
    """Whether a config.json is a speech-to-text (Whisper) model's."""
    return config.get("model_type") == "whisper"


def has_chat_template(path: Path) -> bool:
    """Whether the tokenizer files in `path` carry a chat template (either place transformers saves it)."""
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    return bool((read_json(path / "tokenizer_config.json") or {}).get("chat_template"))


def count_parameters(path: Path) -> int | None:
    """Number of parameters from the safetensors headers (no weights are read); None without safetensors, or
    where a header does not hold."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        count, problem = safetensors_header(file)
        if problem is not None:
            return None
        total += count
    return total


_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def safetensors_header(file: Path) -> tuple[int, str | None]:
    """(parameters, None) from a safetensors file's header, or (0, what is wrong): a header that is no JSON
    object of tensors, or tensors whose data runs past the end of the file (a copy cut short)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                return 0, f"is cut short or not safetensors (a {header_len}-byte header in a {size}-byte file)"
            header = json.loads(f.read(header_len))
    except struct.error:
        return 0, "is cut short (no header)"
    except OSError as exc:
        return 0, f"cannot be read ({exc.strerror or exc})"
    except ValueError:  # JSON, or text that is no UTF-8
        return 0, "has a header that is no JSON"
    if not isinstance(header, dict):
        return 0, "has a header that is no JSON object"
    total, end = 0, 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return 0, f"has a malformed entry for tensor {name!r}"
        total += prod(shape)
        end = max(end, offsets[1])
    if 8 + header_len + end > size:
        return 0, f"is cut short: its tensors need {8 + header_len + end} bytes, the file has {size}"
    return total, None


def dir_size(path: Path) -> int:
    """Bytes of all files under `path`; a file or folder that goes while it is read (a download's temporary
    files, which pip removes as it goes) counts as gone."""
    total = 0
    for folder, _, names in os.walk(path):  # os.walk skips a folder it cannot list
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def architecture(config: dict) -> str | None:
    """The model class a config names (its first architecture), else its model type."""
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None where it is missing, unreadable, or holds no object (`[1]`): every
    reader of a config takes a dict, and one broken folder must not break `models list` or completion."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
