"""A Responses request's `input` is parsed once, at the edge, into typed items (requests/input_items.py); an item
read back from a store (an `item_reference`'s, a conversation's, a pending approval) is parsed the same way when
it is read, so the handler and the Responses builder read typed items only."""

from __future__ import annotations


import pytest

from test_responses_tools import FORCED, TOOL, follow_up_prompt_ids
from tiny import MODEL_NAME

from tfserve.server.api.response_items import input_items, parse_input
from tfserve.server.errors import ApiError
from tfserve.server.requests.input_items import (FunctionCallItem, FunctionCallOutputItem, ItemReference, MessageItem,
                                                 parse_item, parse_items)
from tfserve.server.requests.responses import ResponseRequest



def test_the_request_holds_typed_items():
    typed = ResponseRequest.parse({"model": "m", "input": [
        {"role": "user", "content": "hi", "status": None},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done", "id": "fco_1"},
        {"type": "item_reference", "id": "msg_1"}]})
    assert [type(item) for item in typed.input] == [MessageItem, FunctionCallItem, FunctionCallOutputItem,
                                                    ItemReference]
    assert typed.input[0].role == "user" and typed.input[2].id == "fco_1"
    assert typed.input[0].sent == {"role": "user", "content": "hi", "status": None}  # listed back as sent
    assert ResponseRequest.parse({"model": "m", "input": "hi"}).input == "hi"


@pytest.mark.parametrize("items, param", [
    (None, "input"), ([], "input"), (5, "input"), ([5], "input[0]"), ([{"type": "nope"}], "input[0].type"),
    ([{"role": "user"}], "input[0].content"), ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": 5}], "input[0].content"), ([{"role": "user", "content": "x", "id": 5}], "input[0].id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], "input[0].arguments"),
    ([{"type": "mcp_approval_response", "approval_request_id": "r"}], "input[0].approve"),
    ([{"type": "item_reference"}], "input[0].id"),
])
def test_a_bad_item_is_a_400_naming_its_field_at_parse_time(items, param):
    with pytest.raises(ApiError) as caught:
        ResponseRequest.parse({"model": "m", "input": items})
    assert caught.value.status == 400 and caught.value.param == param


def test_a_conversation_takes_no_item_reference():
    with pytest.raises(ApiError) as caught:
        parse_items([{"type": "item_reference", "id": "x"}], "items", references=False)
    assert caught.value.param == "items[0].type" and "item_reference" not in caught.value.message.split("send")[1]


def test_stored_output_items_read_back_as_typed_items():
    """What a response returned (an assistant message with output_text parts, a call) read as input again."""
    said = {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]}
    call = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    items = [parse_item(said, "input[0]"), parse_item(call, "input[1]"),
             parse_item({"type": "function_call_output", "call_id": "call_1", "output": "sunny"}, "input[2]")]
    messages, images = parse_input(items)
    assert messages == [{"role": "assistant", "content": "Let me check."},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert images == []
    listed = input_items(items)
    assert listed[0] == said and listed[1] == call and listed[2]["id"].startswith("item_")


def test_a_bad_input_is_refused_before_a_model_is_named(server):
    """Parsed at the edge: the item's 400 comes whatever the model, before the model is looked up."""
    status, _, error = server.request("POST", "/v1/responses", {"model": "no-such-model", "input": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]})
    assert status == 400 and error["error"]["param"] == "input[0].call_id"


def test_a_referenced_stored_call_is_answered_by_a_function_call_output(server, tokenizer):
    """The first response's call, named by an item_reference (read back from the store, typed), then its output."""
    client = server.client()
    first = client.responses.create(**FORCED)
    call = first.output[0]
    assert call.type == "function_call"
    follow = [{"role": "user", "content": "Weather in Paris?"}, {"type": "item_reference", "id": call.id},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=MODEL_NAME, input=follow, tools=[TOOL], max_output_tokens=3,
                                     temperature=0)
    assert second.usage.input_tokens == len(follow_up_prompt_ids(tokenizer, call))
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].id == call.id  # the stored item, as it was stored


def test_a_conversations_stored_call_is_answered_by_a_function_call_output(server):
    """A call stored in a conversation (the first response's output) read back typed, then answered."""
    client = server.client()
    conversation = client.conversations.create()
    first = client.responses.create(**{**FORCED, "conversation": conversation.id})
    call = first.output[0]
    second = client.responses.create(model=MODEL_NAME, conversation=conversation.id, tools=[TOOL],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], max_output_tokens=2, temperature=0)
    assert second.status in ("completed", "incomplete")
    kinds = [item.type for item in client.conversations.items.list(conversation.id, order="asc").data]
    assert kinds[:3] == ["message", "function_call", "function_call_output"]
    status, _, error = server.request("POST", "/v1/responses", {
        "model": MODEL_NAME, "conversation": conversation.id, "input": [
            {"type": "function_call_output", "call_id": "call_unknown", "output": "x"}]})
    assert status == 400 and error["error"]["param"] == "input[0].call_id"
