"""Request bodies -> validated Python values: every mistake is a 400 naming its field (`param`).

OpenAI semantics: a field sent as `null` means "use the default"; numbers are never booleans.
"""

from __future__ import annotations

import re

from typing import Any

from aiohttp import web

from tfserve.sampling_params import MAX_N, SamplingParams
from tfserve.server.body import read_json  # noqa: F401  (re-exported: every handler reads its body here)
from tfserve.server.errors import ApiError, bad_request, from_value_error

_MISSING = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}

# body field -> SamplingParams field, for the fields every endpoint shares
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "seed", "n")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
MAX_INT64 = 2**63  # token ids and seeds become int64 tensors
# what the API accepts: OpenAI's ranges, and ours for the fields OpenAI lacks (vLLM takes any
# repetition_penalty > 0; past 2 it only garbles text). SamplingParams checks again what the engine can run.
_RANGES = {
    "temperature": (lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),  # 0 keeps the most likely token only (greedy)
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (lambda v: 0 < v <= 2, "in (0, 2] (1 is off)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "top_k": (lambda v: v >= -1, ">= 0 (0 or -1 disables it)"),
    "seed": (lambda v: -MAX_INT64 <= v < MAX_INT64 - MAX_N, "a 64-bit integer"),  # sample i of n uses seed + i
    "n": (lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}]"),
}


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None, *,
          required: bool = False, param: str | None = None) -> Any:
    """`body[name]` checked against `kind`; `default` when absent or null; 400 when required and absent."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise bad_request(f"{param or name} is required", param or name)
        return default
    if not _is_a(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise bad_request(f"{param or name} must be {wanted}, not {_json_type(value)}", param or name)
    return value


# OpenAI request fields that change nothing here (or only what the response echoes), checked for their type all
# the same, so a wrong one is a 400 as on OpenAI rather than silently taken
_COMMON_FIELDS = {"user": str, "store": bool, "metadata": dict, "service_tier": str, "safety_identifier": str,
                  "prompt_cache_key": str, "parallel_tool_calls": bool}
CHAT_FIELDS = {**_COMMON_FIELDS, "modalities": list, "prediction": dict, "audio": dict, "web_search_options": dict,
               "verbosity": str, "reasoning_effort": str}
RESPONSES_FIELDS = {**_COMMON_FIELDS, "stream": bool, "reasoning": dict, "truncation": str, "include": list,
                    "top_logprobs": int, "background": bool}


# the values OpenAI takes for some of those fields (another is a 400 there, so here too)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_CHOICES = {"service_tier": ("auto", "default", "flex", "scale", "priority"), "verbosity": ("low", "medium", "high"),
            "reasoning_effort": _EFFORTS}
_REASONING_CHOICES = {"effort": _EFFORTS, "summary": ("auto", "concise", "detailed"),
                      "generate_summary": ("auto", "concise", "detailed")}
INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
              "web_search_call.action.sources", "web_search_call.results")


def one_of(value: Any, choices: tuple[str, ...], param: str) -> Any:
    """`value` when it is one of `choices` (or absent), else a 400 naming them."""
    if value is not None and value not in choices:
        raise bad_request(f"{param} must be one of {', '.join(choices)} (got {value!r})", param)
    return value


def check_fields(body: dict[str, Any], kinds: dict[str, type]) -> None:
    """400 for any of `kinds`' fields present with another JSON type or a value OpenAI does not take (metadata: an
    object of strings)."""
    for name, kind in kinds.items():
        value = field(body, name, kind)
        if name in _CHOICES:
            one_of(value, _CHOICES[name], name)
    for key, value in (body.get("reasoning") or {}).items() if kinds.get("reasoning") is dict else ():
        if key not in _REASONING_CHOICES:
            raise bad_request(f"reasoning.{key} is not a field of reasoning", f"reasoning.{key}")
        one_of(value, _REASONING_CHOICES[key], f"reasoning.{key}")
    check_metadata(body.get("metadata") or {})
    for i, modality in enumerate(body.get("modalities") or ()) if kinds.get("modalities") is list else ():
        one_of(modality if isinstance(modality, str) else repr(modality), ("text", "audio"), f"modalities[{i}]")


# OpenAI's rule for the names of functions and response formats
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_name(name: str, where: str) -> str:
    """400 unless `name` is 1 to 64 letters, digits, underscores or dashes (OpenAI's rule for a function's or a
    response format's name)."""
    if not _NAME.fullmatch(name):
        raise bad_request(f"{where} must be 1 to 64 letters, digits, underscores or dashes (got {shorten(name)})",
                          where)
    return name


MAX_METADATA = 16  # OpenAI's limits: 16 keys of at most 64 characters, values of at most 512


def check_metadata(metadata: dict[str, Any]) -> None:
    """400 for `metadata` past OpenAI's limits (16 keys of at most 64 characters, each a string of at most 512)."""
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata takes at most {MAX_METADATA} keys (got {len(metadata)})", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise bad_request(f"metadata.{shorten(key)} must be a string, not {_json_type(value)}", f"metadata.{key}")
        if len(key) > 64 or len(value) > 512:
            raise bad_request("metadata maps keys of at most 64 characters to strings of at most 512",
                              f"metadata.{key}")


def _is_a(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def sampling_kwargs(body: dict[str, Any], *, max_tokens_fields: tuple[str, ...] = ("max_tokens",),
                    default_max_tokens: int | None = None) -> dict[str, Any]:
    """The sampling fields of a body as SamplingParams keyword arguments (`max_tokens` may be None: then
    `make_params` fills in what is left of the context). Type and range errors are 400s here, before any
    response starts."""
    kwargs: dict[str, Any] = {}
    for names, kind in ((_NUMBER_FIELDS, float), (_INT_FIELDS, int), (_BOOL_FIELDS, bool)):
        for name in names:
            value = field(body, name, kind)
            if value is None:
                continue
            accepts, what = _RANGES.get(name, (None, ""))
            if accepts is not None and not accepts(value):
                raise bad_request(f"{name} must be {what} (got {shorten(value)})", name)
            kwargs[name] = value
    sent = [(name, field(body, name, int)) for name in max_tokens_fields]
    for name, value in sent:
        if value is not None and value < 1:
            raise bad_request(f"{name} must be an integer >= 1 (got {shorten(value)})", name)
    # the first one present wins (max_completion_tokens over max_tokens)
    kwargs["max_tokens"] = next((value for _, value in sent if value is not None), default_max_tokens)
    stop = field(body, "stop", (str, list))
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
        if len(stop) > 16:
            raise bad_request("stop may hold at most 16 strings", "stop")
        kwargs["stop"] = stop
    stop_token_ids = field(body, "stop_token_ids", list)
    if stop_token_ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_INT64 for t in stop_token_ids):
            raise bad_request("stop_token_ids must be an array of token ids (integers >= 0)", "stop_token_ids")
        kwargs["stop_token_ids"] = stop_token_ids
    logit_bias = field(body, "logit_bias", dict)
    if logit_bias:
        kwargs["logit_bias"] = _logit_bias(logit_bias)
    field(body, "spaces_between_special_tokens", bool)  # vLLM's; a fast tokenizer's decode has no such choice
    best_of = field(body, "best_of", int)
    if best_of is not None and best_of != (kwargs.get("n") or 1):
        raise bad_request("best_of other than n is not supported", "best_of")
    min_tokens = field(body, "min_tokens", int)
    if min_tokens:
        if min_tokens < 0:
            raise bad_request(f"min_tokens must be an integer >= 0 (got {shorten(min_tokens)})", "min_tokens")
        kwargs["min_tokens"] = min_tokens
    return kwargs


def _logit_bias(logit_bias: dict[str, Any]) -> dict[int, float]:
    """OpenAI's `{"token id": bias}` (JSON keys are strings) -> {token id: bias in [-100, 100]}."""
    if len(logit_bias) > 1024:
        raise bad_request("logit_bias may hold at most 1024 tokens", "logit_bias")
    result = {}
    for key, bias in logit_bias.items():
        where = f"logit_bias.{key}"
        if not (key.isascii() and key.isdigit()) or int(key) >= MAX_INT64:
            raise bad_request(f"logit_bias keys must be token ids (got {shorten(key)})", where)
        if not _is_a(bias, float) or not -100 <= bias <= 100:
            raise bad_request(f"{where} must be a number in [-100, 100] (got {shorten(bias)})", where)
        result[int(key)] = float(bias)
    return result


def param_names(body: dict[str, Any], max_tokens_fields: tuple[str, ...], prompt_field: str) -> dict[str, str]:
    """The engine's words -> the body fields this request used for them, so that an error names what the
    client sent (`max_completion_tokens`, `max_output_tokens`; `messages`, `input`)."""
    sent = next((name for name in max_tokens_fields if body.get(name) is not None), max_tokens_fields[-1])
    return {"max_tokens": sent, "prompt": prompt_field}


def make_params(kwargs: dict[str, Any], num_prompt_tokens: int, engine: Any,
                names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams through `engine.sampling_params`, the one place that fills the model's generation_config
    defaults and an absent max_tokens (what is left of the context and of the KV cache). Its errors are 400s
    naming the fields as `names` says the client sent them (a prompt that leaves no room: `names["prompt"]`)."""
    try:
        return engine.sampling_params(num_prompt_tokens, **kwargs)
    except ValueError as exc:
        raise from_value_error(exc, names=names) from None


def shorten(value: Any, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters for an error message (a client may send 4,000 digits); JSON's
    words for null and the booleans."""
    if value is None or isinstance(value, bool):
        text = "null" if value is None else str(value).lower()
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    include_usage = field(options, "include_usage", bool, False, param="stream_options.include_usage")
    continuous_usage(body)
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return stream, include_usage


def continuous_usage(body: dict[str, Any]) -> bool:
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk carries the counts so
    far, not only the last."""
    options = field(body, "stream_options", dict, {})
    continuous = field(options, "continuous_usage_stats", bool, False, param="stream_options.continuous_usage_stats")
    return continuous and bool(options.get("include_usage"))


def text_of(content: Any, param: str) -> str:
    """Message content (a string, or a list of text parts) -> one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of content parts", param)
    return "".join(part_text(part, f"{param}[{i}]") for i, part in enumerate(content))


def part_text(part: Any, where: str) -> str:
    """One text content part -> its text; any other part is a 400 naming its type."""
    if not isinstance(part, dict):
        raise bad_request(f'{where} must be a content part object, e.g. {{"type": "text", "text": ...}}', where)
    kind = field(part, "type", str, required=True, param=f"{where}.type")
    if kind == "refusal":  # an assistant's refusal sent back in the conversation: its words
        return field(part, "refusal", str, required=True, param=f"{where}.refusal")
    if kind not in ("text", "input_text", "output_text"):
        raise bad_request(f"{where}.type {kind!r} is not supported here; this server takes text parts (and image "
                          "parts in message content)", f"{where}.type")
    return field(part, "text", str, required=True, param=f"{where}.text")


# Names that clients send when they mean "whatever this server serves": huggingface_hub's InferenceClient
# sends "dummy" (older versions "tgi") when it is pointed at a base URL without a model.
PLACEHOLDER_MODELS = frozenset({"dummy", "tgi"})


async def use_model(request: web.Request, body: dict[str, Any], state: Any) -> str:
    """The served name of the model a request names, leased until its response is done (loaded first when it
    is another model this server can load); 404 `model_not_found` for a model it cannot serve."""
    name = field(body, "model", str)
    if name in PLACEHOLDER_MODELS:
        name = None
    return await state.models.acquire(request, name)


def too_many(message: str) -> ApiError:
    return ApiError(429, message, code="rate_limit_exceeded")


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, where: str) -> None:
    """400 naming the place for a JSON schema that cannot describe anything (a `type` that is no JSON type,
    `properties` or `items` that are not schemas, `required` that is not a list of names), checked whether or
    not a grammar is built from it."""
    if schema is None or isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object", where)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if any(not isinstance(k, str) or k not in _SCHEMA_TYPES for k in kinds):
        raise bad_request(f"{where}.type must be one of {', '.join(sorted(_SCHEMA_TYPES))} (got {kind!r})",
                          f"{where}.type")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise bad_request(f"{where}.properties must be an object of schemas", f"{where}.properties")
        for name, sub in properties.items():
            check_schema(sub, f"{where}.properties.{name}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise bad_request(f"{where}.required must be a list of property names", f"{where}.required")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            check_schema(schema[key], f"{where}.{key}")
    _check_bounds(schema, where)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise bad_request(f"{where}.{key} must be a list of schemas", f"{where}.{key}")
            for j, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}[{j}]")


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _check_bounds(schema: dict, where: str) -> None:
    """The keywords with a value the JSON Schema specification constrains: counts are non-negative integers,
    `multipleOf` a number above 0, bounds numbers, `pattern` a string, `enum` a list."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key in _COUNTS:
        value = schema.get(key)
        if value is not None and not (number(value) and value >= 0 and float(value).is_integer()):
            raise bad_request(f"{where}.{key} must be a non-negative integer (got {value!r})", f"{where}.{key}")
    value = schema.get("multipleOf")
    if value is not None and not (number(value) and value > 0):
        raise bad_request(f"{where}.multipleOf must be a number greater than 0 (got {value!r})", f"{where}.multipleOf")
    for key in _NUMBERS:
        value = schema.get(key)
        # draft 4 wrote exclusiveMinimum/Maximum as booleans beside minimum/maximum
        if value is not None and not number(value) and not (key.startswith("exclusive") and isinstance(value, bool)):
            raise bad_request(f"{where}.{key} must be a number (got {value!r})", f"{where}.{key}")
    if "pattern" in schema and not isinstance(schema["pattern"], str):
        raise bad_request(f"{where}.pattern must be a string (a regular expression)", f"{where}.pattern")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad_request(f"{where}.enum must be a list of values", f"{where}.enum")
