"""Structured outputs and enforced tool choice on a live server over a tiny random-weight model: whatever the
weights write, the reply parses. Driven by the openai SDK's own helpers (`parse`, `stream`) and LangChain's
`with_structured_output`; bad schemas and tool choices are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tiny import MODEL_NAME, sse_events

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")  # else any further key is allowed, and a random model writes on

    city: Literal["Paris", "Rome", "Oslo"]
    celsius: int = Field(ge=-40, le=50)
    windy: bool
    note: str = Field(max_length=6)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("temperature, seed", [(0, None), (0.8, 1), (1.3, 2)])
def test_parse_helper_gets_a_valid_object(server, temperature, seed):
    completion = server.client().chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, response_format=Weather, temperature=temperature, seed=seed,
        max_tokens=120)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Weather)
    assert Weather.model_validate_json(message.content) == message.parsed


def test_stream_helper_gets_a_valid_object(server):
    with server.client().chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, response_format=Weather,
                                                 temperature=0.7, seed=5, max_tokens=120) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3  # streamed, not one piece
    assert isinstance(final.choices[0].message.parsed, Weather)
    assert "".join(deltas) == final.choices[0].message.content


def test_json_object_regex_grammar_and_vllm_fields(server, tokenizer):
    client = server.client()

    def content(**kwargs) -> str:
        reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=3,
                                               max_tokens=100, **kwargs)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        return reply.choices[0].message.content

    # any object: free keys would let a random model write forever, so a bias closes it (and shows that biases
    # apply under a grammar, which still wins: the bias cannot make "}" come first)
    close = str(tokenizer.convert_tokens_to_ids("}"))
    assert content(response_format={"type": "json_object"}, logit_bias={close: 100}) == "{}"
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}",
                        content(response_format={"type": "regex", "regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}))
    assert re.fullmatch(r"(sunny|rainy)!+", content(
        response_format={"type": "grammar", "grammar": 'start: ("sunny" | "rainy") /!{1,3}/'}))
    assert re.fullmatch(r"(yes|no)", content(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}))
    assert content(extra_body={"guided_choice": ["left", "right"]}) in ("left", "right")
    gbnf = 'root ::= "id-" [0-9] [0-9]'
    assert re.fullmatch(r"id-[0-9]{2}", content(extra_body={"guided_grammar": gbnf}))
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}
    jsonschema.validate(json.loads(content(extra_body={"guided_json": schema})), schema)


def test_streamed_json_schema_is_the_same_text_as_whole(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}}
    status, _, raw = server.request("POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_events(raw)[:-1] if c["choices"])
    whole = server.client().chat.completions.create(**{k: v for k, v in body.items() if k != "model"}, model=MODEL_NAME)
    assert streamed == whole.choices[0].message.content
    Weather.model_validate_json(streamed)


def test_cut_by_max_tokens_says_length(server):
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}})
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.choices[0].message.content)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema.type", "must be one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"type": "object"}, "then": {}}}}}, "response_format", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "regex", "regex": "(("}}, "response_format", "regex"),
    ({"response_format": {"type": "grammar", "grammar": "start: nowhere"}}, "response_format", "nowhere"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "both"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.type", "must be one of"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {  # checked without a grammar too
        "type": "object", "properties": {"city": {"type": "town"}}}}}]},
     "tools[0].function.parameters.properties.city.type", "must be one of"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "[-100, 100]"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "max_tokens"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, message):
    status, _, raw = server.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **body})
    error = raw["error"]
    assert status == 400 and error["param"] == param and message in error["message"], error


BROKEN_REF = {"type": "object", "properties": {"a": {"$ref": "#/defs/nope"}}}
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # every value nests forever


def broken_tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL, broken_tool(BROKEN_REF)], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL, broken_tool(BROKEN_REF)]}, "tools[1].function.parameters"),
    ("/v1/chat/completions", {"tools": [broken_tool(BROKEN_REF)], "response_format": {"type": "json_object"}},
     "tools[0].function.parameters"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": BROKEN_REF}],
                       "tool_choice": "required"}, "tools[0].parameters"),
])
def test_a_tool_schema_that_does_not_compile_is_named_without_the_calls_grammar(server, path, body, param):
    """The tools' grammar is the server's: its listing and rewritten pointers are no use to the client."""
    base = {"messages": MESSAGES} if path.endswith("completions") else {"input": "hi"}
    status, _, raw = server.request("POST", path, {"model": MODEL_NAME, **base, **body})
    error = raw["error"]
    assert status == 400 and error["param"] == param and error["code"] == "invalid_grammar", error
    assert error["message"] == f"{param}: Pointer '/defs/nope' does not exist"


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}}, "response_format"),
    ({"tools": [broken_tool(ENDLESS)], "tool_choice": "required"}, "tools[0].function.parameters"),
])
def test_a_schema_no_finite_value_matches_says_so(server, body, param):
    status, _, raw = server.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert status == 400 and raw["error"]["param"] == param
    assert raw["error"]["message"] == (f"{param}: the schema cannot be matched by any finite JSON value (or is too "
                                       "large to compile)")


@pytest.mark.parametrize("body, what", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "the schema"),
    ({"response_format": {"type": "regex", "regex": "[^\\s\\S]"}}, "the regex"),
])
def test_a_constraint_nothing_matches_says_so(server, body, what):
    """Not llguidance's "NoExtensionBias <state> Tokens: ⟦⟧": a schema that only refers to itself, an empty set."""
    status, _, raw = server.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **body})
    assert status == 400 and raw["error"]["param"] == "response_format"
    assert raw["error"]["message"] == f"response_format: {what} matches no output at all: no token can start one"


