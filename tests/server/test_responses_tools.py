"""/v1/responses with function tools, enforced tool choice, text.format and previous_response_id, through the
openai SDK; every object and event checked against OpenAI's published schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_openapi import check, event_schemas, stream

from tiny import MODEL_NAME

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                       "required": ["city"], "additionalProperties": False}}
FORCED = {"model": MODEL_NAME, "input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required",
          "parallel_tool_calls": False, "temperature": 0.9, "max_output_tokens": 80, "extra_body": {"seed": 3}}


def follow_up_prompt_ids(tokenizer, call) -> list[int]:
    """The prompt of a turn that answers `call` (get_weather, Paris) with "sunny, 21 C", as the chat template
    renders it: the first question, the call, the tool's answer."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)["input_ids"]


def raw(body: dict) -> dict:
    """An SDK call's keyword arguments as a raw body (extra_body merged in)."""
    body = dict(body)
    return {**body, **body.pop("extra_body", {})}


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verdict: bool
    score: int = Field(ge=0, le=9)


def test_forced_call_is_a_function_call_item(server):
    response = server.client().responses.create(**FORCED)
    assert response.status == "completed"
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), TOOL["parameters"])
    check("Response", server.request("POST", "/v1/responses", raw(FORCED))[2])


def test_forced_call_streams_argument_deltas(server):
    events = stream(server, "/v1/responses", {**raw(FORCED), "stream": True})
    for event in events:
        check(event_schemas()[event["type"]], event)
    kinds = [e["type"] for e in events]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "function_call"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done["arguments"]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed" and final["output"][0]["arguments"] == done["arguments"]


def test_text_format_and_tools_together(server, tokenizer):
    """A call or the formatted answer, as on chat; a forced call whatever text.format says."""
    text = {"format": {"type": "json_schema", "name": "answer", "schema": Answer.model_json_schema()}}
    opening = tokenizer.encode("<", add_special_tokens=False)[0]
    client = server.client()
    called = client.responses.create(**{**FORCED, "tool_choice": "auto", "text": text,
                                        "extra_body": {"seed": 3, "logit_bias": {str(opening): 100}}})
    assert called.output[0].type == "function_call" and called.output[0].name == "get_weather"
    forced = client.responses.create(**{**FORCED, "text": text})
    assert forced.output[0].type == "function_call"
    jsonschema.validate(json.loads(forced.output[0].arguments), TOOL["parameters"])


def test_named_tool_choice_in_the_responses_shape(server):
    other = {**TOOL, "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                                        "required": ["zone"]}}
    response = server.client().responses.create(**{**FORCED, "tools": [TOOL, other],
                                                   "tool_choice": {"type": "function", "name": "get_time"}})
    (item,) = response.output
    assert item.name == "get_time" and json.loads(item.arguments) == {"zone": "UTC"}


def test_allowed_tools_choice_calls_only_the_listed_tools(server, tokenizer):
    """Both tools reach the template; a call must be of the allowed one, on /v1/responses and on chat."""
    other = {**TOOL, "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                                                        "required": ["zone"]}}
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    client = server.client()
    for seed in range(3):
        response = client.responses.create(**{**FORCED, "tools": [TOOL, other], "tool_choice": choice,
                                              "extra_body": {"seed": seed}})
        assert [item.name for item in response.output] == ["get_time"]
    both = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (TOOL, other)]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=both, max_tokens=80,
        parallel_tool_calls=False, seed=1, temperature=0.9,
        tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}})
    assert [call.function.name for call in reply.choices[0].message.tool_calls] == ["get_time"]
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}], tools=both, add_generation_prompt=True,
        tokenize=True)["input_ids"])


def test_text_format_json_schema_through_the_parse_helper(server):
    response = server.client().responses.parse(model=MODEL_NAME, input="Is it sunny?", text_format=Answer,
                                               temperature=0.7, extra_body={"seed": 1}, max_output_tokens=60)
    assert isinstance(response.output_parsed, Answer)


def test_previous_response_id_continues_the_conversation(server, tokenizer):
    client = server.client()
    first = client.responses.create(**FORCED)
    call = first.output[0]
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=follow, tools=[TOOL],
                                      max_output_tokens=3, temperature=0)
    assert second.previous_response_id == first.id
    # the prompt is the whole conversation: the first turn, its call, the tool's answer
    assert second.usage.input_tokens == len(follow_up_prompt_ids(tokenizer, call))
    third = client.responses.create(model=MODEL_NAME, previous_response_id=second.id, input="thanks", tools=[TOOL],
                                    max_output_tokens=2, temperature=0)  # tools are sent again each turn, as OpenAI
    assert third.usage.input_tokens > second.usage.input_tokens


def test_reasoning_items_sent_back_are_read_past(server, tokenizer):
    """`input += response.output` of a reasoning model sends its reasoning items back, as OpenAI takes them
    (they were a 400): the prompt is the conversation without them, as chat templates drop earlier thinking."""
    history = [{"role": "user", "content": "hi"},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                                     "annotations": []}]},
               {"role": "user", "content": "bye"}]
    response = server.client().responses.create(model=MODEL_NAME, input=history, max_output_tokens=2, temperature=0)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Hello"},
                                              {"role": "user", "content": "bye"}],
                                             add_generation_prompt=True, tokenize=True)
    assert response.usage.input_tokens == len(expected["input_ids"])


