"""Ollama's messages and tool calls -> OpenAI's shape (and calls back). Its bodies and `options` are typed in
`requests/ollama.py`."""

from __future__ import annotations

import json
from typing import Any

from tfserve.server.errors import bad_request
from tfserve.server.protocol import field


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
