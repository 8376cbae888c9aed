"""/v1/responses with `mcp` tools against real MCP servers (tests/mcp/toy_server.py over stdio and streamable
HTTP): listing, calls forced on the tiny model, the loop over scripted turns, approvals, budgets, and every
failure as an item or an OpenAI error body; objects and events checked against OpenAI's published schema."""

from __future__ import annotations

import json
import threading

import pytest
from mcp_servers import toy_http_server, toy_stdio_config
from test_openapi import check, event_schemas, stream

from tiny import MODEL_NAME, make_state, scripted_generate

# two tools: the tiny model's context (512 tokens) holds the template's tool list
TOY = {"type": "mcp", "server_label": "toy", "require_approval": "never", "allowed_tools": ["echo", "add"]}
# pick's one argument is an enum: the random-weight model's forced call always finishes
FORCED = {"model": MODEL_NAME, "input": "Pick a colour.", "tools": [{**TOY, "allowed_tools": ["echo", "pick"]}],
          "tool_choice": {"type": "mcp", "server_label": "toy", "name": "pick"}, "parallel_tool_calls": False,
          "temperature": 0, "max_output_tokens": 40}


def mcp_server(start_server, async_engine, **options):
    """A server over the shared engine with the toy MCP server configured as "toy" (stdio)."""
    return start_server(_state(async_engine, **options))


@pytest.fixture(scope="module")
def toy_server(async_engine):
    from tiny import LiveServer

    live = LiveServer(_state(async_engine))
    yield live
    live.close()


def _state(async_engine, **options):
    from tfserve.mcp.config import parse_mcp_config
    from tfserve.server.tools.mcp_tools import McpOptions

    configs = parse_mcp_config({"mcpServers": {"toy": toy_stdio_config()}})
    return make_state(async_engine, mcp=McpOptions(configs=configs, **options))


