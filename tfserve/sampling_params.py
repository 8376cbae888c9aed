"""Per-request sampling parameters, validated where they are made (never inside the step loop)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from tfserve.errors import ParamError

GRAMMAR_KINDS = ("json_schema", "regex", "lark", "choice")
# temperatures below this sample greedily (as vLLM): dividing float32 logits by less overflows to inf
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4  # far past any useful value (OpenAI takes at most 2); 1e39 is infinite in float32
MAX_N = 128  # samples of one request, at most (as OpenAI)
MAX_INT64 = 2**63  # token ids and seeds become int64 tensors


@dataclass(frozen=True, slots=True)
class Range:
    """The values one sampling field takes: `low` to `high` (None: unbounded; `low` itself out where `above`),
    integers only where `integer`. `api_high`: the HTTP API's narrower top, OpenAI's where it has the field (the
    engine runs more: a temperature of 5 is no error to the Python API). `words`: how a message says the range."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    above: bool = False
    api_high: float | None = None
    words: str = ""

    def accepts(self, value: Any, api: bool = False) -> bool:
        """True for a number of the right kind in the range (the API's where `api`)."""
        if not (_is_int(value) if self.integer else _is_number(value)):
            return False
        high = self.api_high if api and self.api_high is not None else self.high
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        return high is None or value <= high

    def what(self, api: bool = False) -> str:
        """The range in words: "in [0, 2]", "an integer >= 1", "in (0, 2] (1 is off)"."""
        high = self.api_high if api and self.api_high is not None else self.high
        kind = "an integer " if self.integer else ""
        if self.low is None or high is None:
            bound = f"{'>' if self.above else '>='} {self.low:g}" if high is None else f"<= {high:g}"
        else:
            bound = f"in {'(' if self.above else '['}{self.low:g}, {high:g}]"
        return self.words or kind + bound

    def check(self, name: str, value: Any, api: bool = False) -> None:
        """ParamError naming `name` unless `value` is in the range."""
        if not self.accepts(value, api):
            raise ParamError(name, f"{{{name}}} must be {self.what(api)} (got {shorten(value)})")


