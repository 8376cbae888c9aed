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
import pickle
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from tfserve.errors import ModelLoadError, first_line

logger = logging.getLogger(__name__)

CACHE_VERSION = "7"  # bump when what the cache holds changes shape or meaning (7: TOKENIZER_CLASS, SMALL_TENSORS)
MAX_CACHED_FILES = 16  # config + tokenizer folders kept; the oldest used go first
PICKLED_TOKENIZER = "tokenizer.pickle"
TOKENIZER_CLASS = "tokenizer.class.json"  # the pickled tokenizer's class, where a stand-in can take its place
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
            tokenizer = _pickled(folder / PICKLED_TOKENIZER) or _auto("AutoTokenizer", folder)
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
        with (work / PICKLED_TOKENIZER).open("wb") as file:
            _TokenizerPickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(tokenizer)
        described = _tokenizer_class_fields(type(tokenizer))
        if described is not None:
            (work / TOKENIZER_CLASS).write_text(json.dumps(described))
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


def _pickled(path: Path) -> Any:
    """The tokenizer pickled at `path` by this user's own process (a file no one else could have written, in the
    cache folder made for this user), or None. transformers reads a tokenizer.json up to seven times over while
    loading it (Gemma 3's 33 MB: 3.7 s); its pickle loads in one pass (1.5 s; Qwen2's 0.5 s for 1.2). Its class
    is a stand-in (`_tokenizer_class`) where TOKENIZER_CLASS describes it."""
    try:
        stat = path.stat()
        if stat.st_uid != os.getuid() or stat.st_mode & 0o022 or path.parent.stat().st_mode & 0o022:
            return None
        described = path.parent / TOKENIZER_CLASS
        stand_in = json.loads(described.read_text()) if described.is_file() else None
        with path.open("rb") as file:
            return _TokenizerUnpickler(file, stand_in).load()
    except (OSError, ValueError, KeyError, pickle.UnpicklingError, EOFError, AttributeError, ImportError,
            TypeError) as exc:
        logger.debug("pickled tokenizer %s unreadable (%s)", path, first_line(exc))
        return None


class _TokenizerUnpickler(pickle.Unpickler):
    """Unpickles a tokenizer with the stand-in `_tokenizer_class` for its class where `stand_in` describes one."""

    def __init__(self, file, stand_in: dict[str, Any] | None) -> None:
        super().__init__(file)
        self.stand_in = stand_in

    def find_class(self, module: str, name: str) -> Any:
        stand_in = self.stand_in
        if stand_in is not None and (module, name) == (stand_in["module"], stand_in["name"]):
            return _tokenizer_class(name, stand_in["model"], json.dumps(stand_in["fields"], sort_keys=True))
        return super().find_class(module, name)


class _TokenizerPickler(pickle.Pickler):
    """Pickles a BPE `tokenizers.Tokenizer` as its parts (`_bpe_parts`) where they rebuild it exactly."""

    def reducer_override(self, obj: Any) -> Any:
        from tokenizers import Tokenizer

        if isinstance(obj, Tokenizer):
            parts = _bpe_parts(obj)
            if parts is not None:
                return _bpe_tokenizer, parts
        return NotImplemented


_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
                "ignore_merges")


def _bpe_parts(tokenizer) -> tuple | None:
    """A BPE tokenizer as (its JSON without the model's vocabulary and merges nor the added tokens, the vocabulary,
    the merges, the model's options, the added tokens' fields), or None where `_bpe_tokenizer` would not rebuild
    it to the same JSON. A tokenizer unpickles from its JSON, which tokenizers parses through a buffered copy of
    every value: Gemma 3's 262k tokens and 515k merges took 1.3 s; the same as Python objects handed to `BPE`,
    1.0 s (the vocabulary and merges are half of a cached Gemma start's tokenizer)."""
    json_text = tokenizer.to_str()
    state = json.loads(json_text)
    model = state.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not all(isinstance(pair, list) and len(pair) == 2 for pair in merges or ()):
        return None
    added = [(t["content"], t["single_word"], t["lstrip"], t["rstrip"], t["normalized"], t["special"])
             for t in state.get("added_tokens") or ()]
    pipeline = json.dumps({**state, "model": {**model, "vocab": {}, "merges": []}, "added_tokens": []},
                          ensure_ascii=False)
    options = {key: model[key] for key in _BPE_OPTIONS if model.get(key) is not None}
    parts = (pipeline, model["vocab"], [tuple(pair) for pair in merges], options, added)
    try:
        same = _bpe_tokenizer(*parts).to_str() == json_text
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception for a BPE it cannot build)
        logger.debug("tokenizer kept as its JSON (%s)", first_line(exc))
        return None
    return parts if same else None


def _bpe_tokenizer(pipeline: str, vocab: dict[str, int], merges: list[tuple[str, str]], options: dict[str, Any],
                   added: list[tuple]) -> Any:
    """The tokenizer `_bpe_parts` took apart: the pipeline around an empty BPE, then its model, then the added
    tokens (which take the model's ids for the tokens it has, as deserializing a tokenizer adds them)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    tokenizer = Tokenizer.from_str(pipeline)
    tokenizer.model = BPE(vocab=vocab, merges=merges, **options)
    tokenizer.add_tokens([AddedToken(content, single_word=single_word, lstrip=lstrip, rstrip=rstrip,
                                     normalized=normalized, special=special)
                          for content, single_word, lstrip, rstrip, normalized, special in added])
    return tokenizer


# what a tokenizer class that only constructs (GemmaTokenizer, Qwen2Tokenizer, LlamaTokenizer) adds to
# TokenizersBackend besides __init__: data, and the tokenizers model class it builds (`model`)
_PLAIN_CLASS_ENTRIES = {"__module__", "__qualname__", "__doc__", "__init__", "__firstlineno__",
                        "__static_attributes__", "__slotnames__"}


def _tokenizer_class_fields(cls: type) -> dict[str, Any] | None:
    """The description `_tokenizer_class` rebuilds `cls` from, or None where a stand-in would not behave as
    `cls` does: it derives from anything but TokenizersBackend, or defines a method besides the `__init__` that
    builds its tokenizer from a vocabulary (which unpickling never calls)."""
    from transformers import TokenizersBackend

    if cls is TokenizersBackend or cls.__bases__ != (TokenizersBackend,):
        return None
    model, fields = None, {}
    for key, value in vars(cls).items():
        if key in _PLAIN_CLASS_ENTRIES:
            continue
        if key == "model" and isinstance(value, type) and value.__module__.startswith("tokenizers"):
            model = value.__name__
        elif not callable(value) and _json_round_trips(value):
            fields[key] = value
        else:
            return None
    return {"module": cls.__module__, "name": cls.__name__, "model": model, "fields": fields}


def _json_round_trips(value: Any) -> bool:
    try:
        again = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False
    return again == value and type(again) is type(value)


@cache
def _tokenizer_class(name: str, model: str | None, fields: str) -> type:
    """A TokenizersBackend subclass of the same name and class attributes as a model's own tokenizer class
    (`_tokenizer_class_fields`). Importing that class imports `transformers.models`, whose package scans every
    model folder of transformers: 0.6 s of a 2-core machine's start, for a class that adds nothing a pickled
    tokenizer uses."""
    import tokenizers.models
    from transformers import TokenizersBackend

    namespace = {**json.loads(fields), "__module__": __name__,
                 "__doc__": f"{name}, unpickled from tfserve's GGUF cache.",
                 "model": getattr(tokenizers.models, model) if model else None}
    return type(name, (TokenizersBackend,), namespace)


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
