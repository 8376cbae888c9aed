"""TGI's API on the tiny live server, driven by huggingface_hub's `InferenceClient` as its users drive it:
`text_generation` (whole and streamed, `details`, `grammar`), `chat_completion` with TGI's `response_format`
(`value` holds the schema), and raw requests for the SSE framing and TGI's error shape."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tiny import MODEL_NAME

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
          "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}


@pytest.fixture
def client(server, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # the tests' offline mode; this is localhost
    return InferenceClient(model=server.base_url)


def test_text_generation_whole_and_streamed_agree(client):
    text = client.text_generation("hello world", max_new_tokens=6)  # greedy: TGI's default without do_sample
    assert isinstance(text, str) and text
    assert "".join(client.text_generation("hello world", max_new_tokens=6, stream=True)) == text
    again = client.text_generation("hello world", max_new_tokens=6, return_full_text=True)
    assert again == "hello world" + text


def test_details_count_tokens_and_say_why_it_ended(client, tokenizer):
    out = client.text_generation("hello world", max_new_tokens=5, details=True, decoder_input_details=True,
                                 do_sample=True, seed=3, top_n_tokens=2)
    details = out.details
    assert details.finish_reason in ("length", "eos_token")
    assert details.generated_tokens == len(details.tokens) or details.finish_reason == "eos_token"
    assert details.seed == 3
    assert [t.id for t in details.prefill] == tokenizer.encode("hello world", add_special_tokens=True)
    assert details.prefill[0].logprob is None and all(t.logprob <= 0 for t in details.prefill[1:])
    assert all(t.logprob <= 0 for t in details.tokens)
    assert all(len(top) == 2 for top in details.top_tokens)
    sampled_again = client.text_generation("hello world", max_new_tokens=5, do_sample=True, seed=3)
    assert sampled_again == out.generated_text


def test_streamed_details_end_with_the_whole_text(client):
    events = list(client.text_generation("once upon a time", max_new_tokens=5, stream=True, details=True))
    assert [e.generated_text for e in events[:-1]] == [None] * (len(events) - 1)
    final = events[-1]
    assert final.generated_text == "".join(e.token.text for e in events)
    assert final.details.finish_reason in ("length", "eos_token")
    assert final.details.generated_tokens == len(events)


def test_sse_is_framed_as_tgi_frames_it(server):
    status, headers, raw = server.request("POST", "/generate_stream", {"inputs": "hello", "parameters": {
        "max_new_tokens": 3}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    lines = [line for line in raw.split("\n\n") if line]
    assert all(line.startswith("data:{") for line in lines)
    events = [json.loads(line[5:]) for line in lines]
    assert events[0]["generated_text"] is None and events[0]["details"] is None
    assert set(events[0]["token"]) == {"id", "text", "logprob", "special"}
    assert isinstance(events[-1]["generated_text"], str)


@pytest.mark.parametrize("grammar", [{"type": "json", "value": SCHEMA},
                                     {"type": "regex", "value": "[0-9]{3}-[a-z]{2}"}])
def test_grammar_constrains_the_text(client, grammar):
    text = client.text_generation("answer:", max_new_tokens=40, grammar=grammar, do_sample=True, seed=1)
    if grammar["type"] == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(grammar["value"], text)


@pytest.mark.parametrize("kind", ["json_object", "json"])
def test_chat_completion_takes_tgis_response_format(server, client, kind):
    from huggingface_hub import InferenceClient

    chat = InferenceClient(base_url=f"{server.base_url}/v1")
    reply = chat.chat_completion(messages=[{"role": "user", "content": "Weather?"}], max_tokens=60, seed=2,
                                 temperature=0.8, response_format={"type": kind, "value": SCHEMA})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_info_says_the_model_and_its_limits(server):
    status, _, info = server.request("GET", "/info")
    assert status == 200
    assert info["model_id"] == MODEL_NAME
    assert info["max_total_tokens"] == server.state.engine.max_model_len


def test_errors_have_tgis_shape(client, server):
    from huggingface_hub.errors import ValidationError

    with pytest.raises(ValidationError):
        client.text_generation("hi", max_new_tokens=4, watermark=True)
    for parameters in ({"best_of": 2}, {"typical_p": 0.5}, {"temperature": 9}, {"nonsense": 1},
                       {"grammar": {"type": "regex", "value": "("}}):
        status, _, body = server.request("POST", "/generate", {"inputs": "hi", "parameters": parameters})
        assert status == 422, parameters
        assert body["error_type"] == "validation" and "parameters." in body["error"], body
    assert server.request("POST", "/generate", {"parameters": {}})[0] == 422
    assert server.request("POST", "/generate", {"inputs": "hi", "n": 2})[0] == 422


def test_the_api_key_guards_tgis_routes(start_server):
    live = start_server(api_key="sekret")
    for method, path in (("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/"), ("GET", "/info")):
        status, _, body = live.request(method, path, {"inputs": "hi"})
        assert status == 401 and body["error_type"] == "authentication"
    ok = live.request("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                      headers={"Authorization": "Bearer sekret"})
    assert ok[0] == 200 and isinstance(ok[2]["generated_text"], str)


ODD = [None, True, -1, 0, 1.5, 1e308, 2**70, "x", "", [], [1], ["a", 2], {}, {"type": "json"}, {"a": 1}]
FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty",
          "frequency_penalty", "do_sample", "details", "decoder_input_details", "return_full_text", "grammar",
          "top_n_tokens", "truncate", "best_of", "typical_p", "watermark"]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_odd_parameters_are_served_or_a_422_in_tgis_shape(server, path):
    for name in FIELDS:
        for value in ODD:
            parameters = {"max_new_tokens": 2, name: value}
            status, _, body = server.request("POST", path, {"inputs": "hi", "parameters": parameters})
            assert status in (200, 422), (name, value, status, body)
            if status == 422:
                assert set(body) == {"error", "error_type"} and body["error_type"] == "validation", (name, value)
    for whole in ({"inputs": 5}, {"inputs": ""}, {"inputs": "hi", "parameters": []}, [], "x"):
        status, _, body = server.request("POST", path, whole)
        assert status == 422 and body["error_type"] == "validation", whole
