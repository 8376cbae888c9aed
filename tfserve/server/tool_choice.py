"""`tool_choice` "required" or a named function, enforced: a grammar over the model's own tool-call format
(`tool_calls.ToolCallFormat`) whose calls name only the allowed tools, each with arguments that validate
against that tool's `parameters` schema. Even a 135M model then always answers with a valid call."""

from __future__ import annotations

import json
import re
from typing import Any

from tfserve.engine.structured import JSON_OPTIONS
from tfserve.sampling_params import Grammar
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import field
from tfserve.server.response_format import compile_grammar
from tfserve.engine.tool_calls import ToolCallFormat

_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# the 400 for a tool_choice of no shape this server takes
_SHAPES = '{where} must be none, auto, required or {{"type": "function", "function": {{"name": ...}}}}'


def tool_choice_of(body: dict[str, Any]) -> str | dict | None:
    """`tool_choice`, its type and shape checked whether or not the request has tools (so a wrong one gets the
    same 400 either way; the rule that a call needs tools comes after)."""
    tool_choice = field(body, "tool_choice", (str, dict))
    _check_shape(tool_choice, "tool_choice")
    return tool_choice


def _check_shape(tool_choice: str | dict | None, where: str) -> None:
    """400 unless `tool_choice` is absent, none, auto, required, a function's object (chat's nested
    `{"type": "function", "function": {"name": ...}}` or the Responses API's flat one) or an MCP server's
    (`{"type": "mcp", ...}`, which mcp_tools checks)."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return
    if not isinstance(tool_choice, dict) or tool_choice.get("type") not in ("function", "mcp"):
        raise bad_request(_SHAPES.format(where=where), where)
    if tool_choice["type"] == "mcp":
        return
    named = tool_choice.get("function", tool_choice)
    if not isinstance(named, dict):
        raise bad_request(f'{where}.function must be an object: {{"name": ...}}', f"{where}.function")
    field(named, "name", str, required=True,
          param=f"{where}.function.name" if "function" in tool_choice else f"{where}.name")


def forced_tools(tools: list[dict[str, Any]], tool_choice: str | dict | None, where: str = "tool_choice"
                 ) -> list[dict[str, Any]] | None:
    """The function definitions a reply must call one of: all for "required", the named one for
    `{"type": "function", "function": {"name": ...}}` (or the Responses API's `{"type": "function", "name": ...}`),
    None when the model may answer freely ("auto", "none", absent). 400 for a name not in `tools`."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    # chat's tools nest the function; the Responses API's are flat (where a stray "function" key means nothing)
    functions = [tool["function"] if isinstance(tool.get("function"), dict) else tool for tool in tools]
    if tool_choice == "required":
        return functions
    _check_shape(tool_choice, where)
    if tool_choice.get("type") != "function":  # an MCP server's choice, on a request without mcp tools
        raise bad_request(_SHAPES.format(where=where), where)
    name = tool_choice.get("function", tool_choice)["name"]
    chosen = [f for f in functions if f.get("name") == name]
    if not chosen:
        known = ", ".join(repr(f.get("name")) for f in functions) or "none"
        raise bad_request(f"{where} names the function {name!r}, which is not in tools (tools: {known})",
                          f"{where}.function.name" if "function" in tool_choice else f"{where}.name")
    return chosen


def tool_call_grammar(fmt: ToolCallFormat, functions: list[dict[str, Any]], parallel: bool, tokenizer: Any) -> Grammar:
    """A Lark grammar (llguidance's, with embedded JSON schemas) for one call, or one or more when `parallel`,
    written as `fmt` writes them."""
    return Grammar.lark("\n".join(_call_rules(fmt, functions, parallel, tokenizer, "start")) + "\n")


def answer_or_calls(fmt: ToolCallFormat, functions: list[dict[str, Any]], parallel: bool, tokenizer: Any,
                    answer: Grammar) -> Grammar | None:
    """A reply that is either `answer` (a response format's JSON schema: the final answer) or calls of `functions`,
    as OpenAI takes tools and a response format together. None where the two cannot be told apart from the
    reply's start (Llama's calls are bare JSON too) or `answer` is not a JSON schema: `answer` alone then."""
    if answer.kind != "json_schema" or fmt.bare_json_start:
        return None
    schema = json.dumps({**json.loads(answer.source), "x-guidance": JSON_OPTIONS})
    rules = _call_rules(fmt, functions, parallel, tokenizer, "calls")
    return Grammar.lark("\n".join(["start: answer | calls", f"answer: %json {schema}"] + rules) + "\n")


def text_or_calls(fmt: ToolCallFormat, functions: list[dict[str, Any]], parallel: bool, tokenizer: Any) -> Grammar:
    """`tool_choice` "auto": free text, but once the format's marker is written (or, for Llama's bare JSON, once
    the reply opens with `{`), valid calls of `functions` to the end, as llama.cpp's lazy grammars do. The text
    holds no marker that does not open calls; a special-token marker cannot appear in text at all."""
    marker = _literal(tokenizer, fmt.start)
    special = marker.startswith("<[")
    rules = _call_rules(fmt, functions, parallel, tokenizer, "calls", opened=True)
    if fmt.bare_json_start:  # Llama 3.x: a reply that opens with `{` is calls (`<|python_tag|>` too, when special)
        rules += ["start: FREE | WS? calls" + (f" | FREE {marker} WS? calls" if special else ""),
                  r"FREE: /\s*([^{\s](.|\n)*)?/", r"WS: /\s+/"]
    elif special:  # the marker is a token of its own: text until it, or text alone
        rules += [f"start: ANY ({marker} opened)?", r"ANY: /(.|\n)*/"]
    else:  # text that ends with the marker (llguidance's suffix: kept in the text), or text without it
        escaped = "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in fmt.start)
        rules += ["start: FREE | text opened", rf"FREE: /(.|\n)*/ & ~/(.|\n)*{escaped}(.|\n)*/",
                  f"text[suffix={marker}]: /(.|\\n)*/"]
    return Grammar.lark("\n".join(rules) + "\n")


def reply_constraint(constraint: tuple[Grammar, str] | None, fmt: ToolCallFormat, offered: list[dict[str, Any]],
                     forced: list[dict[str, Any]] | None, parallel: bool, tokenizer: Any) -> tuple[Grammar, str] | None:
    """What a reply offered the functions `offered` must follow, as (grammar, field) or None: calls of the
    `forced` ones (the response format, `constraint`, is for the answer that comes after the tools); else the
    format widened to let the reply call instead, where `answer_or_calls` can; else the format as it is; with no
    format, text or valid calls (`text_or_calls`)."""
    if forced:
        return tool_call_grammar(fmt, forced, parallel, tokenizer), "tools"
    if constraint is not None and offered:
        both = answer_or_calls(fmt, offered, parallel, tokenizer, constraint[0])
        if both is not None:
            return both, constraint[1]
    if constraint is None and offered:
        return text_or_calls(fmt, offered, parallel, tokenizer), "tools"
    return constraint


def _call_rules(fmt: ToolCallFormat, functions: list[dict[str, Any]], parallel: bool, tokenizer: Any,
                name: str, opened: bool = False) -> list[str]:
    """The Lark rules of one call, or one or more when `parallel`, as `fmt` writes them; rule `name` is the whole,
    and, with `opened`, rule "opened" is the whole after the format's marker (where text ended with it)."""
    # key order kept (name first, so arguments can stream); JSON laid out as in response formats
    call_schema = json.dumps({**_calls_schema(functions, fmt.arguments_key), "x-guidance": JSON_OPTIONS})
    call = f"%json {call_schema}"
    marker = _literal(tokenizer, fmt.start)
    if fmt.name == "hermes":
        body = f"\"\\n\" {call} \"\\n\" {_literal(tokenizer, fmt.end)}"
        rules = [f'{name}: call ("\\n" call)*' if parallel else f"{name}: call", f"call: {marker} body",
                 f"body: {body}"]
        return rules + (['opened: body ("\\n" call)*' if parallel else "opened: body"] if opened else [])
    if fmt.list_of_calls:  # Mistral: [TOOL_CALLS][{...}, {...}]
        more = '(", " call)*' if parallel else ""
        return [f"{name}: {marker} opened", f'opened: "[" call {more} "]"', f"call: {call}"]
    return [f'{name}: call ("; " call)*' if parallel else f"{name}: call", f"call: {call}"]  # Llama 3.x: {...}; {...}


def _calls_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """One call of any of `functions`: {"name": its name, arguments_key: its parameters}. Each parameters schema
    sits in the root's `$defs` (`f0`, `f1`, ...), its own references rewritten to point there, so the `$defs`
    and `$ref`s a pydantic model or zod schema brings (`#/$defs/Item`) still resolve."""
    options, defs = [], {}
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or _EMPTY_PARAMETERS
        if isinstance(parameters.get("properties"), dict) and "additionalProperties" not in parameters:
            # only the declared parameters (as OpenAI's strict tools): an open object lets a model invent keys
            parameters = {**parameters, "additionalProperties": False}
        defs[f"f{i}"] = _rebase_refs(parameters, f"#/$defs/f{i}")
        options.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, arguments_key: {"$ref": f"#/$defs/f{i}"}},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    return {**(options[0] if len(options) == 1 else {"anyOf": options}), "$defs": defs}


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#", "#/...") made relative to `base` instead of its own root."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        else:
            out[key] = _rebase_refs(value, base)
    return out


