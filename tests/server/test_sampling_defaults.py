"""Request fields left out take the model's generation_config (as vLLM's --generation-config auto)."""

from __future__ import annotations

from tiny import MODEL_NAME

MESSAGES = [{"role": "user", "content": "hello there"}]


def test_absent_fields_take_the_models_defaults(server, engine, monkeypatch):
    monkeypatch.setattr(engine, "sampling_defaults", {"max_tokens": 3, "temperature": 0.0})
    client = server.client()
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert first.usage.completion_tokens == 3 and first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content == again.choices[0].message.content  # greedy by default


def test_fields_the_request_sends_win(server, engine, monkeypatch):
    monkeypatch.setattr(engine, "sampling_defaults", {"max_tokens": 3, "temperature": 0.0})
    client = server.client()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5
    streamed = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4, temperature=None,
                                         extra_body={"ignore_eos": True})
    assert streamed.usage.completion_tokens == 4
