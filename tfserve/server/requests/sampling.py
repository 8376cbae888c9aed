"""The fields every generation endpoint shares (sampling, stop conditions, streaming, an output constraint) and
the OpenAI fields that change nothing here but are checked all the same."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, PrivateAttr, field_validator, model_validator

from tfserve.errors import ParamError
from tfserve.sampling_params import MAX_INT64, RANGES, Grammar, SamplingParams
from tfserve.server.errors import bad_request
from tfserve.server.protocol import check_metadata, json_type, one_of, shorten
from tfserve.server.requests.base import RequestModel, SentAs
from tfserve.server.tools.response_format import requested_grammar

# the values OpenAI takes for some fields that change nothing here (another is a 400 there, so here too)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


class StreamOptions(RequestModel):
    """OpenAI's `stream_options`, with vLLM's `continuous_usage_stats` (every chunk carries the counts so far)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


def _braced(text: str) -> str:
    """`text` as it reads inside a ParamError's template (its braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


class SamplingFields(RequestModel):
    """The sampling fields every generation endpoint shares, and its stop conditions. `to_sampling_kwargs()` gives
    the engine's SamplingParams fields (`Engine.sampling_params` fills the model's defaults); `names` maps the
    engine's words to the fields this request sent (`max_tokens` -> `max_completion_tokens`) for its errors."""

    MAX_TOKENS_FIELDS: ClassVar[tuple[str, ...]] = ("max_tokens",)  # the first one present wins
    ENGINE_CHECKED: ClassVar[frozenset[str]] = frozenset({
        "max_tokens", "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "top_k", "seed", "n", "min_tokens", "logprobs", "prompt_logprobs"})
    PROMPT_FIELD: ClassVar[str] = "prompt"
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # None: what is left of the context

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    max_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None  # vLLM's; a fast tokenizer's decode has no such choice
    stop: Any = None
    stop_token_ids: list[Any] | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None
    min_tokens: int | None = None

    _logit_bias: dict[int, float] | None = PrivateAttr(None)  # token id -> bias, once checked

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, stop: Any) -> Any:
        if stop is None:
            return None
        if not isinstance(stop, (str, list)):
            raise ParamError("stop", f"{{stop}} must be a string or an array, not {json_type(stop)}")
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", "{stop} must be a non-empty string or a list of non-empty strings")
        if len(stop) > 16:
            raise ParamError("stop", "{stop} may hold at most 16 strings")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, ids: list[Any] | None) -> list[int] | None:
        if ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_INT64
                                       for t in ids):
            raise ParamError("stop_token_ids", "{stop_token_ids} must be an array of token ids (integers >= 0)")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, logit_bias: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's `{"token id": bias}` (JSON keys are strings): token ids, biases in [-100, 100]."""
        if len(logit_bias or ()) > 1024:
            raise ParamError("logit_bias", "{logit_bias} may hold at most 1024 tokens")
        for key, bias in (logit_bias or {}).items():
            where = f"logit_bias.{key}"
            # the key, in braces of its own: it is the client's text, not a field of ours
            if not (key.isascii() and key.isdigit()) or int(key) >= MAX_INT64:
                raise ParamError(where, "{logit_bias} keys must be token ids (got %s)" % _braced(shorten(key)))
            if not RANGES["logit_bias"].accepts(bias, api=True):
                raise ParamError(where, f"{{logit_bias}}.{_braced(key)} must be a number in [-100, 100] (got "
                                        f"{_braced(shorten(bias))})")
        return logit_bias

    @model_validator(mode="after")
    def _resolve_sampling(self) -> Any:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of other than n is not supported", "best_of")
        self._logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        self._check_sampling()
        return self

    def _check_sampling(self) -> None:
        """The fields SamplingParams takes, checked by SamplingParams itself (the one place that checks
        max_tokens), its errors named as this request sent them. An absent max_tokens is what is left of the
        context: the engine checks that one with the prompt (`Engine.sampling_params`)."""
        kwargs = self.to_sampling_kwargs()
        if kwargs["max_tokens"] is None:
            kwargs["max_tokens"] = max(1, kwargs.get("min_tokens", 1))
        try:
            SamplingParams(**kwargs)
        except ParamError as exc:
            raise SentAs(exc, self.names) from None

    @property
    def max_tokens_field(self) -> str:
        """The field that set max_tokens: the first of MAX_TOKENS_FIELDS sent, else the last (the default's)."""
        return next((name for name in self.MAX_TOKENS_FIELDS if getattr(self, name) is not None),
                    self.MAX_TOKENS_FIELDS[-1])

    @property
    def max_output_tokens_value(self) -> int | None:
        """max_tokens as this request set it (its alias resolved), or the endpoint's default."""
        value = getattr(self, self.max_tokens_field)
        return self.DEFAULT_MAX_TOKENS if value is None else value

    @property
    def names(self) -> dict[str, str]:
        """The engine's words -> the fields this request sent for them, so that an error names what the client
        sent (`max_completion_tokens`, `max_output_tokens`; `messages`, `input`)."""
        return {"max_tokens": self.max_tokens_field, "prompt": self.PROMPT_FIELD}

    def to_sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (None: the model's default; max_tokens None: what is left
        of the context), for `Engine.sampling_params`."""
        kwargs = {name: getattr(self, name) for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k",
            "seed", "n", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "stop_token_ids")}
        kwargs = {name: value for name, value in kwargs.items() if value is not None}
        kwargs["max_tokens"] = self.max_output_tokens_value
        if self.stop is not None:
            kwargs["stop"] = self.stop
        if self._logit_bias:
            kwargs["logit_bias"] = self._logit_bias
        if self.min_tokens:
            kwargs["min_tokens"] = self.min_tokens
        return kwargs


class SamplingRequest(SamplingFields):
    """A generation request of the chat and completions APIs: the sampling fields, streaming (OpenAI's
    `stream_options`), vLLM's `prompt_logprobs`, and an output constraint (`response_format`, vLLM's
    `structured_outputs` / `guided_*`) made into one Grammar here, once."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None  # vLLM's: not with stream
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    _constraint: tuple[Grammar, str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve_output(self) -> Any:
        """The checks that read more than one field, and the output constraint, made once."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        self._constraint = requested_grammar({
            "response_format": self.response_format, "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json, "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar})
        return self

    @property
    def constraint(self) -> tuple[Grammar, str] | None:
        """The output constraint and the field that set it (None: free text)."""
        return self._constraint

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats` (with include_usage): every chunk carries the counts so far."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)

    def to_sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().to_sampling_kwargs()
        if self.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = self.prompt_logprobs
        return kwargs


def _check_max_tool_calls(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise bad_request("max_tool_calls must be >= 0", "max_tool_calls")
    return value


# tfserve's, with mcp tools (chat and Responses): the calls the server runs for one request, at most
MaxToolCalls = Annotated[int | None, AfterValidator(_check_max_tool_calls)]


class CommonFields(RequestModel):
    """OpenAI request fields that change nothing here (or only what the response echoes), checked for their type
    and values all the same, so a wrong one is a 400 as on OpenAI rather than silently taken."""

    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        check_metadata(metadata or {})
        return metadata

    @field_validator("service_tier")
    @classmethod
    def _check_service_tier(cls, tier: str | None) -> str | None:
        return one_of(tier, SERVICE_TIERS, "service_tier")
