"""A GGUF file loaded natively: the model's config and tokenizer from the file's metadata, a model whose small
tensors (norms, biases) come from the file and whose linear layers and embedding hold no weights at all; the
engine then multiplies by the file's own blocks (tfserve.models.gguf_weights).

transformers' own GGUF loader dequantizes every tensor into a float32 model: a minute and more for a 0.5B
file, and a float32 copy of the weights in memory. Here nothing of the weights is expanded: the config and
tokenizer come from transformers' mapping of GGUF metadata (the part of its loader that is not dequantizing),
and are kept in a cache keyed by the file, so a second start reads neither the metadata's vocabulary nor its
merges again. Linear weights and the embedding are placeholders of their shape that take no memory (one
number seen through a zero stride); only the engine's lean forward runs such a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from tfserve.errors import ModelLoadError, first_line
from tfserve.models import gguf_tokenizer_cache as tokenizer_cache

logger = logging.getLogger(__name__)

CACHE_VERSION = "7"  # bump when what the cache holds changes shape or meaning (7: TOKENIZER_CLASS, SMALL_TENSORS)
MAX_CACHED_FILES = 16  # config + tokenizer folders kept; the oldest used go first
SMALL_TENSORS = "small_tensors.safetensors"  # the model's norms and biases as processed from the file's tensors
FULL_CONFIG = "config.full.json"  # every field of the config (config.json leaves out the class's defaults)


def load_config_and_tokenizer(path: Path) -> tuple[Any, Any]:
    """(config, tokenizer) of a GGUF file: from the cache when this file was read before, else from its metadata
    through transformers' mapping (then cached)."""
    from tfserve.models.gguf_reader import serving_gguf_readers

    folder = _cache_dir(path)
    if (folder / "config.json").is_file():
        try:
            os.utime(folder)  # used now: the last to go when the cache is pruned
            # (transformers' Auto classes only where the cache's own files are not enough: importing them scans
            # every model folder of transformers, 1 s)
            config = _light_config(folder / FULL_CONFIG) or _auto("AutoConfig", folder)
            tokenizer = tokenizer_cache.load(folder) or _auto("AutoTokenizer", folder)
            return _named(path, config, tokenizer)
        except (OSError, ValueError, KeyError) as exc:  # a cache left damaged: read the file again
            logger.debug("GGUF cache %s unreadable (%s); reading %s", folder, first_line(exc), path)
    start = time.perf_counter()
    with alone(path) as source, serving_gguf_readers():
        config, tokenizer = _from_metadata(source, path)
    _stated_fields(path, config)
    logger.info("read %s's config and tokenizer from its metadata in %.1f s (cached for the next start)",
                path.name, time.perf_counter() - start)
    _save(folder, config, tokenizer)
    return _named(path, config, tokenizer)


def _auto(name: str, folder: Path) -> Any:
    import transformers

    return getattr(transformers, name).from_pretrained(folder, local_files_only=True)


def _from_metadata(source: str, path: Path) -> tuple[Any, Any]:
    """(config, tokenizer) from the file's metadata through transformers' GGUF mapping; for an architecture it has
    no mapping for but llama.cpp writes like one it has (tfserve.models.gguf_config: SmolLM3), the config mapped
    here and the tokenizer converted by transformers all the same (it goes by the tokenizer the file names)."""
    from transformers import AutoConfig, AutoTokenizer

    from tfserve.models import gguf_config
    from tfserve.models.gguf_reader import read

    reader = read(path)
    if not gguf_config.mapped_here(reader):
        return (AutoConfig.from_pretrained(source, gguf_file=path.name, local_files_only=True),
                AutoTokenizer.from_pretrained(source, gguf_file=path.name, local_files_only=True))
    from transformers import TokenizersBackend

    config = AutoConfig.for_model(**gguf_config.config_dict(reader))
    # AutoTokenizer asks transformers' config mapping first, which refuses the architecture; the class it gives a
    # file of llama.cpp's tokenizers converts the metadata itself
    return config, TokenizersBackend.from_pretrained(source, gguf_file=path.name, local_files_only=True)


# what llama.cpp writes that transformers' mapping leaves out for some architectures, where the config class's
# default would apply instead: Qwen3Config's head_dim of 128 (wrong for a Qwen3 of any other head size),
# Gemma2Config's caps (right for Google's releases, not for every fine-tune), Qwen3MoeConfig's expert width of 768
_STATED = {"attention.key_length": "head_dim", "attn_logit_softcapping": "attn_logit_softcapping",
           "final_logit_softcapping": "final_logit_softcapping", "expert_feed_forward_length": "moe_intermediate_size"}


