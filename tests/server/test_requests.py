"""Typed requests without a server: a body parsed once (aliases, the one table of ranges, unknown fields), errors
that carry their field, and `tool_choice` parsed into one object."""

from __future__ import annotations

import pickle

import pytest

from tfserve.errors import ContextLengthError, GrammarFailed, ParamError
from tfserve.sampling_params import RANGES, SamplingParams
from tfserve.server.errors import ApiError, from_value_error
from tfserve.server.requests.chat import ChatCompletionRequest
from tfserve.server.requests.completions import CompletionRequest
from tfserve.server.requests.ollama import OllamaOptions
from tfserve.server.requests.responses import ResponseRequest
from tfserve.server.requests.tgi import TgiRequest
from tfserve.server.tools.tool_choice import ToolChoice

MESSAGES = [{"role": "user", "content": "hi"}]


def parse_error(model, body, where=""):
    with pytest.raises(ApiError) as error:
        model.parse(body, where) if where else model.parse(body)
    return error.value


def test_max_tokens_aliases_resolve_once():
    chat = ChatCompletionRequest.parse({"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 3})
    assert chat.to_sampling_kwargs()["max_tokens"] == 3 and chat.names["max_tokens"] == "max_completion_tokens"
    assert ChatCompletionRequest.parse({"messages": MESSAGES}).to_sampling_kwargs()["max_tokens"] is None
    assert CompletionRequest.parse({"prompt": "x"}).to_sampling_kwargs()["max_tokens"] == 16
    scored = CompletionRequest.parse({"prompt": "x", "max_tokens": 0})  # reads the prompt only
    assert scored.score_only and scored.to_sampling_kwargs()["max_tokens"] == 1


def test_the_edge_and_the_engine_say_a_range_in_the_same_words():
    error = parse_error(ChatCompletionRequest, {"messages": MESSAGES, "top_p": 1.5})
    with pytest.raises(ParamError) as engine_error:
        SamplingParams(top_p=1.5)
    assert error.param == engine_error.value.param == "top_p"
    assert error.message == str(engine_error.value) == f"top_p must be {RANGES['top_p'].what()} (got 1.5)"
    # the API takes less than the engine runs: a temperature of 5 is the engine's, not OpenAI's
    assert SamplingParams(temperature=5).temperature == 5
    assert parse_error(ChatCompletionRequest, {"messages": MESSAGES, "temperature": 5}).param == "temperature"


def test_an_error_names_the_field_as_the_client_sent_it():
    error = parse_error(ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 0})
    assert error.param == "max_completion_tokens" and error.message.startswith("max_completion_tokens must be")
    nested = parse_error(TgiRequest, {"inputs": "x", "parameters": {"stop": [""]}})
    assert nested.param == "parameters.stop" and nested.message.startswith("parameters.stop must be")
    aliased = parse_error(OllamaOptions, {"repeat_penalty": 5}, "options")
    assert aliased.param == "options.repeat_penalty" and "options.repeat_penalty must be" in aliased.message
    typed = parse_error(ChatCompletionRequest, {"messages": MESSAGES, "n": "2"})
    assert typed.param == "n" and typed.message == "n must be an integer, not a string"


@pytest.mark.parametrize("model,body,where,param", [
    (ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 0}, "", "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": -3}, "", "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": -1}, "", "max_tokens"),
    (ResponseRequest, {"input": "hi", "max_output_tokens": 0}, "", "max_output_tokens"),
    (TgiRequest, {"inputs": "x", "parameters": {"max_new_tokens": 0}}, "", "parameters.max_new_tokens"),
    (OllamaOptions, {"num_predict": 0}, "options", "options.num_predict")])
def test_max_tokens_is_checked_by_sampling_params_under_the_name_sent(model, body, where, param):
    error = parse_error(model, body, where)
    assert error.param == param and error.message.startswith(f"{param} must be an integer >= 1"), error.message


def test_sampling_params_is_the_one_place_that_checks_max_tokens(monkeypatch):
    checked = []
    real = SamplingParams.__post_init__
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: checked.append(self.max_tokens) or real(self))
    assert ChatCompletionRequest.parse({"messages": MESSAGES, "max_completion_tokens": 7}) and checked == [7]
    error = parse_error(ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": 2, "min_tokens": 5})
    assert error.param == "min_tokens" and "max_completion_tokens" in error.message  # a rule of two fields too
    assert OllamaOptions.parse({"num_predict": -1}).to_sampling_kwargs()["max_tokens"] is None  # Ollama's no limit
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: None)  # the edge has no check of its own
    assert ChatCompletionRequest.parse({"messages": MESSAGES, "max_completion_tokens": 0}).max_completion_tokens == 0
    assert ResponseRequest.parse({"input": "hi", "max_output_tokens": -5}).max_output_tokens == -5


