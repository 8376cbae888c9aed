"""What reading a request shares: a body field checked against its JSON type (`field`, for the parts of bodies the
typed requests in `requests/` hand on as sent: messages, tools, input items), OpenAI's rules for names, metadata
and JSON schemas, the model a request names, and SamplingParams through the engine. Every mistake is a 400
naming its field (`param`).

OpenAI semantics: a field sent as `null` means "use the default"; numbers are never booleans.
"""

from __future__ import annotations

import re

from typing import Any

from aiohttp import web

from tfserve.sampling_params import SamplingParams, shorten
from tfserve.server.body import read_json  # noqa: F401  (re-exported: every handler reads its body here)
from tfserve.server.errors import ApiError, bad_request, from_value_error

_MISSING = object()
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}


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
        raise bad_request(f"{param or name} must be {wanted}, not {json_type(value)}", param or name)
    return value


# what `include` may ask for on the Responses API
INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
              "web_search_call.action.sources", "web_search_call.results")


def one_of(value: Any, choices: tuple[str, ...], param: str) -> Any:
    """`value` when it is one of `choices` (or absent), else a 400 naming them."""
    if value is not None and value not in choices:
        raise bad_request(f"{param} must be one of {', '.join(choices)} (got {value!r})", param)
    return value


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
            raise bad_request(f"metadata.{shorten(key)} must be a string, not {json_type(value)}", f"metadata.{key}")
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


def json_type(value: Any) -> str:
    """The JSON type of `value`, in words ("an integer", "an object")."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def make_params(kwargs: dict[str, Any], num_prompt_tokens: int, engine: Any,
                names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams through `engine.sampling_params`, the one place that fills the model's generation_config
    defaults and an absent max_tokens (what is left of the context and of the KV cache). Its errors are 400s
    naming the fields as `names` says the client sent them (a prompt that leaves no room: `names["prompt"]`)."""
    try:
        return engine.sampling_params(num_prompt_tokens, **kwargs)
    except ValueError as exc:
        raise from_value_error(exc, names=names) from None


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


async def use_model(request: web.Request, model: dict[str, Any] | str | None, state: Any) -> str:
    """The served name of the model a request names (a typed request's `model`, or a body's), leased until its
    response is done (loaded first when it is another model this server can load); 404 `model_not_found` for a
    model it cannot serve."""
    name = field(model, "model", str) if isinstance(model, dict) else model
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