def _stated_fields(path: Path, config: Any) -> None:
    """The config fields the file states (`_STATED`) where transformers' mapping reads none for the architecture."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from tfserve.models.gguf_reader import read

    reader = read(path)
    arch = reader.value("general.architecture")
    mapped = GGUF_CONFIG_MAPPING.get(arch, {})
    for key, field in _STATED.items():
        value = reader.value(f"{arch}.{key}")
        if isinstance(value, (int, float)) and key not in mapped and hasattr(config, field):
            setattr(config, field, value)


def _named(path: Path, config: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Both named by the file, wherever they were read from."""
    config._name_or_path = tokenizer.name_or_path = str(path)
    return config, tokenizer


def build_model(reader, config: Any):
    """The model of `config` with the norms and biases of the file `reader` reads (tfserve.models.gguf_reader),
    its linear layers' and embedding's weights placeholders (`gguf_weights.is_placeholder`): what the engine's
    lean forward needs besides the blocks it reads itself. The module tree is tfserve.models.gguf_skeleton's
    where it builds one (no transformers model class imported: seconds of a start), else the transformers
    class's."""
    from tfserve.models.gguf_skeleton import build_skeleton

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    skeleton = build_skeleton(config)
    if skeleton is not None:
        try:
            return _fill(reader, config, skeleton, strict=True)
        except ModelLoadError as exc:  # the file holds what the skeleton has no place for: the class decides
            logger.info("%s: %s; building the model from its transformers class", reader.path.name, exc)
    return _fill(reader, config, _from_class(config), strict=False)


def _from_class(config: Any):
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers (rotary) real
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _fill(reader, config: Any, model, strict: bool):
    """`model` with placeholders for its linear layers' and embedding's weights and the file's values for every
    other parameter. `strict`: every tensor of the file must have its place in the model; then the values are
    cached beside the file's config (SMALL_TENSORS) and read from there on the next start."""
    from tfserve.models.gguf_weights import held_weights, placeholder

    held = held_weights(model)
    wanted = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in held]
    values = _cached_small_tensors(reader.path, wanted) if strict else None
    if values is None:
        values = _small_tensors(reader, config, model, strict, wanted)
        if strict:
            _save_small_tensors(reader.path, values)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        _set_parameter(model, name, placeholder(param.shape) if name in held else values[name].reshape(param.shape))
    model.eval()
    return model


def _small_tensors(reader, config: Any, model, strict: bool, wanted: list[str]) -> dict[str, Any]:
    """{parameter name: float32 tensor} of the `wanted` parameters from the file's tensors, each dequantized and
    processed as transformers' GGUF loader does (Gemma's norms stored less one, Llama's query/key permuted)."""
    import gguf
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from tfserve.models.gguf_config import LLAMA_LIKE
    from tfserve.models.gguf_weights import tensor_names

    arch = reader.value("general.architecture")
    arch = LLAMA_LIKE[arch][1] if arch in LLAMA_LIKE else arch  # SmolLM3's query/key biases permuted as Llama's
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = tensor_names(model)  # "blk.0.attn_norm.weight" -> "model.layers.0.input_layernorm.weight"
    unplaced = [t.name for t in reader.tensors if t.name not in names and not t.name.startswith("rope_")]
    if strict and unplaced:
        raise ModelLoadError(f"its {', '.join(unplaced[:3])} tensors have no place in the model")
    tensors = {names[t.name]: t for t in reader.tensors if t.name in names}
    values = {}
    for name in wanted:
        if name not in tensors:
            raise ModelLoadError(f"cannot load {reader.path}: it has no tensor for {name}")
        tensor = tensors[name]
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        data = processor.process(weights=data, name=tensor.name).weights
        values[name] = torch.from_numpy(data.astype("float32", copy=True))
    return values


def _cached_small_tensors(path: Path, wanted: list[str]) -> dict[str, Any] | None:
    """The values `_save_small_tensors` kept for the file at `path`, or None where there are none for exactly the
    `wanted` parameters. Processing them imports transformers' GGUF loader, and with it the tokenizer class of
    every architecture it maps and `transformers.models`: 0.6 s of a 2-core machine's start, for a few
    hundred kB of norms."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cached = _cache_dir(path) / SMALL_TENSORS
    try:
        values = load_file(cached) if cached.is_file() else None
    except (OSError, SafetensorError) as exc:
        logger.debug("cached tensors %s unreadable (%s)", cached, first_line(exc))
        return None
    return values if values is not None and set(values) == set(wanted) else None


def _save_small_tensors(path: Path, values: dict[str, Any]) -> None:
    """Keep `values` in the file's cache folder (written whole, then renamed), where `load_config_and_tokenizer`
    made one; never fails a load."""
    from safetensors.torch import save_file

    folder = _cache_dir(path)
    if not folder.is_dir():
        return
    try:
        work = folder / f".{SMALL_TENSORS}.{os.getpid()}"
        save_file({name: value.contiguous() for name, value in values.items()}, work)
        os.replace(work, folder / SMALL_TENSORS)
    except OSError as exc:
        logger.warning("cannot cache the GGUF file's norms in %s (%s)", folder, first_line(exc))


def architecture_class(config: Any) -> str | None:
    """The transformers class name of the config's causal LM (`Qwen2ForCausalLM`), None where it has none."""
    from tfserve.models.gguf_skeleton import ARCHITECTURES

    if config.model_type in ARCHITECTURES:  # without importing transformers' mapping of every model (0.5 s)
        return ARCHITECTURES[config.model_type]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)


