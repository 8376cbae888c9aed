"""A reply is capped by default (a small model sampling freely can otherwise run to the end of its
context), through a server and in-process; a cap the context cannot hold falls back to what it leaves."""

from __future__ import annotations

from tiny import MODEL_NAME

from tfserve.chat import client as client_module
from tfserve.chat import local as local_module
from tfserve.chat.conversation import Settings

MESSAGES = [{"role": "user", "content": "hello"}]


def reply_stats(backend, settings: Settings):
    reply = backend.stream(MESSAGES, settings)
    text = "".join(reply)
    return reply.stats, text


def test_remote_replies_are_capped_by_default(backend, engine, monkeypatch):
    monkeypatch.setattr(client_module, "DEFAULT_MAX_TOKENS", 3)
    monkeypatch.setattr(engine, "eos_token_ids", frozenset())  # only the cap can end the reply
    stats, _ = reply_stats(backend, Settings(temperature=0.0))
    assert (stats.num_completion_tokens, stats.finish_reason) == (3, "length")


def test_remote_cap_beyond_the_context_falls_back_to_what_it_leaves(backend, engine, monkeypatch):
    # the tiny model's context is 512 tokens: the default cap of 1024 cannot fit, an explicit one is an error
    assert engine.max_model_len < client_module.DEFAULT_MAX_TOKENS
    monkeypatch.setattr(engine, "eos_token_ids", frozenset())
    stats, _ = reply_stats(backend, Settings(temperature=0.0))
    assert stats.finish_reason == "length"
    assert stats.num_prompt_tokens + stats.num_completion_tokens == engine.max_model_len


def test_in_process_replies_are_capped_by_default(async_engine, engine, monkeypatch):
    monkeypatch.setattr(local_module, "DEFAULT_MAX_TOKENS", 4)
    monkeypatch.setattr(engine, "eos_token_ids", frozenset())
    backend = local_module.LocalBackend(async_engine.manager, MODEL_NAME)
    stats, _ = reply_stats(backend, Settings(temperature=0.0))
    assert (stats.num_completion_tokens, stats.finish_reason) == (4, "length")
    stats, _ = reply_stats(backend, Settings(temperature=0.0, max_tokens=6))
    assert stats.num_completion_tokens == 6