def test_instructions_lead_their_turn_only(server, tokenizer):
    """A response's instructions are not carried over to the next (OpenAI's rule): the next turn's prompt is the
    conversation alone, or under its own instructions."""
    client = server.client()
    first = client.responses.create(model=MODEL_NAME, input="hi", instructions="Talk like a pirate.",
                                    max_output_tokens=2, temperature=0)
    said = first.output_text

    def prompt_length(messages):
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": said},
               {"role": "user", "content": "again"}]
    second = client.responses.create(model=MODEL_NAME, input="again", previous_response_id=first.id,
                                     max_output_tokens=2, temperature=0)
    assert second.instructions is None and second.usage.input_tokens == prompt_length(history)
    third = client.responses.create(model=MODEL_NAME, input="again", previous_response_id=first.id,
                                    instructions="Be brief.", max_output_tokens=2, temperature=0)
    assert third.usage.input_tokens == prompt_length([{"role": "system", "content": "Be brief."}] + history)


def test_truncation_auto_drops_the_oldest_turns_to_fit(server, engine):
    client = server.client()
    long = "hello world " * (engine.max_model_len // 8)  # a turn of about a third of the context
    previous = None
    for _ in range(3):  # together past the context
        previous = client.responses.create(model=MODEL_NAME, input=long, previous_response_id=previous,
                                           truncation="auto", instructions="Be brief.", max_output_tokens=2,
                                           temperature=0).id
    status, _, error = server.request("POST", "/v1/responses", {
        "model": MODEL_NAME, "input": long, "previous_response_id": previous, "max_output_tokens": 2})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"  # "disabled", the default
    response = client.responses.create(model=MODEL_NAME, input=long, previous_response_id=previous,
                                       truncation="auto", max_output_tokens=2, temperature=0)
    assert response.truncation == "auto" and response.output_text is not None
    one_turn = client.responses.create(model=MODEL_NAME, input=long, max_output_tokens=2).usage.input_tokens
    assert 2 * one_turn < response.usage.input_tokens < engine.max_model_len  # the newest turns, as many as fit
    status, _, error = server.request("POST", "/v1/responses", {  # one turn alone too long: nothing to drop
        "model": MODEL_NAME, "input": long * 4, "truncation": "auto", "max_output_tokens": 2})
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"


def test_store_false_is_not_kept(server):
    response = server.client().responses.create(model=MODEL_NAME, input="hi", store=False, max_output_tokens=2)
    status, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "again",
                                                                "previous_response_id": response.id})
    assert status == 400 and error["error"]["param"] == "previous_response_id"  # as OpenAI: the field is bad
    check("ErrorResponse", error)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    # an output must answer a call: of this input, or of the previous response
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "b", "output": "x"}]}, "input[1].call_id"),
])
def test_bad_tools_and_formats_are_400s(server, body, param):
    status, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "hi", **body})
    assert status == 400 and error["error"]["param"] == param, error


def test_a_repeated_call_ends_the_response(server):
    body = {**FORCED, "parallel_tool_calls": True, "temperature": 0, "extra_body": {}}
    response = server.client().responses.create(**body)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    assert response.usage.output_tokens < 80
    events = stream(server, "/v1/responses", {**raw(body), "stream": True})
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["function_call"]
    assert events[-1]["type"] == "response.completed"


def test_input_tokens_count_what_the_response_would_read(server, tokenizer, engine):
    """POST /v1/responses/input_tokens (the SDK's `responses.input_tokens.count`): the first turn's prompt of the
    same body, instructions, tools and previous response included, without running the model."""
    client = server.client()
    body = {"model": MODEL_NAME, "input": "Weather in Paris?", "instructions": "Be brief.", "tools": [TOOL]}
    count = client.responses.input_tokens.count(**body)
    assert count.object == "response.input_tokens"
    steps = engine.num_steps
    created = client.responses.create(**body, max_output_tokens=2, temperature=0)
    assert count.input_tokens == created.usage.input_tokens
    follow = client.responses.input_tokens.count(model=MODEL_NAME, input="and Rome?", previous_response_id=created.id)
    history = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": created.output_text},
               {"role": "user", "content": "and Rome?"}]
    expected = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert follow.input_tokens == len(expected)
    assert engine.num_steps - steps == 2  # the two of the response created: counting runs nothing
    status, _, error = server.request("POST", "/v1/responses/input_tokens", {"model": MODEL_NAME, "input": 3})
    assert status == 400 and error["error"]["param"] == "input"


def test_item_references_name_stored_items(server):
    """`{"type": "item_reference", "id": ...}` stands for an input or output item of a stored response: the
    prompt is the one the items themselves give; an id no stored response has is a 400 naming it."""
    client = server.client()
    first = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=3, temperature=0)
    asked = client.responses.input_items.list(first.id).data[0]
    (said,) = first.output
    explicit = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "again"}]
    referenced = [{"type": "item_reference", "id": asked.id}, {"type": "item_reference", "id": said.id},
                  {"role": "user", "content": "again"}]
    expected = client.responses.input_tokens.count(model=MODEL_NAME, input=explicit).input_tokens
    assert client.responses.input_tokens.count(model=MODEL_NAME, input=referenced).input_tokens == expected
    second = client.responses.create(model=MODEL_NAME, input=referenced, max_output_tokens=2, temperature=0)
    assert second.usage.input_tokens == expected
    assert [item.type for item in client.responses.input_items.list(second.id, order="asc").data] == ["message"] * 3
    status, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": [
        {"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_nowhere"}]})
    assert status == 400 and error["error"]["param"] == "input[1].id" and "msg_nowhere" in error["error"]["message"]
