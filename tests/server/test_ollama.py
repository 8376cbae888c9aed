"""Ollama's API on the tiny live server, driven by the `ollama` Python client as its users drive it: chat and
generate, whole and NDJSON-streamed (the default), `options` mapped onto sampling, `format` as "json" or a
schema, tools in Ollama's shape (a scripted model writes the call), the model routes; Ollama's error shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tiny import MODEL_NAME, scripted_generate

ollama = pytest.importorskip("ollama")

MESSAGES = [{"role": "user", "content": "hello world"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "windy": {"type": "boolean"}},
          "required": ["city", "windy"], "additionalProperties": False}
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture
def client(server):
    return ollama.Client(host=server.base_url)


def test_chat_whole_and_streamed_agree(client, server):
    reply = client.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY, stream=False)
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.message.role == "assistant" and reply.message.content
    assert reply.eval_count >= 1 and reply.prompt_eval_count >= 1
    parts = list(client.chat(model=f"{MODEL_NAME}:latest", messages=MESSAGES, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == reply.message.content
    same = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=6)
    assert same.choices[0].message.content == reply.message.content  # the /v1 path, the same prompt


def test_stream_is_ndjson_by_default(server):
    status, headers, raw = server.request("POST", "/api/generate", {"model": MODEL_NAME, "prompt": "hi",
                                                                     "options": {"num_predict": 3}})
    assert status == 200 and headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.splitlines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert lines[-1]["eval_count"] == 3 and lines[-1]["done_reason"] == "length"


def test_generate_templated_and_raw(client, tokenizer):
    templated = client.generate(model=MODEL_NAME, prompt="hello", system="Be brief.", options=GREEDY)
    raw = client.generate(model=MODEL_NAME, prompt="hello", raw=True, options=GREEDY)
    assert templated.response and raw.response
    assert raw.context[:len(tokenizer.encode("hello"))] == tokenizer.encode("hello")
    assert len(templated.context) > len(raw.context)  # the chat template's turns
    loaded = client.generate(model=MODEL_NAME)  # no prompt: Ollama's way to load a model
    assert loaded.done_reason == "load"


def test_options_map_onto_sampling(client):
    sampled = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7, "num_predict": 8, "repeat_penalty": 1.1,
               "repeat_last_n": -1, "num_ctx": 4096}
    first = client.generate(model=MODEL_NAME, prompt="once upon", options=sampled)
    again = client.generate(model=MODEL_NAME, prompt="once upon", options=sampled)
    assert first.response == again.response and first.eval_count == 8
    stopped = client.generate(model=MODEL_NAME, prompt="once upon", options={**GREEDY, "num_predict": 20})
    word = stopped.response.strip().split()[0] if stopped.response.strip() else None
    if word:
        cut = client.generate(model=MODEL_NAME, prompt="once upon", options={**GREEDY, "num_predict": 20,
                                                                              "stop": [word]})
        assert word not in cut.response and cut.done_reason == "stop"


@pytest.mark.parametrize("fmt", ["json", SCHEMA])
def test_format_constrains_the_reply(client, fmt):
    reply = client.chat(model=MODEL_NAME, messages=MESSAGES, format=fmt, options={"seed": 3, "num_predict": 80,
                                                                                   "temperature": 0.8})
    value = json.loads(reply.message.content)
    if fmt != "json":
        jsonschema.validate(value, SCHEMA)
    else:
        assert isinstance(value, dict)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCRIPT = ["Let me", " check.\n", "<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
          "</tool_call>"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_in_ollamas_shape(start_server, stream):
    live = start_server()
    live.state.generate = scripted_generate(SCRIPT)
    client = ollama.Client(host=live.base_url)
    reply = client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[TOOL],
                        stream=stream)
    parts = list(reply) if stream else [reply]
    calls = [call for part in parts for call in part.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(p.message.content or "" for p in parts).strip() == "Let me check."
    # the call and its result go back in the next turn, in Ollama's shape
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    assert client.chat(model=MODEL_NAME, messages=history, tools=[TOOL]).done


def test_model_routes(client, server):
    names = [m.model for m in client.list().models]
    assert names[0] == MODEL_NAME
    shown = client.show(MODEL_NAME)
    assert shown.details.family == "llama" and "completion" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == server.state.engine.max_model_len
    assert [m.model for m in client.ps().models] == [MODEL_NAME]
    status, _, version = server.request("GET", "/api/version")
    assert status == 200 and version["version"]
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404


def test_embed_matches_v1_embeddings(start_server, async_engine, tmp_path):
    from tiny import make_state
    from tiny_encoder import SENTENCES, build_encoder_dir

    state = make_state(async_engine)
    state.embeddings.load(str(build_encoder_dir(tmp_path / "tiny-bert")))
    live = start_server(state)
    try:
        client = ollama.Client(host=live.base_url)
        reply = client.embed(model="tiny-bert", input=SENTENCES[:2])
        expected = live.client().embeddings.create(model="tiny-bert", input=SENTENCES[:2], encoding_format="float")
        assert len(reply.embeddings) == 2
        for got, want in zip(reply.embeddings, expected.data):
            assert list(got) == pytest.approx(want.embedding, abs=1e-6)
        assert reply.prompt_eval_count == expected.usage.prompt_tokens
        assert "tiny-bert" in [m.model for m in client.list().models]
        assert "embedding" in client.show("tiny-bert").capabilities
        with pytest.raises(ollama.ResponseError) as caught:
            client.embed(model="no-such-model", input="hi")
        assert caught.value.status_code == 404
    finally:
        state.embeddings.stop()


def test_errors_have_ollamas_shape(client, server):
    for options, name in (({"mirostat": 2}, "mirostat"), ({"temperature": 5}, "temperature"),
                          ({"num_predict": 0}, "num_predict"), ({"bogus": 1}, "bogus")):
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model=MODEL_NAME, messages=MESSAGES, options=options)
        assert caught.value.status_code == 400 and f"options.{name}" in caught.value.error
    status, _, body = server.request("POST", "/api/chat", {"model": MODEL_NAME, "messages": MESSAGES,
                                                            "format": "yaml"})
    assert status == 400 and set(body) == {"error"}
    status, _, body = server.request("POST", "/api/generate", {"model": MODEL_NAME, "prompt": "hi", "n": 2})
    assert status == 400 and "'n'" in body["error"]
    status, _, body = server.request("GET", "/api/nothing")
    assert status == 404 and set(body) == {"error"}
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="no-such-model", messages=MESSAGES)
    assert caught.value.status_code == 404


def test_the_api_key_guards_ollamas_routes(start_server):
    live = start_server(api_key="sekret")
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=live.base_url).list()
    assert caught.value.status_code == 401
    keyed = ollama.Client(host=live.base_url, headers={"Authorization": "Bearer sekret"})
    assert keyed.chat(model=MODEL_NAME, messages=MESSAGES, options=GREEDY).done


ODD = [None, True, -1, 0, 1.5, 1e308, 2**70, "x", "", [], [1], ["a", 2], {}, {"a": 1}]
OPTIONS = ["num_predict", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty", "repeat_last_n", "min_p",
           "presence_penalty", "frequency_penalty", "num_ctx", "typical_p", "mirostat"]
FIELDS = ["format", "options", "stream", "think", "tools", "keep_alive", "messages", "logprobs"]


def test_odd_values_are_served_or_a_4xx_in_ollamas_shape(server):
    def check(path, body):
        status, _, reply = server.request("POST", path, body)
        assert status == 200 or 400 <= status < 500, (body, status, reply)
        if status != 200:
            assert set(reply) == {"error"} and isinstance(reply["error"], str), (body, reply)

    base = {"model": MODEL_NAME, "messages": MESSAGES, "stream": False, "options": {"num_predict": 2}}
    for name in OPTIONS:
        for value in ODD:
            check("/api/chat", {**base, "options": {"num_predict": 2, name: value}})
    for name in FIELDS:
        for value in ODD:
            check("/api/chat", {**base, name: value})
            check("/api/generate", {"model": MODEL_NAME, "prompt": "hi", "stream": False,
                                    "options": {"num_predict": 2}, name: value})
    for message in ({"role": "user", "content": "hi", "images": ["@@"]}, {"role": "user", "content": 5},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": 1}]}, "hi"):
        check("/api/chat", {**base, "messages": [message]})


def test_chat_is_parsed_once_at_the_edge(server, monkeypatch):
    """Messages, tools and the tool choice (Ollama has none: "auto") are typed by OllamaChatRequest; below it the
    tool choice is never parsed from the client's JSON again, and a bad tool is a 400 before the model is
    looked up."""
    from tfserve.server.requests.ollama import OllamaChatRequest
    from tfserve.server.tools import tool_choice

    typed = OllamaChatRequest.parse({"model": MODEL_NAME, "messages": MESSAGES, "tools": [TOOL]})
    assert typed.messages.rendered == MESSAGES and typed.function_tools == [TOOL]
    assert typed.tool_choice == tool_choice.ToolChoice()
    raw_parses = []
    real = tool_choice.ToolChoice.parse.__func__

    def spy(cls, value, where="tool_choice"):
        if not isinstance(value, tool_choice.ToolChoice):
            raw_parses.append(value)
        return real(cls, value, where)

    monkeypatch.setattr(tool_choice.ToolChoice, "parse", classmethod(spy))
    status, _, reply = server.request("POST", "/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "tools": [TOOL],
                                                            "stream": False, "options": {"num_predict": 2}})
    assert status == 200 and reply["done"] and raw_parses == []
    status, _, reply = server.request("POST", "/api/chat", {"model": "no-such-model", "messages": MESSAGES,
                                                            "tools": [{"type": "retrieval"}]})
    assert status == 400 and "tools[0]" in reply["error"]
    status, _, reply = server.request("POST", "/api/chat", {"model": MODEL_NAME, "messages": MESSAGES, "tools": [TOOL],
                                                            "tool_choice": "required"})
    assert status == 400 and "'tool_choice'" in reply["error"]  # not Ollama's: refused, never dropped unseen


def test_generate_names_its_own_fields(server):
    status, _, reply = server.request("POST", "/api/generate", {"model": MODEL_NAME, "prompt": "hi", "images": [5]})
    assert status == 400 and reply["error"].startswith("images[0]")