def call_text(name: str, arguments: dict) -> str:
    """A Hermes tool call as the tiny model's template family writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class Turns:
    """A scripted model: each engine request (one per turn) gets the next script; the prompts are kept."""

    def __init__(self, tokenizer, *scripts: list[str]) -> None:
        self.tokenizer, self.scripts, self.prompts = tokenizer, list(scripts), []
        self.lock = threading.Lock()

    def __call__(self, request):
        with self.lock:
            self.prompts.append(self.tokenizer.decode(request.prompt_token_ids))
            script = self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]
        return scripted_generate(script)(request)


def test_forced_call_on_the_tiny_model_lists_calls_and_answers(toy_server):
    response = toy_server.client().responses.create(**FORCED)
    listing, called = response.output[0], response.output[1]
    assert listing.type == "mcp_list_tools" and listing.server_label == "toy" and listing.error is None
    assert [tool.name for tool in listing.tools] == ["echo", "pick"]
    echo = next(tool for tool in listing.tools if tool.name == "echo")
    assert echo.input_schema["properties"]["text"]["type"] == "string"
    assert called.type == "mcp_call" and called.name == "pick" and called.server_label == "toy"
    assert called.status == "completed" and called.error is None
    assert called.output == f"picked {json.loads(called.arguments)['color']}"  # what the real server answered
    assert response.output[-1].type == "message"  # the model's turn after the result
    assert response.usage.output_tokens > 0
    _, _, body = toy_server.request("POST", "/v1/responses", FORCED)
    check("Response", body)


def test_forced_call_streams_openai_events(toy_server):
    events = stream(toy_server, "/v1/responses", {**FORCED, "stream": True})
    for event in events:
        check(event_schemas()[event["type"]], event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    order = ["response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
             "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
             "response.mcp_call.in_progress", "response.mcp_call.completed"]
    assert [k for k in kinds if k in order] == sorted((k for k in kinds if k in order), key=order.index)
    assert set(order) <= set(kinds)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.mcp_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.mcp_call_arguments.done")
    assert deltas == done["arguments"]
    final = events[-1]["response"]
    assert kinds[-1] == f"response.{final['status']}"  # incomplete when the random model's answer hits the limit
    call = next(item for item in final["output"] if item["type"] == "mcp_call")
    assert call["arguments"] == done["arguments"] and call["output"] == f"picked {json.loads(call['arguments'])['color']}"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_loop_feeds_results_back_until_the_model_answers(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = turns = Turns(tokenizer, [call_text("add", {"a": 2, "b": 40})], ["It is", " 42."])
    response = live.client().responses.create(model=MODEL_NAME, input="What is 2 + 40?", tools=[TOY])
    kinds = [item.type for item in response.output]
    assert kinds == ["mcp_list_tools", "mcp_call", "message"]
    assert response.output[1].output == "42" and response.output_text == "It is 42."
    assert len(turns.prompts) == 2 and "42" in turns.prompts[1].split("What is 2 + 40?")[1]
    # the next response remembers the calls and does not list the tools again
    turns.scripts, turns.prompts = [["Yes."]], []
    follow = live.client().responses.create(model=MODEL_NAME, input="Sure?", tools=[TOY],
                                            previous_response_id=response.id)
    assert [item.type for item in follow.output] == ["message"]
    assert "42" in turns.prompts[0] and "What is 2 + 40?" in turns.prompts[0]


def test_mcp_call_items_sent_back_as_input_are_the_conversation(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = turns = Turns(tokenizer, ["Done."])
    call = {"type": "mcp_call", "id": "mcp_1", "server_label": "toy", "name": "add", "arguments": '{"a": 1, "b": 2}',
            "output": "3"}
    listing = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "toy", "tools": []}
    live.client().responses.create(model=MODEL_NAME, input=[{"role": "user", "content": "1+2?"}, listing, call],
                                   tools=[TOY])
    assert '"a": 1' in turns.prompts[0] and "3" in turns.prompts[0].split("1+2?")[1]


def test_max_tool_calls_bounds_the_loop(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = turns = Turns(tokenizer, [call_text("echo", {"text": "again"})])
    response = live.client().responses.create(model=MODEL_NAME, input="Loop.", tools=[TOY], max_tool_calls=2)
    calls = [item for item in response.output if item.type == "mcp_call"]
    assert len(calls) == 2 and all(call.output == "again" for call in calls)
    assert len(turns.prompts) == 3 and "Tools:" not in turns.prompts[-1]  # the last turn had no tools to call
    assert response.output[-1].type == "message"


def test_approval_round_trip(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    tools = [{**TOY, "require_approval": {"never": {"tool_names": ["echo"]}}}]
    live.state.generate = turns = Turns(tokenizer, [call_text("add", {"a": 5, "b": 6})], ["Eleven."])
    client = live.client()
    asked = client.responses.create(model=MODEL_NAME, input="5 + 6?", tools=tools)
    request = asked.output[-1]
    assert request.type == "mcp_approval_request" and request.name == "add" and request.server_label == "toy"
    assert json.loads(request.arguments) == {"a": 5, "b": 6}
    assert not [item for item in asked.output if item.type == "mcp_call"] and len(turns.prompts) == 1
    answered = client.responses.create(model=MODEL_NAME, previous_response_id=asked.id, tools=tools, input=[
        {"type": "mcp_approval_response", "approve": True, "approval_request_id": request.id}])
    call, message = answered.output
    assert call.type == "mcp_call" and call.approval_request_id == request.id and call.output == "11"
    assert message.type == "message" and answered.output_text == "Eleven."
    assert "11" in turns.prompts[1].split("5 + 6?")[1]
    check("Response", answered.model_dump(mode="json", exclude_unset=True))
    # the same request again is answered already: 400 naming the field
    _, _, body = live.request("POST", "/v1/responses", {
        "model": MODEL_NAME, "previous_response_id": asked.id, "tools": tools,
        "input": [{"type": "mcp_approval_response", "approve": True, "approval_request_id": "mcpr_nope"}]})
    assert body["error"]["param"] == "input[0].approval_request_id"


def test_a_declined_call_does_not_run_and_the_model_is_told(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = turns = Turns(tokenizer, [call_text("echo", {"text": "secret"})], ["OK."])
    client = live.client()
    asked = client.responses.create(model=MODEL_NAME, input="Echo.", tools=[{**TOY, "require_approval": "always"}])
    request = asked.output[-1]
    declined = client.responses.create(model=MODEL_NAME, previous_response_id=asked.id, tools=[TOY], input=[
        {"type": "mcp_approval_response", "approve": False, "approval_request_id": request.id, "reason": "no"}])
    assert [item.type for item in declined.output] == ["message"]
    assert "declined" in turns.prompts[-1]


@pytest.mark.parametrize("tool, arguments, error_type, text", [
    ("fail", {"message": "boom"}, "mcp_tool_execution_error", "boom"),
    ("slow", {"seconds": 30}, "mcp_protocol_error", "timed out"),
])
def test_tool_failures_are_failed_items_the_model_reads(start_server, async_engine, tokenizer, tool, arguments,
                                                        error_type, text):
    live = mcp_server(start_server, async_engine, timeout_s=0.5)
    live.state.generate = turns = Turns(tokenizer, [call_text(tool, arguments)], ["Sorry."])
    response = live.client().responses.create(model=MODEL_NAME, input="Go.",
                                              tools=[{**TOY, "allowed_tools": [tool]}])
    call = response.output[1]
    assert call.type == "mcp_call" and call.status == "failed" and call.output is None
    assert call.error.type == error_type and text in json.dumps(call.error.model_dump())
    assert text in turns.prompts[1] and response.output_text == "Sorry."


def test_a_crashing_server_fails_its_call_and_restarts_for_the_next(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = Turns(tokenizer, [call_text("crash", {})], ["Hm."])
    crashed = live.client().responses.create(model=MODEL_NAME, input="Crash.",
                                             tools=[{**TOY, "allowed_tools": ["crash", "add"]}])
    assert crashed.output[1].status == "failed" and crashed.output[1].error.type == "mcp_protocol_error"
    live.state.generate = Turns(tokenizer, [call_text("add", {"a": 1, "b": 1})], ["Two."])
    again = live.client().responses.create(model=MODEL_NAME, input="1+1", tools=[TOY])
    assert again.output[1].output == "2"


def test_huge_output_is_capped(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine, max_output_bytes=100)
    live.state.generate = Turns(tokenizer, [call_text("big", {"num_bytes": 100_000})], ["Big."])
    response = live.client().responses.create(model=MODEL_NAME, input="Big.", tools=[{**TOY, "allowed_tools": ["big"]}])
    output = response.output[1].output
    assert output.startswith("x" * 100) and "truncated" in output and len(output) < 200


def test_a_slow_tool_does_not_hold_up_other_requests(start_server, async_engine, tokenizer):
    import concurrent.futures
    import time

    live = mcp_server(start_server, async_engine, timeout_s=3)
    slow = Turns(tokenizer, [call_text("slow", {"seconds": 2.5})], ["Done."])
    live.state.generate = lambda request: (slow if len(slow.prompts) < 2 and "Slow" in tokenizer.decode(
        request.prompt_token_ids) else scripted_generate(["Fast."]))(request)
    client = live.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow_reply = pool.submit(client.responses.create, model=MODEL_NAME, input="Slow.",
                                 tools=[{**TOY, "allowed_tools": ["slow"]}])
        time.sleep(0.5)
        started = time.monotonic()
        fast = client.responses.create(model=MODEL_NAME, input="Fast?")
        fast_s = time.monotonic() - started
        assert fast.output_text == "Fast." and fast_s < 1.5
        assert slow_reply.result().output[1].output == "done"


def test_request_urls_are_refused_unless_allowed(start_server, async_engine):
    with toy_http_server() as url:
        refused = start_server(make_state(async_engine))
        body = {"model": MODEL_NAME, "input": "x", "tools": [{**TOY, "server_label": "web", "server_url": url}]}
        status, _, error = refused.request("POST", "/v1/responses", body)
        assert status == 400 and error["error"]["param"] == "tools[0].server_url"
        assert error["error"]["code"] == "mcp_server_url_not_allowed"
        from tfserve.server.tools.mcp_tools import McpOptions

        allowed = start_server(make_state(async_engine, mcp=McpOptions(allow_url_patterns=("http://127.0.0.1:*/*",))))
        forced = {**body, "tools": [{**body["tools"][0], "allowed_tools": ["pick"]}], "max_output_tokens": 30,
                  "tool_choice": {"type": "mcp", "server_label": "web", "name": "pick"}, "temperature": 0}
        status, _, response = allowed.request("POST", "/v1/responses", forced)
        assert status == 200, response
        call = response["output"][1]
        assert call["type"] == "mcp_call" and call["server_label"] == "web" and call["status"] == "completed"
        assert call["output"] == f"picked {json.loads(call['arguments'])['color']}"


@pytest.mark.parametrize("tool, status, param, code", [
    ({"type": "mcp", "server_label": "nope"}, 400, "tools[0].server_label", "mcp_server_not_found"),
    ({"type": "mcp"}, 400, "tools[0].server_label", None),
    ({"type": "mcp", "server_label": "toy", "require_approval": "sometimes"}, 400, "tools[0].require_approval", None),
    ({"type": "mcp", "server_label": "toy", "allowed_tools": 3}, 400, "tools[0].allowed_tools", None),
    ({"type": "mcp", "server_label": "toy", "connector_id": "connector_gmail"}, 400, "tools[0].connector_id", None),
    ({"type": "mcp", "server_label": "down", "server_url": "http://127.0.0.1:9/mcp"}, 424, "tools[0]",
     "mcp_list_tools_failed"),
])
def test_bad_mcp_tools_are_openai_errors(start_server, async_engine, tool, status, param, code):
    live = start_server(_state(async_engine, allow_url_patterns=("http://127.0.0.1:*/*",)))
    got, _, body = live.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "x", "tools": [tool]})
    assert got == status, body
    assert body["error"]["param"] == param and (code is None or body["error"]["code"] == code)


def test_allowed_tools_and_tool_choice_name_checks(toy_server):
    tools = [{**TOY, "allowed_tools": ["pick"]}]
    body = {"model": MODEL_NAME, "input": "x", "tools": tools, "max_output_tokens": 40,
            "tool_choice": {"type": "mcp", "server_label": "toy", "name": "echo"}}
    status, _, error = toy_server.request("POST", "/v1/responses", body)
    assert status == 400 and error["error"]["param"] == "tool_choice.name"
    status, _, response = toy_server.request("POST", "/v1/responses", {**body, "tool_choice": "required",
                                                                      "temperature": 0})
    assert status == 200, response
    assert [tool["name"] for tool in response["output"][0]["tools"]] == ["pick"]
    assert response["output"][1]["name"] == "pick" and response["output"][1]["status"] == "completed"


def test_the_openai_sdk_streams_calls_and_approvals(start_server, async_engine, tokenizer):
    live = mcp_server(start_server, async_engine)
    live.state.generate = Turns(tokenizer, [call_text("add", {"a": 1, "b": 2})], ["Three."])
    client = live.client()
    with client.responses.stream(model=MODEL_NAME, input="1 + 2?", tools=[TOY]) as events:
        kinds = [event.type for event in events]
        final = events.get_final_response()
    assert "response.mcp_call.completed" in kinds and final.output_text == "Three."
    assert [item.type for item in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    live.state.generate = Turns(tokenizer, [call_text("add", {"a": 1, "b": 2})], ["Three."])
    asking = client.responses.create(model=MODEL_NAME, input="1 + 2?", stream=True,
                                     tools=[{**TOY, "require_approval": "always"}])
    events = list(asking)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].type == "mcp_approval_request" and json.loads(done[-1].arguments) == {"a": 1, "b": 2}
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].id == done[-1].id
