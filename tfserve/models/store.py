"""The model store: `$TFSERVE_HOME/models/<name>/`, each an ordinary Hugging Face model directory.

Reading the store (list, info, completion) touches only JSON files and safetensors headers, never torch or
transformers, so `tfserve models list` and shell completion answer instantly. `pull` lives in
`tfserve.models.pull`; it is re-exported here. What one folder holds is read by `tfserve.models.folder`.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tfserve.errors import ModelNotFoundError, ModelStoreError
from tfserve.models import catalog
from tfserve.models.folder import (ModelInfo, architecture, count_parameters, dir_size, folder_info,
                                   is_speech_config, is_speech_dir, read_json, safetensors_header)

# A store name is one path component; a leading dot marks the pull's temp dirs.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# what a tokenizer is saved as, by the libraries transformers loads one with; none of them: no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json", "tiktoken.model")


@dataclass(slots=True)
class StoredModel:
    """One row of `tfserve models list`."""

    name: str
    architecture: str | None  # e.g. "LlamaForCausalLM"
    num_parameters: int | None  # from the safetensors headers; None when the weights are not safetensors
    size_bytes: int  # on disk, all files
    path: str
    problem: str | None = None  # why it cannot load ("incomplete: no weights", "unreadable config.json"); None: none

    def to_dict(self) -> dict:
        return asdict(self)


def home() -> Path:
    """The tfserve home: `$TFSERVE_HOME`, default `~/.cache/tfserve` (made when first written). One that is a
    file, or lies under one, is a ModelStoreError: every command says so in one line, not "no models"."""
    path = Path(os.environ.get("TFSERVE_HOME") or Path.home() / ".cache" / "tfserve").expanduser()
    try:
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
    except OSError:  # a folder this user may not look into: what reads or writes the home says so
        return path
    if existing is not None and not existing.is_dir():
        name = "TFSERVE_HOME" if os.environ.get("TFSERVE_HOME") else "tfserve's home"
        where = "is a file" if existing == path else f"is under a file, {existing}"
        raise ModelStoreError(f"{name} {path} {where}: point TFSERVE_HOME at a folder")
    return path


def models_dir() -> Path:
    """Where pulled models live: `<home>/models`."""
    return home() / "models"


def is_store_name(name: str) -> bool:
    """Whether `name` could name a model in the store (one path component, no leading dot)."""
    return bool(_NAME_RE.match(name))


def model_path(name: str) -> Path:
    """The directory of store model `name` (it may not exist)."""
    if not is_store_name(name):
        raise ModelStoreError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-', starting with "
                              "a letter or digit")
    return models_dir() / name


def is_complete(path: Path) -> bool:
    """Whether `path` holds a loadable HF model (`load_problem`)."""
    return path.is_dir() and load_problem(path) is None


def load_problem(path: Path) -> str | None:
    """Why the model folder `path` cannot load, or None: no config.json, no weights, or weights whose safetensors
    headers do not hold (a file cut short). (A missing tokenizer is a `store_problem` too, which the load itself
    reports.)"""
    if not (path / "config.json").is_file():
        return "incomplete: no config.json"
    return _weights_problem(path)


def _weights_problem(path: Path) -> str | None:
    """What is wrong with the weights in model folder `path` ("no weights", "broken weights: ..."), or None."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as exc:
        return f"unreadable folder: {exc.strerror or exc}"
    if not _has_weights(names):
        return "incomplete: no weights"
    for name in (n for n in names if n.endswith(".safetensors")):
        if (why := safetensors_header(path / name)[1]) is not None:
            return f"broken weights: {name} {why}"
    return None


def is_pulled(name: str) -> bool:
    """Whether store model `name` exists and is complete."""
    return is_store_name(name) and is_complete(model_path(name))


