"""Benchmark prompts: a built-in varied set (shipped, no download), random prompts of a given length,
or a JSONL / ShareGPT-style file."""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from tfserve.errors import TfserveError

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact river cloud light music garden window story engine "
          "paper question answer market city table model water energy system history science language").split()


def builtin_prompts() -> list[str]:
    """The varied prompts that ship with tfserve."""
    text = resources.files("tfserve.bench").joinpath("data/prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def load_file(path: str | Path) -> list[str]:
    """Prompts from a JSONL file (`{"prompt": ...}` or `{"text": ...}` per line) or a ShareGPT JSON/JSONL
    (`{"conversations": [{"from": "human", "value": ...}, ...]}`: the first human turn)."""
    path = Path(path)
    if not path.is_file():
        raise TfserveError(f"dataset {path} not found")
    try:
        raw = path.read_text()
    except OSError as exc:  # a file this user may not read
        raise TfserveError(f"cannot read dataset {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TfserveError(f"dataset {path} is not text (JSON or JSONL)") from None
    try:
        items = json.loads(raw) if raw.lstrip().startswith("[") else [json.loads(l) for l in raw.splitlines() if l.strip()]
    except json.JSONDecodeError as exc:
        raise TfserveError(f"dataset {path} is not JSON or JSONL ({exc.msg}, line {exc.lineno})") from None
    prompts = [p for p in map(_prompt_of, items) if p]
    if not prompts:
        raise TfserveError(f"dataset {path} has no prompts (expected 'prompt', 'text' or ShareGPT 'conversations')")
    return prompts


def _prompt_of(item) -> str | None:
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        return None
    for key in ("prompt", "text", "question", "input"):
        if isinstance(item.get(key), str):
            return item[key]
    for turn in item.get("conversations") or item.get("messages") or []:
        if isinstance(turn, dict) and turn.get("from", turn.get("role")) in ("human", "user"):
            return turn.get("value", turn.get("content"))
    return None


def random_text_prompts(num_prompts: int, input_len: int, tokenizer=None, seed: int = 0) -> list[str]:
    """Prompts of about `input_len` tokens: random token ids decoded with `tokenizer` when one is given
    (then re-encoded and trimmed to the exact length), random words otherwise."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        if tokenizer is None:
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(input_len)))
            continue
        low = min(100, tokenizer.vocab_size // 2)
        ids = [rng.randrange(low, tokenizer.vocab_size) for _ in range(input_len)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer.encode(text, add_special_tokens=False)[:input_len]
        prompts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return prompts


def take(prompts: list[str], num_prompts: int) -> list[str]:
    """`num_prompts` prompts, cycling through the set when it is shorter."""
    if not prompts:
        raise TfserveError("no prompts to send")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]
