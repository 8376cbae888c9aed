"""Enforced tool calls in each template family's own format, on a tiny random model: the grammar makes the
model write what the parser reads back (Hermes blocks, Mistral's `[TOOL_CALLS]` special token, Llama 3 JSON)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tfserve import Engine, SamplingParams
from tfserve.engine.structured import GrammarError, StructuredOutputs
from tfserve.protocol.tool_calls import parse_tool_calls
from tfserve.protocol.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, detect_format
from tfserve.sampling_params import Grammar
from tfserve.server.errors import ApiError
from tfserve.server.tools.tool_choice import (after_first_turn, apply_constraint, callable_tools, forced_tools,
                                              needs_special_tokens, text_or_calls, tool_call_grammar)
from tiny import build_llama, build_tokenizer

FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}},
    {"name": "ping"},  # no parameters: an empty object
]


@pytest.fixture(scope="module")
def mistral_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "[TOOL_CALLS]"]})
    tokenizer.chat_template = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]?"
    return tokenizer


def generate(tokenizer, grammar, *, skip_special_tokens=True, seed=0) -> str:
    engine = Engine(build_llama(tokenizer), tokenizer, block_size=8, num_blocks=64)
    params = SamplingParams(grammar=grammar, max_tokens=120, temperature=1.0, seed=seed,
                            skip_special_tokens=skip_special_tokens)
    (output,) = engine.generate_batch([tokenizer.encode("weather in Paris?")], params).values()
    assert output.finish_reason == "stop", output.text
    return output.text


def test_formats_are_read_from_the_template(mistral_tokenizer):
    hermes = build_tokenizer()
    assert detect_format(hermes) is HERMES  # its template writes <tool_call> blocks
    assert detect_format(mistral_tokenizer) is MISTRAL
    llama = build_tokenizer()
    llama.chat_template = "{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_format(llama) is LLAMA3_JSON


def test_a_format_token_is_looked_up_not_the_whole_vocabulary(mistral_tokenizer, monkeypatch):
    # detect_format runs on every chat request, on the server's event loop: get_vocab() builds a dict of the
    # whole vocabulary (64 ms for SmolLM2's 49k tokens, every request's time to first token)
    mistral = build_tokenizer()
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    mistral.chat_template = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"  # not in it
    monkeypatch.setattr(type(mistral), "get_vocab", lambda self: pytest.fail("the whole vocabulary was built"))
    assert detect_format(mistral) is MISTRAL
    assert detect_format(build_tokenizer()) is HERMES


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forced_calls_in_text_formats_parse_and_validate(fmt, seed):
    tokenizer = build_tokenizer()
    text = generate(tokenizer, tool_call_grammar(fmt, FUNCTIONS, parallel=False, tokenizer=tokenizer), seed=seed)
    content, (call,) = parse_tool_calls(text, fmt)
    assert content is None
    schema = {f["name"]: f.get("parameters", {"type": "object", "maxProperties": 0}) for f in FUNCTIONS}[call.name]
    assert call.name == "get_weather" or call.arguments == "{}"
    jsonschema.validate(json.loads(call.arguments), schema)


@pytest.mark.parametrize("seed", [4, 6])  # (of seeds 0-11, 4 finish: the random model nests items past max_tokens)
def test_parameters_with_defs_and_refs_compile_and_validate(seed):
    """A pydantic model's parameters (`$defs`, `#/$defs/...`, a reference to its own root): the calls' grammar
    keeps every reference pointing at its definition (they were a 400: the pointer did not exist)."""
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                             "more": {"anyOf": [{"$ref": "#/$defs/Item"}, {"type": "null"}]}},
            "required": ["name", "more"], "additionalProperties": False}
    order = {"type": "object", "$defs": {"Item": item},
             "properties": {"item": {"$ref": "#/$defs/Item"}, "count": {"$ref": "#/properties/n"},
                            "n": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["item", "count", "n"], "additionalProperties": False}
    functions = [{"name": "order", "parameters": order}, {"name": "tree", "parameters": {
        "type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["child"], "additionalProperties": False}}]
    tokenizer = build_tokenizer()
    text = generate(tokenizer, tool_call_grammar(HERMES, functions, parallel=False, tokenizer=tokenizer), seed=seed)
    _, (call,) = parse_tool_calls(text, HERMES)
    jsonschema.validate(json.loads(call.arguments), {f["name"]: f["parameters"] for f in functions}[call.name])


def test_mistral_calls_open_with_the_special_token(mistral_tokenizer):
    assert needs_special_tokens(MISTRAL, mistral_tokenizer)
    grammar = tool_call_grammar(MISTRAL, FUNCTIONS[:1], parallel=False, tokenizer=mistral_tokenizer)
    assert "<[" in grammar.source  # the marker by token id: a string never matches a special token
    text = generate(mistral_tokenizer, grammar, skip_special_tokens=False)
    assert text.startswith("[TOOL_CALLS][")
    content, (call,) = parse_tool_calls(text, MISTRAL)
    assert content is None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), FUNCTIONS[0]["parameters"])


def _reads(tokenizer, grammar, pieces: list) -> tuple[bool, bool]:
    """Whether a matcher of `grammar` takes `pieces` (texts, or token ids for special tokens) and then may end."""
    outputs = StructuredOutputs(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    matcher = outputs.matcher(grammar)
    ids = [i for piece in pieces for i in ([piece] if isinstance(piece, int) else
                                         tokenizer.encode(piece, add_special_tokens=False))]
    if not matcher.consume_tokens(ids):
        return False, False
    return True, matcher.consume_token(tokenizer.eos_token_id)


VALID = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
PING = '{"name": "ping", "arguments": {}}'


@pytest.mark.parametrize("text,taken,ends", [
    ("Plain text, maybe about <tool_ calls.", True, True),
    (f"Let me look.\n<tool_call>\n{VALID}\n</tool_call>", True, True),
    (f"<tool_call>\n{VALID}\n</tool_call>\n<tool_call>\n{PING}\n</tool_call>", True, True),
    ('Let me look.\n<tool_call>\n{"name": "get_time"', False, False),  # not offered
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', False, False),  # "days" missing
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}', False, False),  # > 7
    ("I will call it.\n<tool_call>\n", True, False),  # opened: a call must follow
    (f"<tool_call>\n{VALID}\n</tool_call> and more", False, False),
])
def test_auto_text_is_free_until_a_call_opens_then_calls_are_valid(text, taken, ends):
    tokenizer = build_tokenizer()
    assert _reads(tokenizer, text_or_calls(HERMES, FUNCTIONS, parallel=True, tokenizer=tokenizer), [text]) == (
        taken, ends)


def test_auto_calls_in_every_format(mistral_tokenizer):
    tokenizer = build_tokenizer()
    one = text_or_calls(HERMES, FUNCTIONS, parallel=False, tokenizer=tokenizer)
    assert _reads(tokenizer, one, [f"<tool_call>\n{VALID}\n</tool_call>\n<tool_call>"]) == (False, False)
    llama = text_or_calls(LLAMA3_JSON, FUNCTIONS, parallel=True, tokenizer=tokenizer)
    assert _reads(tokenizer, llama, ["The answer is {not a call}."]) == (True, True)  # text that opens otherwise
    assert _reads(tokenizer, llama, [' {"name": "ping", "parameters": {}}; {"name": "ping", "parameters": {}}']
                  ) == (True, True)
    assert _reads(tokenizer, llama, ['{"answer": 4}']) == (False, False)  # a reply opening with `{` is calls
    marker = mistral_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    mistral = text_or_calls(MISTRAL, FUNCTIONS, parallel=True, tokenizer=mistral_tokenizer)
    assert _reads(mistral_tokenizer, mistral, ["Just text."]) == (True, True)
    assert _reads(mistral_tokenizer, mistral, ["Hm.", marker, f"[{VALID}, {PING}]"]) == (True, True)
    assert _reads(mistral_tokenizer, mistral, [marker, '[{"name": "nope"']) == (False, False)


def test_an_auto_call_the_model_opens_is_valid(mistral_tokenizer):
    """A random model that leans to the marker (as a model that decides to call) writes a call that parses and
    validates: its arguments come from the grammar, its decision to call from the model."""
    marker = mistral_tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    engine = Engine(build_llama(mistral_tokenizer), mistral_tokenizer, block_size=8, num_blocks=64)
    grammar = text_or_calls(MISTRAL, FUNCTIONS[:1], parallel=False, tokenizer=mistral_tokenizer)
    for seed in range(3):
        params = SamplingParams(grammar=grammar, max_tokens=120, temperature=1.0, seed=seed, logit_bias={marker: 50},
                                skip_special_tokens=False)
        (output,) = engine.generate_batch([mistral_tokenizer.encode("weather in Paris?")], params).values()
        assert output.finish_reason == "stop", output.text
        content, (call,) = parse_tool_calls(output.text, MISTRAL)
        assert call.name == "get_weather" and content is None
        jsonschema.validate(json.loads(call.arguments), FUNCTIONS[0]["parameters"])


def test_forced_tools_by_choice():
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    assert forced_tools(tools, "auto") is None and forced_tools(tools, "none") is None
    assert [f["name"] for f in forced_tools(tools, "required")] == ["get_weather", "ping"]
    assert [f["name"] for f in forced_tools(tools, {"type": "function", "function": {"name": "ping"}})] == ["ping"]
    # the Responses API names the function at the top level
    assert [f["name"] for f in forced_tools(FUNCTIONS, {"type": "function", "name": "ping"})] == ["ping"]
    with pytest.raises(ApiError) as error:
        forced_tools(tools, {"type": "function", "function": {"name": "nope"}})
    assert error.value.param == "tool_choice.function.name" and "get_weather" in error.value.message


def test_allowed_tools_restrict_the_calls_in_both_shapes():
    """OpenAI's allowed_tools: every tool stays offered (in the prompt), only the listed ones may be called;
    "required" forces a call of one of them."""
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    chat = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "ping"}}]}}
    assert [f["name"] for f in forced_tools(tools, chat)] == ["ping"]
    assert [f["name"] for f in callable_tools(tools, chat)] == ["ping"]
    flat = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}
    assert forced_tools(FUNCTIONS, flat) is None
    assert [f["name"] for f in callable_tools(FUNCTIONS, flat)] == ["get_weather"]
    assert callable_tools(tools, "none") == [] and len(callable_tools(tools, "auto")) == 2
    later = after_first_turn({**flat, "mode": "required"})
    assert later.mode == "auto" and forced_tools(FUNCTIONS, later) is None and after_first_turn("required").mode == "auto"
    mcp = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": "wiki"}]}
    assert [f["name"] for f in callable_tools(FUNCTIONS, mcp, lambda entry: ["ping"])] == ["ping"]


@pytest.mark.parametrize("choice, param", [
    ({"type": "allowed_tools", "mode": "sometimes", "tools": [{"type": "function", "name": "ping"}]},
     "tool_choice.mode"),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.tools"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function"}]}, "tool_choice.tools[0].name"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]},
     "tool_choice.tools[0].name"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "web_search"}]}},
     "tool_choice.allowed_tools.tools[0]"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}}, "tool_choice.allowed_tools.tools[0].function.name"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": "x"}]},
     "tool_choice.tools[0]"),
])
def test_a_wrong_allowed_tools_choice_names_its_field(choice, param):
    with pytest.raises(ApiError) as error:
        callable_tools(FUNCTIONS, choice)
    assert error.value.status == 400 and error.value.param == param


def test_a_calls_grammar_that_fails_whole_keeps_the_engines_first_line():
    """Where no tool's parameters fail alone, the 400 drops the listing of, and the position in, the grammar the
    server wrote."""
    class Engine:  # the EngineClient's grammar methods, the whole-calls grammar failing
        grammars_ready = True

        def grammar_compiled(self, grammar):
            return False

        def compile_grammar(self, grammar):
            if grammar.kind == "lark":
                raise GrammarError('at 3(7): the calls are off    1 | start: call    2 | call: "<tool_call>" body')

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    engine, constraint = Engine(), (Grammar.lark("start: x\n"), "tools")
    with pytest.raises(ApiError) as error:
        asyncio.run(apply_constraint(engine, {}, constraint, None, tools, HERMES, None))
    assert (error.value.message, error.value.param) == ("tools: the calls are off", "tools")
