"""Per-request sampling parameters, validated where they are made (never inside the step loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature=0` is greedy; `seed` makes a request
    repeatable whatever else shares its batch."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        for name in _FLOAT_FIELDS:  # floats from here on: an int past int64 would overflow the sampler's tensors
            value = getattr(self, name)
            _check(_is_number(value), name, "must be a finite number")
            setattr(self, name, float(value))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               "must be in [-2, 2]")
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               "must be in [-2, 2]")
        _check(self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63), "seed",
               "must be a 64-bit integer")
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
               "must be an integer in [0, 20]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_generation_config(cls, config: Any, **overrides: Any) -> SamplingParams:
        """Map a `transformers.GenerationConfig` onto our parameters."""
        do_sample = bool(getattr(config, "do_sample", False))
        kwargs: dict[str, Any] = {
            "max_tokens": getattr(config, "max_new_tokens", None) or 20,
            "temperature": float(getattr(config, "temperature", None) or 1.0) if do_sample else 0.0,
            "top_p": float(getattr(config, "top_p", None) or 1.0) if do_sample else 1.0,
            "top_k": int(getattr(config, "top_k", None) or 0) if do_sample else 0,
            "min_p": float(getattr(config, "min_p", None) or 0.0) if do_sample else 0.0,
            "repetition_penalty": float(getattr(config, "repetition_penalty", None) or 1.0),
        }
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            kwargs["stop_token_ids"] = [eos] if isinstance(eos, int) else list(eos)
        stop_strings = getattr(config, "stop_strings", None)
        if stop_strings:
            kwargs["stop"] = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        kwargs["n"] = int(getattr(config, "num_return_sequences", None) or 1)
        kwargs.update(overrides)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_number(value: Any) -> bool:
    """A real number a float can hold: not a bool, NaN, infinity or an int past 1.8e308."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check(ok: bool, name: str, what: str, value: Any = None) -> None:
    if not ok:
        raise ValueError(f"{name} {what}")
