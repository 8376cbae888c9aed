"""Request bodies -> validated Python values: every mistake is a 400 naming its field (`param`).

OpenAI semantics: a field sent as `null` means "use the default"; numbers are never booleans.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tfserve.sampling_params import SamplingParams
from tfserve.server.errors import ApiError, bad_request, from_value_error

_MISSING = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}

# body field -> SamplingParams field, for the fields every endpoint shares
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("top_k", "seed", "n")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
MAX_N = 128  # as OpenAI


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not one (413 comes from aiohttp's `client_max_size`)."""
    raw = await request.read()
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


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
    `make_params` fills in what is left of the context). Type errors are 400s here; ranges are checked by
    SamplingParams itself."""
    kwargs: dict[str, Any] = {}
    for name in _NUMBER_FIELDS:
        value = field(body, name, float)
        if value is not None:
            kwargs[name] = value
    for name in _INT_FIELDS:
        value = field(body, name, int)
        if value is not None:
            kwargs[name] = value
    for name in _BOOL_FIELDS:
        value = field(body, name, bool)
        if value is not None:
            kwargs[name] = value
    seed = kwargs.get("seed")
    if seed is not None and not -(2**63) <= seed < 2**63 - 128:  # torch seeds are int64; n adds up to 128
        raise bad_request("seed must be a 64-bit integer", "seed")
    if kwargs.get("n", 1) > MAX_N:
        raise bad_request(f"n must be <= {MAX_N} (got {kwargs['n']})", "n")
    max_tokens = default_max_tokens
    for name in max_tokens_fields:  # the first one present wins (max_completion_tokens over max_tokens)
        value = field(body, name, int)
        if value is not None:
            if value < 1:
                raise bad_request(f"{name} must be an integer >= 1 (got {value})", name)
            max_tokens = value
            break
    kwargs["max_tokens"] = max_tokens
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
        kwargs["stop_token_ids"] = stop_token_ids
    if field(body, "logit_bias", dict):
        raise bad_request("logit_bias is not supported", "logit_bias")
    return kwargs


def make_params(kwargs: dict[str, Any], num_prompt_tokens: int, engine: Any) -> SamplingParams:
    """Build SamplingParams; an absent max_tokens becomes what is left of the context (and of the KV cache)."""
    kwargs = dict(kwargs)
    if kwargs.get("top_k", 0) >= engine.vocab_size:  # keeps every token: the same as no top-k
        kwargs["top_k"] = 0
    if kwargs.get("max_tokens") is None:
        capacity = min(engine.max_model_len, engine.block_pool.num_blocks * engine.block_pool.block_size)
        kwargs["max_tokens"] = max(1, capacity - num_prompt_tokens)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc) from None


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    include_usage = field(options, "include_usage", bool, False, param="stream_options.include_usage")
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return stream, include_usage


def text_of(content: Any, param: str) -> str:
    """Message content (a string, or a list of text parts) -> one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of content parts", param)
    texts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = part.get("type")
        if kind not in ("text", "input_text", "output_text"):
            raise bad_request(f"{where}.type {kind!r} is not supported; this server takes text parts only",
                              f"{where}.type")
        texts.append(field(part, "text", str, required=True, param=f"{where}.text"))
    return "".join(texts)


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
