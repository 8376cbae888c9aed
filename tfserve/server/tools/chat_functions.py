"""OpenAI's legacy function calling, which `tools` replaced but older clients and frameworks still send:
`functions` and `function_call` in the request, `function_call` on an assistant message, `role: "function"`
results. The request is read as its `tools` form (one call at most, as the legacy API returns), and the reply
goes back in the legacy shape: `message.function_call`, `delta.function_call`, `finish_reason: "function_call"`.
"""

from __future__ import annotations

from typing import Any

from tfserve.server.errors import bad_request
from tfserve.server.protocol import field


def as_tools(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """`body` with `functions` / `function_call` also as `tools` / `tool_choice` (and no parallel calls), and
    whether it used them. 400 for both forms at once, or a `function_call` without `functions`. The typed request
    keeps `functions`, so its errors about them name what the client sent (`functions[0].name`)."""
    functions = field(body, "functions", list)
    function_call = field(body, "function_call", (str, dict))
    if functions is None:
        if function_call is not None:
            raise bad_request("function_call needs functions to call", "function_call")
        return body, False
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise bad_request("give tools (and tool_choice) or the legacy functions (and function_call), not both",
                          "functions")
    if not functions:
        raise bad_request("functions must hold at least one function", "functions")
    for i, function in enumerate(functions):
        if not isinstance(function, dict):
            raise bad_request(f"functions[{i}] must be an object", f"functions[{i}]")
    if function_call is None or function_call in ("auto", "none"):
        tool_choice: str | dict = function_call or "auto"
    elif isinstance(function_call, dict):
        name = field(function_call, "name", str, required=True, param="function_call.name")
        if not any(function.get("name") == name for function in functions):
            known = ", ".join(repr(function.get("name")) for function in functions)
            raise bad_request(f"function_call names the function {name!r}, which is not in functions ({known})",
                              "function_call.name")
        tool_choice = {"type": "function", "function": {"name": name}}
    else:
        raise bad_request(f'function_call must be none, auto or {{"name": ...}} (got {function_call!r})',
                          "function_call")
    tools = [{"type": "function", "function": function} for function in functions]
    return {**body, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": False}, True


def parameters_fields(functions: list[dict[str, Any]]) -> dict[str, str]:
    """Function name -> the field of its parameters in the legacy `functions`, for a grammar that does not
    compile (`tool_choice.apply_constraint`)."""
    return {function.get("name"): f"functions[{i}].parameters" for i, function in enumerate(functions)}


def call_of(message: dict[str, Any], index: int) -> dict[str, Any]:
    """Assistant message `index`'s legacy `function_call` as its one entry of `tool_calls` (the id its result
    names)."""
    call = field(message, "function_call", dict, param=f"messages[{index}].function_call")
    return {"id": call_id(index), "type": "function", "function": call}


def call_id(index: int) -> str:
    """The id the legacy call of message `index` goes by (legacy calls have none)."""
    return f"call_{index}"


def reply_message(message: dict[str, Any]) -> None:
    """A reply's message in the legacy shape, in place: its (one) call as `function_call`, no `tool_calls`."""
    calls = message.pop("tool_calls", None)
    if calls:
        message["function_call"] = calls[0]["function"]


def reply_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta in the legacy shape: a call's name, then its arguments, as `function_call`."""
    calls = delta.get("tool_calls")
    if not calls:
        return delta
    function = calls[0]["function"]
    return {"function_call": {"name": function["name"], "arguments": function["arguments"]} if "name" in function
            else {"arguments": function["arguments"]}}


def finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
