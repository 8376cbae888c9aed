"""What a sentence-embedding model's folder says about turning token states into one vector: the
sentence-transformers files beside its config.json (modules.json, 1_Pooling/config.json, sentence_bert_config.json,
config_sentence_transformers.json), read without torch; and the pooling itself.

A folder without modules.json is pooled as sentence-transformers pools a plain transformers model: mean
pooling, no normalisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' Pooling modes, in the order it concatenates them when several are on
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")
_SUPPORTED_MODULES = {"Transformer", "Pooling", "Normalize"}
# encoder families whose bare `*Model` checkpoint is an embedding model even without modules.json
_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra", "deberta-v2", "modernbert",
                  "nomic_bert"}


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How token states become a sentence vector, as the model's sentence-transformers config says."""

    modes: tuple[str, ...] = ("mean",)  # concatenated in POOLING_MODES order when several
    normalize: bool = False  # a Normalize module follows the pooling: unit L2 norm
    max_seq_length: int | None = None  # sentence_bert_config.json's limit on input tokens; None: the model's
    # sizes `dimensions` may cut the vector to (Matryoshka-trained models, declared in
    # config_sentence_transformers.json as "matryoshka_dimensions"); empty: the native size only
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self):
        unknown = [mode for mode in self.modes if mode not in POOLING_MODES]
        if not self.modes or unknown:
            raise ValueError(f"pooling modes must be some of {', '.join(POOLING_MODES)} (got {list(self.modes)})")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_pooling_config(path: Path) -> PoolingConfig:
    """The PoolingConfig of the model folder `path`; ValueError for modules tfserve does not run (a Dense layer)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except FileNotFoundError:
        modules = None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / 'modules.json'} cannot be read: {exc}") from None
    st_config = _read_json(path / "config_sentence_transformers.json")
    matryoshka = tuple(int(d) for d in st_config.get("matryoshka_dimensions") or ())
    max_seq_length = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
    if modules is None:
        return PoolingConfig(max_seq_length=max_seq_length, matryoshka_dimensions=matryoshka)
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    unsupported = [kind for kind in kinds if kind not in _SUPPORTED_MODULES]
    if unsupported:
        raise ValueError(f"{path.name}: sentence-transformers modules {', '.join(unsupported)} are not supported "
                         f"(tfserve runs Transformer, Pooling and Normalize)")
    modes: tuple[str, ...] = ("mean",)
    pooling = next((m for m, kind in zip(modules, kinds) if kind == "Pooling"), None)
    if pooling is not None:
        settings = _read_json(path / pooling.get("path", "") / "config.json")
        if settings.get("pooling_mode_weightedmean_tokens"):
            raise ValueError(f"{path.name}: weighted-mean pooling is not supported")
        modes = tuple(mode for mode in POOLING_MODES if any(settings.get(f"pooling_mode_{mode}{suffix}")
                                                            for suffix in ("", "_token", "_tokens"))) or modes
    return PoolingConfig(modes=modes, normalize="Normalize" in kinds, max_seq_length=max_seq_length,
                         matryoshka_dimensions=matryoshka)


def is_embedding_dir(path: Path) -> bool:
    """Whether the model folder `path` holds a sentence-embedding encoder: a sentence-transformers folder, or a
    bare encoder checkpoint (`BertModel`, no language-model head)."""
    try:
        if (path / "modules.json").is_file():
            return True
        config = _read_json(path / "config.json")
    except OSError:  # a name too long for a path, a folder we may not read: not one
        return False
    architectures = config.get("architectures") or []
    return config.get("model_type") in _ENCODER_TYPES and all(str(a).endswith("Model") for a in architectures)


def pool(hidden, mask, config: PoolingConfig):
    """Sentence vectors [batch, dim * len(modes)] from token states `hidden` [batch, seq, dim] and the attention
    `mask` [batch, seq] (1 on real tokens, right-padded), as sentence-transformers' Pooling and Normalize."""
    import torch

    mask_f = mask.unsqueeze(-1).to(hidden.dtype)  # [batch, seq, 1]
    lengths = mask_f.sum(1).clamp(min=1e-9)  # [batch, 1]
    parts = []
    for mode in config.modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(mask_f == 0, -1e9).max(1).values)
        elif mode == "mean":
            parts.append((hidden * mask_f).sum(1) / lengths)
        elif mode == "mean_sqrt_len":
            parts.append((hidden * mask_f).sum(1) / lengths.sqrt())
        else:  # lasttoken: the last real token of each row
            last = mask.sum(1).long().clamp(min=1) - 1
            parts.append(hidden[torch.arange(hidden.shape[0]), last])
    vectors = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if config.normalize else vectors
