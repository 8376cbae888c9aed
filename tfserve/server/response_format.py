"""What a request asks its output to look like -> one `Grammar` for the engine, compiled before the response
starts (off the event loop and the step loop) so that a bad schema is a 400 naming its field.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), two extensions of ours in the same place
(`{"type": "regex", "regex": ...}`, `{"type": "grammar", "grammar": <Lark or GBNF>}`), and vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) with its older top-level
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, so vLLM clients work unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tfserve.engine.structured import GrammarError
from tfserve.sampling_params import Grammar
from tfserve.server.body import loads
from tfserve.server.errors import bad_request
from tfserve.server.protocol import check_name, check_schema, field

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {f"guided_{key}": key for key in ("json", "regex", "choice", "grammar")}


def requested_grammar(body: dict[str, Any], field_name: str = "response_format") -> tuple[Grammar, str] | None:
    """The request's output constraint and the field that set it, or None for free text. At most one."""
    found = []
    response_format = field(body, field_name, dict)
    if response_format is not None:
        grammar = _from_response_format(response_format, field_name)
        if grammar is not None:
            found.append((grammar, field_name))
    structured = field(body, "structured_outputs", dict)
    for key in structured or ():
        if key not in _VLLM_KEYS:
            raise bad_request(f"structured_outputs.{key} is not supported here (send one of {', '.join(_VLLM_KEYS)})",
                              f"structured_outputs.{key}")
    if structured is not None and all(structured.get(key) in (None, False) for key in _VLLM_KEYS):
        raise bad_request(f"structured_outputs must set one of {', '.join(_VLLM_KEYS)}", "structured_outputs")
    for key in _VLLM_KEYS if structured else ():
        if structured.get(key) not in (None, False):
            found.append((_from_vllm(key, structured[key], f"structured_outputs.{key}"), f"structured_outputs.{key}"))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((_from_vllm(key, body[name], name), name))
    if len(found) > 1:
        raise bad_request(f"{found[0][1]} and {found[1][1]} both constrain the output; send one", found[1][1])
    return found[0] if found else None


def _from_response_format(response_format: dict[str, Any], where: str) -> Grammar | None:
    kind = field(response_format, "type", str, required=True, param=f"{where}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = field(response_format, "json_schema", dict, required=True, param=f"{where}.json_schema")
        name = f"{where}.json_schema.name"
        check_name(field(spec, "name", str, required=True, param=name), name)
        field(spec, "strict", bool, param=f"{where}.json_schema.strict")  # enforced either way, as vLLM does
        schema = field(spec, "schema", dict, param=f"{where}.json_schema.schema")
        check_schema(schema, f"{where}.json_schema.schema")
        return Grammar.json_object() if schema is None else Grammar.json_schema(schema)
    if kind == "regex":
        return Grammar.regex(_non_empty(response_format, "regex", f"{where}.regex"))
    if kind == "grammar":
        return _grammar(_non_empty(response_format, "grammar", f"{where}.grammar"), f"{where}.grammar")
    raise bad_request(f"{where}.type must be text, json_object, json_schema, regex or grammar (got {kind!r})",
                      f"{where}.type")


def _from_vllm(key: str, value: Any, where: str) -> Grammar:
    if key == "json":
        if isinstance(value, str):
            value = loads(value, where)
        if not isinstance(value, dict):
            raise bad_request(f"{where} must be a JSON schema object", where)
        check_schema(value, where)
        return Grammar.json_schema(value)
    if key == "json_object":
        return Grammar.json_object()
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{where} must be a non-empty array of non-empty strings", where)
        return Grammar.choice(value)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", where)
    return Grammar.regex(value) if key == "regex" else _grammar(value, where)


def _grammar(text: str, where: str) -> Grammar:
    """Lark (llguidance's dialect), or GBNF (llama.cpp's; its rules use `::=`) converted to it."""
    if "::=" in text:
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except (GbnfToLarkError, ValueError) as exc:
            raise bad_request(f"{where}: the GBNF grammar does not convert: {exc}", where, code="invalid_grammar") from None
    return Grammar.lark(text)


def _non_empty(spec: dict[str, Any], key: str, where: str) -> str:
    value = field(spec, key, str, required=True, param=where)
    if not value:
        raise bad_request(f"{where} must not be empty", where)
    return value


async def compile_grammar(engine: Any, grammar: Grammar, param: str) -> None:
    """Compile `grammar` into the engine's cache on a worker thread (a first use also reads the tokenizer, about
    half a second); a grammar that does not compile is a 400 naming `param`."""
    try:
        await asyncio.to_thread(engine.structured.compile, grammar)
    except GrammarError as exc:
        raise bad_request(f"{param}: {_readable(str(exc), grammar)}", param, code="invalid_grammar") from None


def _readable(message: str, grammar: Grammar) -> str:
    """llguidance's error, or what it means where the words are its parser's: a schema whose every value nests
    forever (or a huge one) fills the parser's item limit at the first token; one that only refers to itself, or
    a regex of an empty set, leaves no token to start with ("NoExtensionBias")."""
    what = {"json_schema": "the schema", "regex": "the regex"}.get(grammar.kind, "the grammar")
    if "NoExtensionBias" in message:
        return f"{what} matches no output at all: no token can start one"
    if "Too many items" not in message:
        return message
    if grammar.kind == "json_schema":
        return "the schema cannot be matched by any finite JSON value (or is too large to compile)"
    return "the grammar cannot be matched by any finite output (or is too large to compile)"