def test_legacy_functions_are_typed_and_their_errors_named_as_sent():
    chat = ChatCompletionRequest.parse({"messages": MESSAGES, "functions": [{"name": "f"}],
                                        "function_call": {"name": "f"}})
    assert chat.legacy and chat.tool_choice.function == "f" and not chat.parallel
    assert chat.parameters_fields == {"f": "functions[0].parameters"}
    error = parse_error(ChatCompletionRequest, {"messages": MESSAGES, "functions": [{"name": "a b"}]})
    assert error.param == "functions[0].name" and "tools" not in error.message, error.message
    assert not ChatCompletionRequest.parse({"messages": MESSAGES}).legacy


def test_engine_errors_map_by_type_not_text():
    names = {"max_tokens": "max_completion_tokens", "prompt": "messages"}
    with pytest.raises(ParamError) as error:
        SamplingParams(max_tokens=2, min_tokens=5)
    body = from_value_error(error.value, names=names)
    assert body.param == "min_tokens" and "max_completion_tokens" in body.message
    context = ContextLengthError("you asked {max_tokens} tokens", param="max_tokens")
    body = from_value_error(context, names=names)
    assert (body.param, body.code, body.message) == ("max_completion_tokens", "context_length_exceeded",
                                                     "you asked max_completion_tokens tokens")
    assert from_value_error(ValueError("max_tokens: anything"), "messages", names).param == "messages"


def test_typed_errors_survive_a_process_boundary():
    context = pickle.loads(pickle.dumps(ContextLengthError("past {max_tokens}", param="max_tokens")))
    assert isinstance(context, ContextLengthError) and context.message({"max_tokens": "m"}) == "past m"
    failed = pickle.loads(pickle.dumps(GrammarFailed("too many items")))
    assert str(failed) == "the output grammar failed: too many items"


def test_tool_choice_is_parsed_into_one_object():
    chat = ChatCompletionRequest.parse({"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "ping"}}], "tool_choice": {"type": "function",
                                                                             "function": {"name": "ping"}}})
    choice = chat.tool_choice
    assert isinstance(choice, ToolChoice) and (choice.mode, choice.function) == ("required", "ping")
    assert choice.function_param == "tool_choice.function.name" and choice.after_first_turn().mode == "auto"
    assert ToolChoice.parse(choice) is choice and ToolChoice.parse(None).mode == "auto"
    assert parse_error(ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": 3}).param == "tool_choice"


def test_ollama_show_and_embed_bodies_are_typed():
    from tfserve.server.requests.ollama import OllamaEmbedRequest, OllamaShowRequest

    assert OllamaShowRequest.parse({"name": "m:latest"}).model_name == "m"
    assert OllamaShowRequest.parse({"model": "m", "name": "other"}).model_name == "m"
    assert parse_error(OllamaShowRequest, {}).param == "model"
    embed = OllamaEmbedRequest.parse({"model": "e", "input": ["a"], "dimensions": 8})
    assert (embed.model_name, embed.input, embed.truncate, embed.dimensions) == ("e", ["a"], None, 8)
    assert parse_error(OllamaEmbedRequest, {"model": "e", "dimensions": 0}).param == "dimensions"
    assert parse_error(OllamaEmbedRequest, {"model": "e", "truncate": "yes"}).param == "truncate"
    assert parse_error(OllamaEmbedRequest, {"model": "e", "options": {"num_ctx": 8}}).param == "options"


def test_conversation_bodies_are_typed():
    from tfserve.server.requests.conversations import (MAX_ITEMS, ConversationCreateRequest,
                                                       ConversationItemsRequest, ConversationUpdateRequest)

    created = ConversationCreateRequest.parse({"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}})
    assert [item["type"] for item in created.stored_items] == ["message"] and created.metadata == {"k": "v"}
    assert ConversationCreateRequest.parse({}).stored_items == []
    assert parse_error(ConversationCreateRequest, {"items": [{}] * (MAX_ITEMS + 1)}).param == "items"
    assert parse_error(ConversationCreateRequest, {"items": [{"role": "nobody", "content": "x"}]}).param == \
        "items[0].role"
    assert parse_error(ConversationUpdateRequest, {}).param == "metadata"
    assert ConversationUpdateRequest.parse({"metadata": None}).metadata is None
    assert parse_error(ConversationItemsRequest, {}).param == "items"
