"""Chat completions with `mcp` tools (our extension): the server runs the calls against the real toy MCP server
and answers once the model has; calls reported in `message.mcp_calls` / `delta.mcp_calls`."""

from __future__ import annotations

import json

import pytest
from test_openapi import check
from test_responses_mcp import Turns, _state, call_text

from tiny import MODEL_NAME, sse_events

MCP = {"type": "mcp", "server_label": "toy", "allowed_tools": ["add", "pick"]}
MESSAGES = [{"role": "user", "content": "What is 2 + 40?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
def live(start_server, async_engine):
    return start_server(_state(async_engine))


def test_calls_run_and_the_answer_follows(live, tokenizer):
    live.state.generate = turns = Turns(tokenizer, ["Let me add.", call_text("add", {"a": 2, "b": 40})], ["It is 42."])
    status, _, body = live.request("POST", "/v1/chat/completions",
                                   {"model": MODEL_NAME, "messages": MESSAGES, "tools": [MCP]})
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == "Let me add.It is 42." and body["choices"][0]["finish_reason"] == "stop"
    (call,) = message["mcp_calls"]
    assert call["type"] == "mcp_call" and call["name"] == "add" and call["server_label"] == "toy"
    assert call["output"] == "42" and call["status"] == "completed" and "tool_calls" not in message
    assert "42" in turns.prompts[1].split("What is 2 + 40?")[1]
    assert body["usage"]["completion_tokens"] == 3  # every turn's tokens
    check("CreateChatCompletionResponse", body)


def test_streamed_chunks_carry_the_calls(live, tokenizer):
    live.state.generate = Turns(tokenizer, [call_text("add", {"a": 1, "b": 2})], ["Three."])
    status, _, raw = live.request("POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": MESSAGES, "tools": [MCP], "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = sse_events(raw)
    assert chunks[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [d["mcp_calls"][0] for d in deltas if "mcp_calls" in d]
    assert len(calls) == 1 and calls[0]["output"] == "3"
    assert "".join(d.get("content", "") for d in deltas) == "Three."
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["usage"]["completion_tokens"] == 2
    for chunk in chunks[:-1]:
        check("CreateChatCompletionStreamResponse", chunk)


def test_the_openai_sdk_streams_it(live, tokenizer):
    live.state.generate = Turns(tokenizer, [call_text("add", {"a": 1, "b": 2})], ["Three."])
    stream = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                                   extra_body={"tools": [MCP]})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Three."


def test_a_forced_call_on_the_tiny_model(live):
    reply = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Pick."}], temperature=0, max_tokens=40,
        extra_body={"tools": [MCP], "tool_choice": {"type": "function", "function": {"name": "pick"}}})
    (call,) = reply.choices[0].message.model_extra["mcp_calls"]
    assert call["name"] == "pick" and call["output"] == f"picked {json.loads(call['arguments'])['color']}"


def test_a_client_function_call_ends_the_reply(live, tokenizer):
    live.state.generate = Turns(tokenizer, [call_text("get_weather", {"city": "Paris"})])
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                  extra_body={"tools": [{**MCP, "allowed_tools": ["add"]}, WEATHER]})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{**MCP, "require_approval": "always"}]}, "tools[0].require_approval"),
    ({"tools": [MCP], "n": 2}, "n"),
    ({"tools": [MCP], "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "mcp", "server_label": "elsewhere"}]}, "tools[0].server_label"),
    ({"tools": [MCP, {"type": "function"}]}, "tools[1]"),
    ({"tools": [MCP], "max_tool_calls": -1}, "max_tool_calls"),
])
def test_bad_requests_name_the_field(live, extra, param):
    status, _, body = live.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **extra})
    assert status == 400 and body["error"]["param"] == param, body
