"""Every response body, stream chunk and stream event validates against OpenAI's published OpenAPI schema
(the parts we answer with, vendored in tests/data/openapi/ with the upstream commit they come from)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from tiny import MODEL_NAME, scripted_generate, sse_events

SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "openapi" / "openai-subset.json"
MESSAGES = [{"role": "user", "content": "hello world"}]
SHORT = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_SCRIPT = ["Let me", " check.\n", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
               "</tool_call>"]


@cache
def spec() -> dict:
    return json.loads(SPEC_PATH.read_text())


@cache
def validator(name: str) -> Draft202012Validator:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/components/schemas/{name}",
              "components": spec()["components"]}
    return Draft202012Validator(schema)


def check(name: str, instance) -> None:
    errors = list(validator(name).iter_errors(instance))
    details = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:8]]
    assert not errors, f"not a valid {name}:\n" + "\n".join(details) + f"\n{json.dumps(instance)[:1500]}"


@cache
def event_schemas() -> dict[str, str]:
    """Responses stream event `type` -> the name of its schema."""
    schemas = spec()["components"]["schemas"]
    names = {}
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[1]
        kind = schemas[name]["properties"]["type"]
        for value in kind.get("enum", []) + ([kind["const"]] if "const" in kind else []):
            names[value] = name
    return names


def post(server, path: str, body: dict):
    status, _, data = server.request("POST", path, body)
    assert status == 200, data
    return data


def stream(server, path: str, body: dict) -> list:
    events = sse_events(post(server, path, {**body, "stream": True}))
    assert events[-1] == "[DONE]" or path.endswith("responses")
    return [event for event in events if event != "[DONE]"]


def test_the_vendored_schema_names_its_source():
    info = spec()["info"]
    assert info["source"] == "https://github.com/openai/openai-openapi" and len(info["commit"]) == 40
    assert set(info["roots"]) <= set(spec()["components"]["schemas"])


@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"seed": 3, "user": "u"}],
                         ids=["plain", "n2", "logprobs", "seed"])
def test_chat_completion(server, extra):
    check("CreateChatCompletionResponse", post(server, "/v1/chat/completions", {**SHORT, "messages": MESSAGES, **extra}))


@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"logprobs": True, "top_logprobs": 1},
                                   {"stream_options": {"include_usage": True}}],
                         ids=["plain", "n2", "logprobs", "usage"])
def test_chat_completion_chunks(server, extra):
    chunks = stream(server, "/v1/chat/completions", {**SHORT, "messages": MESSAGES, **extra})
    assert len(chunks) > 2
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)


def test_tool_calls_whole_and_streamed(start_server):
    live = start_server()
    live.state.generate = scripted_generate(TOOL_SCRIPT)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS}
    reply = post(live, "/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["tool_calls"]
    check("CreateChatCompletionResponse", reply)
    chunks = stream(live, "/v1/chat/completions", body)
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("extra", [{}, {"n": 2}, {"echo": True}, {"logprobs": 2}, {"prompt": ["a b", "c d"]},
                                   {"stream_options": {"include_usage": True}}],
                         ids=["plain", "n2", "echo", "logprobs", "two-prompts", "usage"])
def test_completion_whole_and_streamed(server, extra):
    body = {**SHORT, "prompt": "hello world", **extra}
    whole = {k: v for k, v in body.items() if k != "stream_options"}
    check("CreateCompletionResponse", post(server, "/v1/completions", whole))
    for chunk in stream(server, "/v1/completions", body):
        # OpenAI streams the same object, finish_reason null until a choice's last chunk, which its published
        # schema (written for the whole object) does not allow for: check everything else
        for choice in chunk["choices"]:
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "length"
        check("CreateCompletionResponse", chunk)


@pytest.mark.parametrize("extra", [{}, {"instructions": "Be brief.", "metadata": {"k": "v"}},
                                   {"max_output_tokens": 2}], ids=["plain", "instructions", "incomplete"])
def test_response_object_and_events(server, extra):
    body = {"model": MODEL_NAME, "input": "hello world", "temperature": 0, "max_output_tokens": 4,
            "ignore_eos": True, **extra}
    check("Response", post(server, "/v1/responses", body))
    events = stream(server, "/v1/responses", body)
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    for event in events:
        check(event_schemas()[event["type"]], event)


def test_models(server):
    status, _, models = server.request("GET", "/v1/models")
    check("ListModelsResponse", models)
    status, _, model = server.request("GET", f"/v1/models/{MODEL_NAME}")
    assert status == 200
    check("Model", model)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL_NAME}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 3}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ("/v1/responses", {"model": MODEL_NAME, "input": "x", "max_output_tokens": 0}),
    ("/v1/nowhere", {}),
])
def test_error_bodies(server, path, body):
    status, _, error = server.request("POST", path, body)
    assert 400 <= status < 500
    check("ErrorResponse", error)


def test_auth_error_body(start_server):
    live = start_server(api_key="secret")
    status, _, error = live.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES})
    assert status == 401
    check("ErrorResponse", error)


@pytest.mark.parametrize("body", [{"input": "hello world"}, {"input": ["hello", "world"], "dimensions": 16},
                                  {"input": [[2, 10, 27, 3]], "user": "u"}], ids=["one", "many", "ids"])
def test_embeddings(start_server, async_engine, tmp_path, body):
    from tiny import make_state
    from tiny_encoder import build_encoder_dir

    state = make_state(async_engine)
    state.embeddings.load(str(build_encoder_dir(tmp_path / "tiny-bert", matryoshka=(32, 16))))
    try:
        live = start_server(state)
        check("CreateEmbeddingResponse", post(live, "/v1/embeddings", {"model": "tiny-bert", **body}))
        status, _, error = live.request("POST", "/v1/embeddings", {"model": "tiny-bert", "input": []})
        assert status == 400
        check("ErrorResponse", error)
    finally:
        state.embeddings.stop()