def stored_names() -> list[str]:
    """Names of the models in the store, sorted (temp dirs of running pulls excluded)."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and is_store_name(p.name))


def list_models() -> list[StoredModel]:
    """Every model in the store, sorted by name; a folder that cannot load is listed too, with its `problem`."""
    rows = []
    for name in stored_names():
        path = model_path(name)
        config = read_json(path / "config.json")
        rows.append(StoredModel(name=name, architecture=architecture(config or {}),
                                num_parameters=count_parameters(path), size_bytes=dir_size(path),
                                path=str(path), problem=store_problem(path, config)))
    root = models_dir()
    try:  # folders no model name can reach (a space, a colon): listed, so that they do not vanish unexplained
        odd = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                     and not is_store_name(p.name))
    except OSError:
        odd = []
    for path in odd:
        rows.append(StoredModel(name=path.name, architecture=None, num_parameters=None, size_bytes=dir_size(path),
                                path=str(path), problem="a folder name no model name can be (letters, digits, '.', "
                                                        "'_' and '-'): rename it to use it"))
    return sorted(rows, key=lambda row: row.name)


def folder_problem(path: Path) -> str | None:
    """`store_problem` of the model folder `path`, its config.json read here."""
    return store_problem(path, read_json(path / "config.json"))


def store_problem(path: Path, config: dict | None) -> str | None:
    """Why the store folder `path` (its config.json read as `config`) holds no loadable model, or None: no
    config.json, one that is no JSON object, no weights, no tokenizer (an interrupted copy, a hand-made folder)."""
    if not (path / "config.json").is_file():
        return "incomplete: no config.json"
    if config is None:
        return "unreadable config.json"
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as exc:
        return f"unreadable folder: {exc.strerror or exc}"
    missing = []
    if not _has_weights(names):
        missing.append("no weights")
    if not _has_tokenizer(names):
        missing.append("no tokenizer")
    if missing:
        return f"incomplete: {', '.join(missing)}"
    return _weights_problem(path)


def missing_tokenizer(path: Path) -> bool:
    """Whether the model folder `path` holds none of the files a tokenizer is saved as."""
    try:
        return not _has_tokenizer({p.name for p in path.iterdir()})
    except OSError:
        return False


def _has_weights(names: Iterable[str]) -> bool:
    return any(Path(name).suffix in _WEIGHT_SUFFIXES for name in names)


def _has_tokenizer(names: set[str]) -> bool:
    return bool(names & set(TOKENIZER_FILES)) or any(name.endswith(".tiktoken") for name in names)


def find_model_dir(name_or_path: str) -> Path:
    """A store name or a directory path -> the model directory; raises ModelNotFoundError."""
    if not name_or_path.strip():
        raise ModelNotFoundError("empty model name: give a store name or a model folder")
    candidate = Path(name_or_path).expanduser()
    if is_store_name(name_or_path) and model_path(name_or_path).is_dir():
        return model_path(name_or_path)
    if candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise ModelNotFoundError(f"no model in {candidate} (config.json missing)")
        return candidate
    raise ModelNotFoundError(not_found_message(name_or_path))


def not_found_message(name: str, chat_only: bool = False) -> str:
    """One line for a name the store does not have, naming what would work; `chat_only` (a command that takes
    a chat model): the store's and the catalog's chat models only, not the speech-to-text ones it would refuse."""
    if catalog.get_known(name) is not None:
        return f"model {name!r} is not pulled yet; run `tfserve models pull {name}`"
    names = stored_names()  # one directory listing
    pullable = sorted(set(catalog.known_names()) - set(names))
    if chat_only:
        names = [stored for stored in names if not is_speech_model(stored)]
        pullable = [known for known in pullable if catalog.get_known(known).task == "chat"]
    more = f"; `tfserve models pull` gets {', '.join(pullable)}" if pullable else ""
    where = "chat models in the store" if chat_only else "in the store"
    return (f"unknown model {name!r}: not in the store, not a path, not in the local HF cache; {where}: "
            f"{', '.join(names) or 'none'}{more}")


def model_info(name_or_path: str) -> ModelInfo:
    """Architecture, sizes, dtype and chat-template presence of a store model or an HF directory."""
    return folder_info(find_model_dir(name_or_path))


def remove(name: str) -> Path:
    """Delete store model `name`; returns the removed path."""
    path = model_path(name)
    if not path.is_dir():
        raise ModelNotFoundError(f"model {name!r} is not in the store ({models_dir()})")
    try:
        if path.is_symlink():  # a model linked into the store: the link goes, never what it points at
            path.unlink()
        else:
            shutil.rmtree(path)
    except OSError as exc:
        raise ModelStoreError(f"cannot remove {path}: {exc.strerror or exc}") from None
    return path


def is_speech_model(name: str) -> bool:
    """Whether the store model `name` is a speech-to-text (Whisper) model, served by /v1/audio/* only."""
    return is_store_name(name) and is_speech_dir(model_path(name))


def input_modalities(name: str) -> list[str] | None:
    """What the store model `name` takes in, read from its config without loading it (OpenAI's `input_modalities`
    of /v1/models): ["audio"] for a speech model, ["text", "image"] for a vision-language one (a vision tower in
    its config, of a model type transformers loads as image-text-to-text), else ["text"]; None for no store model."""
    if not is_store_name(name) or not model_path(name).is_dir():
        return None
    config = read_json(model_path(name) / "config.json") or {}
    if is_speech_config(config):
        return ["audio"]
    if isinstance(config.get("vision_config"), dict):
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        if config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
            return ["text", "image"]
    return ["text"]


