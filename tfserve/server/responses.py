"""POST /v1/responses: `input` (text or items) + `instructions` -> output items (response_output), whole or as
the Responses event stream (created, in_progress, the items' events, then completed — or incomplete when cut by
max_output_tokens, as OpenAI does).

`tools` (flat function tools, and `mcp` tools run here), `tool_choice` (enforced as on chat), `text.format`
(structured outputs) and `previous_response_id` over an in-memory store (`store: false` keeps a response out
of it). With MCP tools a response is a loop: the model's turn, its MCP calls run, their results fed back, the
next turn, until it answers, calls a client's function, waits for an approval, or spends `max_tool_calls`."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from aiohttp import web

from tfserve.server import mcp_tools
from tfserve.server.chat import render_chat, template_kwargs
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.generation import admit, run_choices
from tfserve.server.protocol import field, make_params, param_names, read_json, sampling_kwargs, use_model
from tfserve.server.reasoning import reasoning_for
from tfserve.server.response_format import compile_grammar, requested_grammar
from tfserve.server.response_items import (StoredResponse, as_response_format, chat_tools, parse_input, parse_tools,
                                           text_format)
from tfserve.server.response_output import ResponseOutput
from tfserve.server.sse import EventStream
from tfserve.server.state import STATE
from tfserve.server.tool_calls import detect_format
from tfserve.server.tool_choice import forced_tools, needs_special_tokens, tool_call_grammar


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = await use_model(request, body, state)
    if body.get("conversation") is not None:
        raise bad_request("conversation is not supported: use previous_response_id", "conversation")
    instructions = field(body, "instructions", str)
    field(body, "metadata", dict, {})
    previous_id = field(body, "previous_response_id", str)
    previous = state.responses.get(previous_id) if previous_id else None
    # instructions are not carried over from a previous response (as OpenAI): they lead this turn only
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + (
        previous.messages if previous else []) + parse_input(body)
    functions, specs = mcp_tools.split_tools(parse_tools(body))
    max_tool_calls = field(body, "max_tool_calls", int, mcp_tools.DEFAULT_MAX_TOOL_CALLS)
    if max_tool_calls < 0:
        raise bad_request("max_tool_calls must be >= 0", "max_tool_calls")
    offer = await mcp_tools.resolve(state, specs, {tool["name"] for tool in functions})
    turns = _Turns(state, body, functions, offer)
    await turns.check()
    output = ResponseOutput(model, body, None, offer)
    approved = _answer_approvals(body, previous, offer, output)
    for item in approved:  # before the first turn, which reads their results
        await output.run_call(item, lambda item: _call(state, offer, item))
    listed = previous.listed if previous else frozenset()
    stream = field(body, "stream", bool, False)
    usage = engine_requests = None
    try:
        for call_number in range(max_tool_calls + 1):
            # the first turn may be forced (tool_choice); later ones choose freely, with no tools once the
            # call budget is spent
            prompt_ids, params = await turns.next(messages + output.messages, first=call_number == 0,
                                                  tools_left=max_tool_calls - output.num_calls,
                                                  used_tokens=usage.completion_tokens if usage else 0)
            output.params = params
            usage, engine_requests = admit(state, request, [prompt_ids], params, turns.names)
            if output.sse is None and stream:
                await output.open(EventStream(request), usage)
            if call_number == 0:
                await output.add_listings([item for item in offer.listings if item["server_label"] not in listed])
                await output.announce_calls(approved)
            output.begin_turn(turns.tool_format if turns.offered else None, reasoning_for(turns.tokenizer, prompt_ids))
            async with aclosing(run_choices(state, usage, engine_requests, output.stopped)) as outputs:
                final = await output.run_turn(outputs)
            await output.end_turn(final)
            calls = output.turn_items("mcp_call")
            for item in calls:
                await output.run_call(item, lambda item: _call(state, offer, item, output.num_calls > max_tool_calls))
            if (not calls or final.finish_reason == "length" or output.turn_items("function_call")
                    or output.turn_items("mcp_approval_request")):
                break
    except ApiError as exc:
        if output.sse is None:
            raise
        await output.error(exc.code or exc.type, exc.message, exc.param)
        return await output.sse.close()
    if field(body, "store", bool, True):
        state.responses.put(output.id, StoredResponse(
            messages + output.messages, model, output.pending_approvals,
            listed | {item["server_label"] for item in offer.listings}))
    if output.sse is not None:
        await output.close(usage)
        return await output.sse.close()
    return web.json_response(output.response(usage))


async def _call(state: Any, offer: mcp_tools.McpOffer, item: dict, over_budget: bool = False) -> dict:
    if over_budget:  # OpenAI ignores calls past max_tool_calls; the model reads why
        error = {"type": "mcp_protocol_error", "code": -32000, "message": "max_tool_calls reached: not run"}
        return {"output": None, "error": error, "status": "failed"}
    offered = offer.tools.get(item["name"])
    if offered is None:  # an approved call whose tool this request no longer offers
        error = {"type": "mcp_protocol_error", "code": -32601,
                 "message": f"tool {item['name']!r} is not among this request's mcp tools"}
        return {"output": None, "error": error, "status": "failed"}
    return await mcp_tools.call(state, offered, item["name"], item["arguments"])


def _answer_approvals(body: dict, previous: StoredResponse | None, offer: mcp_tools.McpOffer,
                      output: ResponseOutput) -> list[dict]:
    """The input's `mcp_approval_response` items against the approval requests of `previous_response_id` (or of
    the input itself): approved calls become `mcp_call` items to run first; declined ones, a note to the model."""
    items = body.get("input") if isinstance(body.get("input"), list) else []
    pending = dict(previous.pending_approvals) if previous else {}
    pending.update({item.get("id"): item for item in items
                    if isinstance(item, dict) and item.get("type") == "mcp_approval_request"})
    approved = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type") != "mcp_approval_response":
            continue
        where = f"input[{i}]"
        request_id = field(item, "approval_request_id", str, required=True, param=f"{where}.approval_request_id")
        approve = field(item, "approve", bool, required=True, param=f"{where}.approve")
        request = pending.pop(request_id, None)
        if request is None:
            raise bad_request(f"{where}.approval_request_id {request_id!r} answers no pending mcp_approval_request "
                              "(send previous_response_id of the response that asked)", f"{where}.approval_request_id")
        if approve:
            approved.append(output.add_approved_call(request))
        else:
            output.add_declined_call(request, field(item, "reason", str, param=f"{where}.reason"))
    return approved


class _Turns:
    """What every model turn of one response shares: the tools, the constraint, the sampling fields."""

    def __init__(self, state: Any, body: dict, functions: list[dict], offer: mcp_tools.McpOffer) -> None:
        self.state, self.body, self.functions, self.offer = state, body, functions, offer
        self.tokenizer = state.engine.tokenizer
        self.tool_format = detect_format(self.tokenizer)
        self.tool_choice = field(body, "tool_choice", (str, dict), "auto")
        self.kwargs = sampling_kwargs(body, max_tokens_fields=("max_output_tokens",))
        self.kwargs.pop("n", None)
        self.names = param_names(body, ("max_output_tokens",), "input")
        self.template_kwargs = template_kwargs(state, body)
        self.offered: list[dict] = []

    async def check(self) -> None:
        """Every field's 400 before anything runs: the first turn's constraint, compiled."""
        await self._constraint(first=True, tools_left=len(self.offer.tools))

    async def _constraint(self, first: bool, tools_left: int) -> dict:
        tool_choice = self.tool_choice if first else "auto"
        # MCP tools count against max_tool_calls (OpenAI's rule for its built-in tools); a client's functions do not
        tools = self.functions + (self.offer.function_tools() if tools_left > 0 else [])
        self.offered = tools if tool_choice != "none" else []
        kwargs = dict(self.kwargs)
        constraint = requested_grammar({"response_format": as_response_format(text_format(self.body))})
        if constraint is not None:
            constraint = (constraint[0], "text.format")
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "mcp":
            names = mcp_tools.mcp_choice(tool_choice, self.offer)
            forced = [tool for tool in self.offered if tool["name"] in names]
        else:
            forced = forced_tools(self.offered, tool_choice) if self.offered else None
        if forced:
            if constraint is not None:
                raise bad_request("text.format cannot be combined with tool_choice required or a named function",
                                  "text.format")
            parallel = field(self.body, "parallel_tool_calls", bool, True)
            constraint = (tool_call_grammar(self.tool_format, forced, parallel, self.tokenizer), "tools")
        if constraint is not None:
            await compile_grammar(self.state.engine, *constraint)
            kwargs["grammar"] = constraint[0]
        if self.offered and needs_special_tokens(self.tool_format, self.tokenizer):
            kwargs["skip_special_tokens"] = False
        return kwargs

    async def next(self, messages: list[dict], first: bool, tools_left: int, used_tokens: int
                   ) -> tuple[list[int], Any]:
        """The next turn's prompt and sampling parameters (max_output_tokens shared by all turns)."""
        kwargs = await self._constraint(first, tools_left)
        if kwargs.get("max_tokens") is not None:
            kwargs["max_tokens"] = max(1, kwargs["max_tokens"] - used_tokens)
        prompt_ids = render_chat(self.tokenizer, messages, chat_tools(self.offered) or None, self.template_kwargs)
        return prompt_ids, make_params(kwargs, len(prompt_ids), self.state.engine, self.names)
