"""A GGUF file's tokenizer as tfserve's cache keeps it for the next start: pickled, its BPE vocabulary and merges
as Python objects (`_bpe_parts`), its transformers class replaced on load by a stand-in of the same name and
fields (`_tokenizer_class`) where that class adds nothing a pickled tokenizer uses. Read and written only in the
cache folder gguf_native.py makes for this user."""

from __future__ import annotations

import json
import logging
import os
import pickle
from functools import cache
from pathlib import Path
from typing import Any

from tfserve.errors import first_line

logger = logging.getLogger(__name__)

PICKLED_TOKENIZER = "tokenizer.pickle"
TOKENIZER_CLASS = "tokenizer.class.json"  # the pickled tokenizer's class, where a stand-in can take its place


def load(folder: Path) -> Any:
    """The tokenizer cached in `folder`, or None (not there, not this user's, unreadable)."""
    return _pickled(folder / PICKLED_TOKENIZER)


def save(work: Path, tokenizer: Any) -> None:
    """Write `tokenizer` into the cache folder being made at `work`: its pickle and, where a stand-in can take
    its class's place, that class's description."""
    with (work / PICKLED_TOKENIZER).open("wb") as file:
        _TokenizerPickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(tokenizer)
    described = _tokenizer_class_fields(type(tokenizer))
    if described is not None:
        (work / TOKENIZER_CLASS).write_text(json.dumps(described))


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
