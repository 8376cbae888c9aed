"""What a request asks its output to look like -> one `Grammar` for the engine, compiled before the response
starts (off the event loop and the step loop) so that a bad schema is a 400 naming its field.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), two extensions of ours in the same place
(`{"type": "regex", "regex": ...}`, `{"type": "grammar", "grammar": <Lark or GBNF>}`), TGI's (`json_object` or
`json` with the schema as `value`, `regex` with the regex as `value`), and vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`) with its older top-level
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, so vLLM clients work unchanged.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tfserve.engine.client import EngineClient
from tfserve.engine.structured import GrammarError
from tfserve.sampling_params import Grammar
from tfserve.server.body import loads
from tfserve.server.errors import bad_request
from tfserve.server.protocol import check_name, check_schema, field

_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# a grammar's compile, at most: llguidance compiles a nested JSON schema in ms, but its fuel limits do not bound
# validation (a 260 KB alternation of words takes a second); past it the request is a 400, not a stall
MAX_COMPILE_S = 2.0
# compiles run here, not on the default executor: one that ran past its budget goes on in its thread (it cannot
# be interrupted), and must not hold up image decoding or tokenizing; two at a time on any machine
_COMPILES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tfserve-grammar")
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
    if kind in ("json_object", "json") and (response_format.get("value") is not None or kind == "json"):
        # TGI's shape (huggingface_hub's InferenceClient sends it): the schema is the `value`
        if "value" not in response_format:
            raise bad_request(f"{where}.value is required: the JSON schema", f"{where}.value")
        return _from_vllm("json", response_format["value"], f"{where}.value")
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
        key = "value" if "regex" not in response_format and "value" in response_format else "regex"  # TGI: value
        return Grammar.regex(_non_empty(response_format, key, f"{where}.{key}"))
    if kind == "grammar":
        return _grammar(_non_empty(response_format, "grammar", f"{where}.grammar"), f"{where}.grammar")
    raise bad_request(f"{where}.type must be text, json_object, json_schema, json, regex or grammar (got {kind!r})",
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


async def compile_grammar(engine: EngineClient, grammar: Grammar, param: str) -> None:
    """Compile `grammar` into the engine's cache on a worker thread (a first use also reads the tokenizer, about
    half a second); a grammar that does not compile, or not within MAX_COMPILE_S, is a 400 naming `param`."""
    if engine.grammar_compiled(grammar):
        return
    loop = asyncio.get_running_loop()
    try:
        if not engine.grammars_ready:  # once, ~0.5 s: not the grammar's cost
            await loop.run_in_executor(_COMPILES, engine.prepare_grammars)
        await asyncio.wait_for(loop.run_in_executor(_COMPILES, engine.compile_grammar, grammar), MAX_COMPILE_S)
    except GrammarError as exc:
        raise bad_request(f"{param}: {_readable(str(exc), grammar)}", param, code="invalid_grammar") from None
    except TimeoutError:
        raise bad_request(f"{param}: the constraint took more than {MAX_COMPILE_S:g} s to compile; simplify it",
                          param, code="invalid_grammar") from None


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