def why_not(reader) -> str | None:
    """Why the engine cannot run the tensors of the file `reader` reads as stored (a type its kernels lack), or
    None."""
    from tfserve.models.gguf_weights import runs_as_stored

    other = sorted({t.tensor_type.name for t in reader.tensors if not runs_as_stored(t.tensor_type.name)})
    return f"its {', '.join(other)} tensors are not a type the kernels run" if other else None


def _set_parameter(model, name: str, value) -> None:
    import torch

    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))


def _file_key(path: Path) -> str:
    """The cache's name for one file as it is now: where it is, its size, when it was written, the versions that
    shape what is cached."""
    import transformers

    stat = path.stat()
    parts = [str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), str(stat.st_ino), CACHE_VERSION,
             transformers.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def cache_root() -> Path:
    """Where the config and tokenizer of GGUF files read before are kept: `$TFSERVE_HOME/cache/gguf`."""
    from tfserve.models.store import home

    return home() / "cache" / "gguf"


def _cache_dir(path: Path) -> Path:
    return cache_root() / _file_key(path)


def _save(folder: Path, config: Any, tokenizer: Any) -> None:
    """Write the cache folder whole or not at all (a folder made aside, then renamed); never fails a load."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        config.save_pretrained(work)
        (work / FULL_CONFIG).write_text(json.dumps({"class": type(config).__name__, "fields": config.to_dict(),
                                                    "class_fields": _class_fields(config)}))
        tokenizer.save_pretrained(work)  # the files anyone can read; the pickle is what a start reads
        tokenizer_cache.save(work, tokenizer)
        try:
            os.rename(work, folder)
        except OSError:  # another process cached it first
            shutil.rmtree(work, ignore_errors=True)
        _prune(folder.parent)
    except OSError as exc:
        logger.warning("cannot cache the GGUF file's config and tokenizer in %s (%s)", folder, first_line(exc))


def _light_config(path: Path) -> Any:
    """The cached config with every field its transformers class resolved on the first read, as an instance of a
    PretrainedConfig subclass of the same name and model type, or None where the file is missing or unreadable.
    Importing the class itself costs 1.2 s of a 2-core machine's start (its module pulls in transformers'
    activations, hub kernels and with them torch.distributed.tensor and sympy), for fields the cache holds."""
    try:
        saved = json.loads(path.read_text())
        fields = saved["fields"]
        config = _config_class(saved["class"], json.dumps(saved["class_fields"], sort_keys=True))(**fields)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for key, value in fields.items():  # the fields PretrainedConfig takes for itself and drops (use_cache)
        if not hasattr(config, key):
            setattr(config, key, value)
    return config


# what a config class says besides its fields: model_type, aliases (Qwen3-MoE's num_experts), rope defaults, plans
_CLASS_FIELDS = ("model_type", "attribute_map", "default_theta", "keys_to_ignore_at_inference", "base_model_tp_plan",
                 "base_model_ep_plan")


def _class_fields(config: Any) -> dict[str, Any]:
    return {name: getattr(type(config), name) for name in _CLASS_FIELDS if hasattr(type(config), name)}


@cache
def _config_class(name: str, class_fields: str) -> type:
    from transformers import PretrainedConfig

    namespace = {**json.loads(class_fields), "__module__": __name__,
                 "__doc__": f"{name}'s fields, read from tfserve's GGUF cache."}
    return type(name, (PretrainedConfig,), namespace)


def _prune(root: Path) -> None:
    """Keep the MAX_CACHED_FILES folders used last: the cache never grows past that many files' tokenizers."""
    folders = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in folders[MAX_CACHED_FILES:]:
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def alone(path: Path) -> Iterator[str]:
    """A folder that holds only a link to the GGUF file, for transformers to read it from. A file's own folder
    may hold other files (the store keeps the HF files converted from it beside it; a file dropped among
    another model's): transformers would read their tokenizer.json and tokenizer_config.json over the file's
    own, so the tokenizer and the chat template would not be the file's."""
    with tempfile.TemporaryDirectory(prefix="tfserve-gguf-") as folder:
        try:
            (Path(folder) / path.name).symlink_to(path)
        except OSError:  # no links here (some filesystems): its own folder, files beside it included
            folder = str(path.parent)
        yield folder