def _literal(tokenizer: Any, text: str) -> str:
    """A Lark literal for `text`: its special token by id when the tokenizer has one (a grammar's strings
    never match special tokens), else the quoted string."""
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token.content == text and token.special:
            return f"<[{token_id}]>"
    return json.dumps(text)


def needs_special_tokens(fmt: ToolCallFormat, tokenizer: Any) -> bool:
    """True when the format's marker is a special token: the text must keep it for the parser to see calls."""
    return _literal(tokenizer, fmt.start).startswith("<[")


async def apply_constraint(engine: Any, kwargs: dict[str, Any], constraint: tuple | None, forced: list | None,
                           tools: list | None, tool_format: ToolCallFormat | None, tokenizer: Any,
                           body_tools: list | None = None) -> None:
    """Into a reply's sampling `kwargs`: the grammar `constraint` (from `reply_constraint`), compiled; no stop
    strings for a reply of forced calls only (stop strings do not cut tool calls, as on OpenAI); special tokens
    kept where the tool format's calls are made of them (e.g. Mistral's [TOOL_CALLS]). `body_tools`: the
    request's `tools` as sent (`tools` when absent), for naming a tool whose parameters do not compile."""
    if forced:
        kwargs.pop("stop", None)
    if constraint is not None:
        try:
            await compile_grammar(engine, *constraint)
        except ApiError as error:
            if not tools:
                raise
            raise await _tools_error(engine, forced or forced_tools(tools, "required"), body_tools or tools,
                                     error) from None
        kwargs["grammar"] = constraint[0]
    if tools and needs_special_tokens(tool_format, tokenizer):
        kwargs["skip_special_tokens"] = False


