"""`tool_choice` "required" or a named function, enforced: a grammar over the model's own tool-call format
(`tool_formats.ToolCallFormat`) whose calls name only the allowed tools, each with arguments that validate
against that tool's `parameters` schema. Even a 135M model then always answers with a valid call."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tfserve.engine.structured import JSON_OPTIONS
from tfserve.protocol.tool_formats import ToolCallFormat
from tfserve.sampling_params import Grammar
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import field, one_of
from tfserve.server.tools.response_format import compile_grammar

_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# the 400 for a tool_choice of no shape this server takes
_SHAPES = ('{where} must be none, auto, required, a function\'s object ({{"type": "function", ...}}), an MCP '
           'server\'s ({{"type": "mcp", ...}}) or {{"type": "allowed_tools", ...}}')


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's `tool_choice`, parsed once (`parse`): whether a reply may call (mode "none", "auto"), must call
    ("required"), which functions it may call (`allowed`: OpenAI's allowed_tools entries with their fields; None:
    every tool), the one it must call (`function`), or the MCP server whose tools it must call (`mcp`). Chat's
    nested shapes (`{"function": {"name"}}`) and the Responses API's flat ones both."""

    mode: str = "auto"
    function: str | None = None
    function_param: str = "tool_choice.name"  # the field naming `function`, for a 400
    allowed: tuple[tuple[str, dict[str, Any]], ...] | None = None
    mcp: dict[str, Any] | None = None  # {"type": "mcp", "server_label", "name"?}, which mcp_tools reads
    sent: Any = None  # as the client sent it

    @classmethod
    def parse(cls, value: Any, where: str = "tool_choice") -> ToolChoice:
        """`value` checked for its type and shape whether or not the request has tools (so a wrong one gets the
        same 400 either way; the rule that a call needs tools comes after). A ToolChoice is taken as it is."""
        if isinstance(value, ToolChoice):
            return value
        value = field({where: value}, where, (str, dict))
        if value is None or value in ("auto", "none", "required"):
            return cls(mode=value or "auto", sent=value)
        if not isinstance(value, dict) or value.get("type") not in ("function", "mcp", "allowed_tools"):
            raise bad_request(_SHAPES.format(where=where), where)
        if value["type"] == "mcp":
            return cls(mode="required", mcp=value, sent=value)
        if value["type"] == "allowed_tools":
            mode, entries = allowed_tools(value, where)
            return cls(mode=mode, allowed=tuple(entries), sent=value)
        name, param = _function_name(value, where)
        return cls(mode="required", function=name, function_param=param, sent=value)

    @property
    def asks_for_call(self) -> bool:
        """True when the choice is anything but none or auto (absent included): it only makes sense with tools."""
        return self.sent not in (None, "auto", "none")

    def after_first_turn(self) -> ToolChoice:
        """The choice of a tool loop's later turns: "auto" (a forced call is made once), within the allowed tools."""
        return ToolChoice("auto", allowed=self.allowed, sent=self.sent if self.allowed is not None else "auto")


def tool_choice_of(body: dict[str, Any]) -> ToolChoice:
    """A body's `tool_choice`, parsed (`ToolChoice.parse`)."""
    return ToolChoice.parse(body.get("tool_choice"))


def _function_name(choice: dict[str, Any], where: str) -> tuple[str, str]:
    """The function `choice` (a tool_choice, or an allowed_tools entry, at `where`) names, and its field: chat's
    nested `{"function": {"name": ...}}` or the Responses API's flat `{"name": ...}`; 400 when there is none."""
    named = choice.get("function", choice)
    if not isinstance(named, dict):
        raise bad_request(f'{where}.function must be an object: {{"name": ...}}', f"{where}.function")
    param = f"{where}.function.name" if "function" in choice else f"{where}.name"
    return field(named, "name", str, required=True, param=param), param


def allowed_tools(tool_choice: dict[str, Any], where: str = "tool_choice") -> tuple[str, list[tuple[str, dict]]]:
    """OpenAI's `{"type": "allowed_tools", ...}` choice, checked: its mode ("auto" or "required") and its tools,
    each with its field. Chat nests them (`{"allowed_tools": {"mode", "tools": [{"type": "function", "function":
    {"name"}}]}}`); the Responses API does not (`{"mode", "tools": [{"type": "function", "name"}, {"type": "mcp",
    "server_label", "name"?}]}`)."""
    inner, base = tool_choice, where
    if "allowed_tools" in tool_choice:
        base = f"{where}.allowed_tools"
        inner = field(tool_choice, "allowed_tools", dict, required=True, param=base)
    mode = one_of(field(inner, "mode", str, required=True, param=f"{base}.mode"), ("auto", "required"),
                  f"{base}.mode")
    entries = field(inner, "tools", list, required=True, param=f"{base}.tools")
    if not entries:
        raise bad_request(f"{base}.tools must list at least one tool", f"{base}.tools")
    checked = []
    for i, entry in enumerate(entries):
        at = f"{base}.tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") not in ("function", "mcp"):
            raise bad_request(f'{at} must be {{"type": "function", "name": ...}} or {{"type": "mcp", ...}}', at)
        if entry["type"] == "function":
            _function_name(entry, at)
        checked.append((at, entry))
    return mode, checked


