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
from tfserve.server.requests.tgi import TgiRequest
from tfserve.server.tool_choice import ToolChoice

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