# Every sampling field's range, the one table. SamplingParams checks it, the one place that does (the HTTP edge
# builds SamplingParams' fields and renders its errors under the client's names); the edge itself reads only
# what SamplingParams does not see: the API's narrower tops (`api_high`) and fields of other names.
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, integer=True),
    "temperature": Range(0, MAX_TEMPERATURE, api_high=2),  # past float32's range logits divide to 0, then NaN
    "top_p": Range(0, 1),  # 0 keeps the most likely token only (greedy)
    "top_k": Range(-1, integer=True, words=">= 0 (0 or -1 disables it)"),
    "min_p": Range(0, 1),
    # vLLM takes any repetition_penalty > 0; past 2 it only garbles text
    "repetition_penalty": Range(0, above=True, api_high=2, words=""),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    "n": Range(1, MAX_N, integer=True),
    "seed": Range(-MAX_INT64, MAX_INT64 - 1, integer=True, words="a 64-bit integer"),  # sample i of n: seed + i
    "logprobs": Range(0, 20, integer=True),
    "top_logprobs": Range(0, 20, integer=True),
    "prompt_logprobs": Range(0, 20, integer=True),
    "min_tokens": Range(0, integer=True),
    "logit_bias": Range(-100, 100),  # each token's bias
    "token_id": Range(0, MAX_INT64 - 1, integer=True, words="a token id (an integer >= 0)"),
    "transcription_temperature": Range(0, 1),  # Whisper's first decode (OpenAI's audio form: 0 to 1)
}


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on a request's output, enforced token by token (`tfserve.engine.structured`): a JSON schema,
    a regular expression, a Lark grammar (llguidance's dialect, which may embed `%json {...}`) or a choice among
    strings. Hashable, so compiled grammars are cached by it."""

    kind: str
    source: str  # the schema as JSON text, the regex, the grammar, or the choices as a JSON array
    # a json_schema's schema as the request gave it, so no one parses `source` back (not part of its identity)
    schema: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check(self.kind in GRAMMAR_KINDS, "grammar", f"kind must be one of {', '.join(GRAMMAR_KINDS)}")
        _check(isinstance(self.source, str) and bool(self.source), "grammar", "source must be a non-empty string")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Output that validates against `schema` (a dict or its JSON text)."""
        # keys keep their order: properties are written in the order the schema lists them
        if isinstance(schema, str):
            return cls("json_schema", schema)
        return cls("json_schema", json.dumps(schema), schema)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    def parsed_schema(self) -> Any:
        """A json_schema grammar's schema as an object (the one it was made from, else its text parsed)."""
        return self.schema if self.schema is not None else json.loads(self.source)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        return cls("lark", grammar)

    @classmethod
    def choice(cls, choices: list[str]) -> Grammar:
        """Exactly one of `choices`."""
        _check(isinstance(choices, list) and bool(choices) and all(isinstance(c, str) and c for c in choices),
               "choice", "must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature=0` (or below MIN_TEMPERATURE) is greedy; `seed`
    makes a request repeatable whatever else shares its batch (with int8 or GGUF block weights, a preempted and
    recomputed request may part from its first run: docs/engine.md, "CPU speed notes")."""

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
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob (and the top k); None = off
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    grammar: Grammar | None = None  # constrained decoding: the output follows it token by token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are held off until this many tokens are out

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # None means none; a falsy value of another type (0, False) is as wrong as a truthy one
        _check(isinstance([] if self.stop is None else self.stop, (list, tuple)), "stop",
               "must be a string or a list of strings")
        _check(isinstance([] if self.stop_token_ids is None else self.stop_token_ids, (list, tuple)),
               "stop_token_ids", "must be a list of token ids")
        _check(isinstance(self.logit_bias or {}, dict), "logit_bias", "must map token ids to numbers")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        for name in _FLOAT_FIELDS:  # floats from here on: an int past int64 would overflow the sampler's tensors
            value = getattr(self, name)
            _check(_is_number(value), name, "must be a finite number")
            RANGES[name].check(name, value)  # before the float: the error shows the value as it was sent
            setattr(self, name, float(value))
        for name in ("max_tokens", "top_k", "n"):
            RANGES[name].check(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, "must be True or False")
        for name in ("seed", "logprobs", "prompt_logprobs"):  # None: off
            if getattr(self, name) is not None:
                RANGES[name].check(name, getattr(self, name))
        # the samples of n > 1 take seed, seed + 1, ...: each must be a 64-bit integer
        _check(self.seed is None or self.seed <= MAX_INT64 - self.n, "seed",
               f"must be a 64-bit integer (at most 2**63 - {self.n} with n={self.n})")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.grammar is None or isinstance(self.grammar, Grammar), "grammar", "must be a tfserve Grammar")
        _check(all(_is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100
                   for t, b in self.logit_bias.items()), "logit_bias",
               "must map token ids (integers >= 0) to numbers in [-100, 100]")
        RANGES["min_tokens"].check("min_tokens", self.min_tokens)
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be an integer in [0, {max_tokens}]")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (top_p 0 keeps the most likely token only, as on OpenAI)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1 or self.top_p == 0

    @property
    def shapes_logits(self) -> bool:
        """True when the sampler changes this request's logits beyond temperature, truncation and a grammar
        (penalties, biases, a minimum length): its greedy token is not the model's plain argmax, so speculative
        decoding cannot check proposals against it."""
        return self.needs_penalties or bool(self.logit_bias) or self.min_tokens > 0

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

    def sequence(self, index: int) -> SamplingParams:
        """Sequence `index` of the `n` these params ask for: n=1 and seed + index, copied without checking again
        (the checks made on these params cover it: the seed's range holds seed + n - 1)."""
        if not 0 <= index < self.n:
            raise ValueError(f"sequence {index} of n={self.n}")
        child = copy.copy(self)
        child.n = 1
        child.seed = None if self.seed is None else self.seed + index
        return child


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_number(value: Any) -> bool:
    """A real number a float can hold: not a bool, NaN, infinity or an int past 1.8e308."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_int(value: Any) -> bool:
    """An integer, not a bool (True is an int to Python, and would be taken as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def shorten(value: Any, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters for an error message (a client may send 4,000 digits); JSON's
    words for null and the booleans."""
    if value is None or isinstance(value, bool):
        text = "null" if value is None else str(value).lower()
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check(ok: bool, name: str, what: str) -> None:
    """ParamError naming `name` unless `ok`; `what` may name other fields as `{field}`."""
    if not ok:
        raise ParamError(name, f"{{{name}}} {what}")