async def _tools_error(engine: Any, functions: list[dict[str, Any]], body_tools: list, error: ApiError) -> ApiError:
    """A grammar over calls of `functions` that does not compile, as the client can fix it: the first function
    whose parameters do not compile alone, named where the body holds them; else `error` without the position
    in, and the listing of, the grammar written here (its first line)."""
    fields = _parameters_fields(body_tools)
    for function in functions:
        try:
            await compile_grammar(engine, Grammar.json_schema(function.get("parameters") or _EMPTY_PARAMETERS),
                                  fields.get(function.get("name"), "tools"))
        except ApiError as culprit:
            return culprit
    message = re.sub(r"\s+\d+ \| .*", "", error.message, flags=re.S)  # llguidance's listing: " 1 | start: ..."
    message = re.sub(r"^(\S+: )at \d+\(\d+\): ", r"\1", message)  # its position: "at 3(7): "
    return ApiError(error.status, message, param=error.param, code=error.code)


def _parameters_fields(body_tools: list) -> dict[str, str]:
    """Function name -> the body field of its parameters (chat's `tools[i].function.parameters`, the Responses
    API's `tools[i].parameters`)."""
    fields = {}
    for i, tool in enumerate(body_tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            fields[tool["function"].get("name")] = f"tools[{i}].function.parameters"
        elif isinstance(tool, dict) and tool.get("type") == "function":
            fields[tool.get("name")] = f"tools[{i}].parameters"
    return fields