def callable_tools(tools: list[dict[str, Any]], tool_choice: ToolChoice | str | dict | None, mcp_names: Any = None
                   ) -> list[dict[str, Any]]:
    """The function definitions a reply may call: none under "none"; the listed ones under an `allowed_tools`
    choice (the others stay in the prompt, as on OpenAI, but a call of them cannot be sampled); else all.
    `mcp_names(entry)`: the tool names an allowed `mcp` entry stands for (the Responses API's MCP servers)."""
    choice = ToolChoice.parse(tool_choice)
    if choice.mode == "none":
        return []
    # chat's tools nest the function; the Responses API's are flat (where a stray "function" key means nothing)
    functions = [tool["function"] if isinstance(tool.get("function"), dict) else tool for tool in tools]
    if choice.allowed is None:
        return functions
    names: set[str] = set()
    for at, entry in choice.allowed:
        if entry["type"] == "mcp":
            if mcp_names is None:
                raise bad_request(f"{at} names an MCP server, but the request has no mcp tools", at)
            names.update(mcp_names(entry))
            continue
        name, param = _function_name(entry, at)
        names.add(_named(functions, name, at, param)[0]["name"])
    return [f for f in functions if f.get("name") in names]


def _named(functions: list[dict[str, Any]], name: str, where: str, param: str) -> list[dict[str, Any]]:
    """The function called `name` (named at `where`, field `param`) from `functions`; 400 when there is none."""
    chosen = [f for f in functions if f.get("name") == name]
    if not chosen:
        known = ", ".join(repr(f.get("name")) for f in functions) or "none"
        raise bad_request(f"{where} names the function {name!r}, which is not in tools (tools: {known})", param)
    return chosen


def after_first_turn(tool_choice: ToolChoice | str | dict | None) -> ToolChoice:
    """The choice of a tool loop's later turns (`ToolChoice.after_first_turn`)."""
    return ToolChoice.parse(tool_choice).after_first_turn()


def forced_tools(tools: list[dict[str, Any]], tool_choice: ToolChoice | str | dict | None,
                 where: str = "tool_choice", mcp_names: Any = None) -> list[dict[str, Any]] | None:
    """The function definitions a reply must call one of: all for "required", the named one for
    `{"type": "function", "function": {"name": ...}}` (or the Responses API's `{"type": "function", "name": ...}`),
    the listed ones for an `allowed_tools` choice of mode "required", None when the model may answer freely
    ("auto", "none", absent, `allowed_tools` of mode "auto"). 400 for a name not in `tools`."""
    choice = ToolChoice.parse(tool_choice, where)
    if choice.mode != "required":
        return None
    if choice.mcp is not None:  # an MCP server's choice, on a request without mcp tools
        raise bad_request(_SHAPES.format(where=where), where)
    functions = callable_tools(tools, choice, mcp_names)
    if choice.function is None:
        return functions
    return _named(functions, choice.function, where, choice.function_param)


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
    schema = json.dumps({**answer.parsed_schema(), "x-guidance": JSON_OPTIONS})
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
                           body_tools: list | None = None, parameters_fields: dict[str, str] | None = None) -> None:
    """Into a reply's sampling `kwargs`: the grammar `constraint` (from `reply_constraint`), compiled; no stop
    strings for a reply of forced calls only (stop strings do not cut tool calls, as on OpenAI); special tokens
    kept where the tool format's calls are made of them (e.g. Mistral's [TOOL_CALLS]). `body_tools`: the
    request's `tools` as sent (`tools` when absent), for naming a tool whose parameters do not compile; or
    `parameters_fields`, function name -> its parameters' field (the legacy `functions`)."""
    if forced:
        kwargs.pop("stop", None)
    if constraint is not None:
        try:
            await compile_grammar(engine, *constraint)
        except ApiError as error:
            if not tools:
                raise
            fields = parameters_fields or _parameters_fields(body_tools or tools)
            raise await _tools_error(engine, forced or forced_tools(tools, "required"), fields, error) from None
        kwargs["grammar"] = constraint[0]
    if tools and needs_special_tokens(tool_format, tokenizer):
        kwargs["skip_special_tokens"] = False


async def _tools_error(engine: Any, functions: list[dict[str, Any]], fields: dict[str, str],
                      error: ApiError) -> ApiError:
    """A grammar over calls of `functions` that does not compile, as the client can fix it: the first function
    whose parameters do not compile alone, named where the body holds them (`fields`: name -> field); else
    `error` without the position in, and the listing of, the grammar written here (its first line). Each tool is
    compiled again here, on this error path only: a grammar that compiles costs nothing more."""
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
