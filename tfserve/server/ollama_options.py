"""Ollama's request fields -> ours: `options` -> SamplingParams keyword arguments (an option that would change
the output and is not honoured is a 400, never dropped), `format` ("json" or a JSON schema) -> the
`response_format` the chat path constrains with, messages and tool calls -> OpenAI's shape (and calls back)."""

from __future__ import annotations

import json
from typing import Any

from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import field, sampling_kwargs

# option -> our sampling field
HONOURED = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty", "min_p": "min_p",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# how the model runs, not what it writes (num_ctx: the served context is the model's own)
IGNORED = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "low_vram", "f16_kv", "use_mmap",
                     "use_mlock", "vocab_only", "numa", "num_keep", "logits_all", "embedding_only"})
# would change the output: accepted only at the value that leaves it as ours is (Ollama's defaults)
NEUTRAL = {"typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,), "penalize_newline": (True, False)}


_SHARED = {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
FIELDS = {"chat": _SHARED | {"messages", "tools"},
          "generate": _SHARED | {"prompt", "suffix", "system", "template", "context", "raw", "images"}}


def check_fields(body: dict[str, Any], route: str) -> None:
    """400 for a field the route does not take: one a client sends for a reason is never dropped unseen."""
    unknown = sorted(set(body) - FIELDS[route])
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}: /api/{route} takes {', '.join(sorted(FIELDS[route]))}",
                          unknown[0])


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """`options` (and the top-level fields that shape sampling) -> SamplingParams keyword arguments."""
    options = field(body, "options", dict, {})
    for name, value in options.items():
        if value is None or name in HONOURED or name in IGNORED or name == "repeat_last_n":
            continue
        if name in NEUTRAL:
            if not any(value is v or (isinstance(value, bool) == isinstance(v, bool) and value == v)
                       for v in NEUTRAL[name]):  # a boolean is no number
                raise bad_request(f"options.{name} is not supported by this server (leave it out)", f"options.{name}")
        else:
            raise bad_request(f"options.{name} is not an option this server takes", f"options.{name}")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name):
            raise bad_request(f"{name} is not supported on this route (use /v1/chat/completions)", name)
    mapped = {ours: options.get(name) for name, ours in HONOURED.items() if name != "num_predict"}
    try:
        kwargs = sampling_kwargs(mapped)
    except ApiError as exc:  # name the option as the client sent it
        name = next((key for key, ours in HONOURED.items() if ours == exc.param), exc.param)
        exc.message = exc.message.replace(str(exc.param), f"options.{name}", 1)
        raise
    penalty = kwargs.get("repetition_penalty", 1.0)
    last_n = field(options, "repeat_last_n", int, param="options.repeat_last_n")
    if last_n not in (None, -1) and penalty != 1.0:  # the penalty here reads the whole context (-1)
        raise bad_request("options.repeat_last_n other than -1 is not supported with repeat_penalty: the penalty "
                          "covers the whole context", "options.repeat_last_n")
    num_predict = field(options, "num_predict", int, param="options.num_predict")
    if num_predict is not None and num_predict not in (-1, -2):  # -1, -2: until the context is full
        if num_predict < 1:
            raise bad_request("options.num_predict must be >= 1, or -1 (no limit)", "options.num_predict")
        kwargs["max_tokens"] = num_predict
    return kwargs


def requested_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`format`: "json" -> any JSON object, a schema -> that schema, "" or absent -> free text."""
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request('format must be "json" or a JSON schema object', "format")


def openai_message(message: Any, i: int) -> dict[str, Any]:
    """An Ollama message -> the OpenAI message `parse_messages` reads: `images` (base64) become image parts,
    `tool_calls` with object arguments get ids and JSON strings, a tool result's `tool_name` its name."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where)
    result = {key: message[key] for key in ("role", "content") if key in message}
    images = field(message, "images", list, [], param=f"{where}.images")
    if images:
        for j, image in enumerate(images):
            if not isinstance(image, str):
                raise bad_request(f"{where}.images[{j}] must be a base64 string", f"{where}.images[{j}]")
        result["content"] = [{"type": "text", "text": field(message, "content", str, "", param=f"{where}.content")},
                             *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
                               for image in images)]
    calls = field(message, "tool_calls", list, param=f"{where}.tool_calls")
    if calls:
        result["tool_calls"] = [openai_call(call, f"{where}.tool_calls[{j}]", j) for j, call in enumerate(calls)]
        result.setdefault("content", "")
    name = field(message, "tool_name", str, param=f"{where}.tool_name")
    if name is not None:
        result["name"] = name
    return result


def openai_call(call: Any, where: str, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise bad_request(f"{where} must be an object with a function", where)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{index}", "type": "function", "function": {"name": function.get("name"),
                                                                     "arguments": arguments}}


def ollama_call(call: Any) -> dict[str, Any]:
    """A parsed call in Ollama's shape: arguments as an object (a model's malformed JSON: its text as it is)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = call.arguments
    return {"function": {"index": call.index, "name": call.name, "arguments": arguments}}
