"""OpenAI's legacy function calling (`functions`, `function_call`, `role: "function"`), still sent by older
clients: read as tools, answered in the legacy shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tiny import MODEL_NAME, scripted_generate, sse_events

FUNCTION = {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"], "additionalProperties": False}}
SCRIPT = ["Let me", " check.\n", "<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
          "</tool_call>"]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture
def scripted(start_server):
    live = start_server()
    live.state.generate = scripted_generate(SCRIPT)
    return live


def test_a_call_comes_back_as_function_call(scripted):
    status, _, reply = scripted.request("POST", CHAT, {"model": MODEL_NAME, "messages": MESSAGES,
                                                       "functions": [FUNCTION]})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "function_call"
    message = choice["message"]
    assert "tool_calls" not in message and message["content"] == "Let me check."
    assert message["function_call"]["name"] == "get_weather"
    assert json.loads(message["function_call"]["arguments"]) == {"city": "Paris"}


def test_a_streamed_call_comes_as_function_call_deltas(scripted):
    status, _, raw = scripted.request("POST", CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "stream": True,
                                                     "functions": [FUNCTION], "function_call": "auto"})
    assert status == 200
    chunks = [event for event in sse_events(raw) if event != "[DONE]"]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    calls = [delta["function_call"] for delta in deltas if "function_call" in delta]
    assert not any("tool_calls" in delta for delta in deltas)
    assert calls[0] == {"name": "get_weather", "arguments": ""} and all("name" not in c for c in calls[1:])
    assert json.loads("".join(c["arguments"] for c in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"


def test_legacy_history_renders_as_its_tools_form(server):
    """An assistant `function_call` and a `role: "function"` result are the template's tool call and result."""
    legacy = [*MESSAGES, {"role": "assistant", "content": None,
                          "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    tools = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
    body = {"model": MODEL_NAME, "max_tokens": 1}
    _, _, old = server.request("POST", CHAT, {**body, "messages": legacy, "functions": [FUNCTION]})
    _, _, new = server.request("POST", CHAT, {**body, "messages": tools, "tools": [
        {"type": "function", "function": FUNCTION}]})
    assert old["usage"]["prompt_tokens"] == new["usage"]["prompt_tokens"] > 0


def test_a_named_function_call_is_enforced(server):
    """The openai SDK's own (deprecated) parameters; the tiny random model's call validates."""
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, functions=[FUNCTION, {"name": "ping"}], temperature=1.0, seed=1,
        function_call={"name": "get_weather"}, max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), FUNCTION["parameters"])


@pytest.mark.parametrize("extra,param", [
    ({"functions": [FUNCTION], "tools": [{"type": "function", "function": FUNCTION}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [FUNCTION], "function_call": "required"}, "function_call"),
    ({"functions": [FUNCTION], "function_call": {"name": "nope"}}, "function_call.name"),
    ({"functions": [FUNCTION], "function_call": {}}, "function_call.name"),
    ({"functions": []}, "functions"),
    ({"functions": ["get_weather"]}, "functions[0]"),
    ({"functions": {"name": "x"}}, "functions"),
    # what the functions become (tools) is checked in the client's terms
    ({"functions": [{}]}, "functions[0].name"),
    ({"functions": [{"name": "a b"}]}, "functions[0].name"),
    ({"functions": [{"name": "f", "parameters": {"type": "objekt"}}]}, "functions[0].parameters.type"),
    ({"messages": [*MESSAGES, {"role": "function", "content": "sunny"}]}, "messages[1].name"),
    ({"messages": [*MESSAGES, {"role": "assistant", "function_call": "x"}]}, "messages[1].function_call"),
])
def test_bad_legacy_fields_are_400s(server, extra, param):
    status, _, data = server.request("POST", CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1,
                                                    **extra})
    assert status == 400 and data["error"]["param"] == param, data