def check_call(call, tools) -> dict:
    function = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, function["parameters"])
    return arguments


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 4), (1.5, 9)])
def test_tool_choice_required_always_gives_a_valid_call(server, temperature, seed):
    tools = [WEATHER_TOOL, TIME_TOOL]
    # one call: a random model allowed more goes on calling until max_tokens (it never favours the end)
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools,
                                                    tool_choice="required", temperature=temperature, seed=seed,
                                                    max_tokens=100, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert not choice.message.content
    check_call(call, tools)


def test_parallel_calls_stop_where_the_model_repeats_itself(server):
    tools = [WEATHER_TOOL, TIME_TOOL]
    body = dict(model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice="required", temperature=0, max_tokens=100)
    reply = server.client().chat.completions.create(**body)
    # greedy, this model writes its call again and again: the repeat is dropped and ends the reply there
    (call,) = reply.choices[0].message.tool_calls
    check_call(call, tools)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.usage.completion_tokens < 100  # the engine request was ended, not run to max_tokens
    deltas, finish = [], None
    for chunk in server.client().chat.completions.create(**body, stream=True):
        deltas += chunk.choices[0].delta.tool_calls or [] if chunk.choices else []
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls" and {d.index for d in deltas} == {0}  # the repeat never began on the wire
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_tools_and_a_response_format_together(server, tokenizer):
    """OpenAI takes both: the reply is a valid call or the final answer in the format (never neither); a forced
    call is a call whatever the format says."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}
    body = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER_TOOL], response_format=fmt, max_tokens=120,
                temperature=0.9, seed=3, parallel_tool_calls=False)
    opening, brace = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("<", "{"))
    client = server.client()
    called = client.chat.completions.create(**body, logit_bias={str(opening): 100})  # leans to the call
    (call,) = called.choices[0].message.tool_calls
    check_call(call, [WEATHER_TOOL])
    answered = client.chat.completions.create(**body, logit_bias={str(brace): 100})  # leans to the answer
    assert not answered.choices[0].message.tool_calls and answered.choices[0].finish_reason == "stop"
    Weather.model_validate_json(answered.choices[0].message.content)
    forced = client.chat.completions.create(**body, tool_choice="required", logit_bias={str(brace): 100})
    (call,) = forced.choices[0].message.tool_calls
    check_call(call, [WEATHER_TOOL])


def test_named_tool_choice_and_no_parallel_calls(server):
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], temperature=1.0, seed=2, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert check_call(call, [TIME_TOOL])["zone"] in ("UTC", "CET")


def test_tool_choice_none_and_auto_leave_the_model_free(server):
    for choice in ("none", "auto"):
        reply = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER_TOOL],
                                                        tool_choice=choice, temperature=0, max_tokens=5)
        assert reply.choices[0].finish_reason == "length"


def test_auto_holds_an_opened_call_to_the_tools(start_server):
    """Under "auto" (chat and Responses) the engine gets the grammar of text-or-valid-calls (tests/server/
    test_tool_choice.py checks what it allows); under "none", and without tools, no grammar."""
    live = start_server()
    grammars = []
    generate = live.state.generate

    def spy(request):
        grammars.append(request.params.grammar)
        return generate(request)

    live.state.generate = spy
    client = live.client()
    for choice in ("auto", "none"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice=choice,
                                       max_tokens=3)
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    client.responses.create(model=MODEL_NAME, input="Weather?", max_output_tokens=3,
                            tools=[{"type": "function", **WEATHER_TOOL["function"]}])
    auto, none, plain, responses = grammars
    assert none is None and plain is None
    for grammar in (auto, responses):
        assert grammar.kind == "lark" and "<tool_call>" in grammar.source and '"get_weather"' in grammar.source


def test_a_forced_call_streams_its_arguments_as_deltas(server):
    stream = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="required", temperature=0.9, seed=1,
        max_tokens=100, stream=True, parallel_tool_calls=False)
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or [] if chunk.choices else []
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.function.arguments == ""
    assert len(rest) > 2 and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    arguments = json.loads("".join(d.function.arguments for d in rest))
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_constrained_and_free_requests_run_together(server):
    client = server.client()
    free = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    alone = client.chat.completions.create(**free).choices[0].message.content
    results, errors = {}, []

    def run(key, **kwargs):
        try:
            results[key] = client.chat.completions.create(**kwargs).choices[0].message
        except Exception as exc:  # reported below: a thread's assert would be lost
            errors.append(exc)

    threads = [threading.Thread(target=run, args=("free",), kwargs=free)]
    threads += [threading.Thread(target=run, args=(f"json{i}",), kwargs={
        "model": MODEL_NAME, "messages": MESSAGES, "temperature": 0.9, "seed": i, "max_tokens": 120,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}}})
        for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results["free"].content == alone
    for i in range(3):
        Weather.model_validate_json(results[f"json{i}"].content)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=str(server.client().base_url), api_key="x",
                                      temperature=0.5, max_tokens=150, seed=7)
    result = llm.with_structured_output(Weather, method=method).invoke("Weather in Oslo?")
    assert isinstance(result, Weather)


def test_completions_take_the_same_constraints(server):
    reply = server.client().completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=20, temperature=1.0,
                                               seed=1, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
