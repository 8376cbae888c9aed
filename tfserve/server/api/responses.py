"""POST /v1/responses: `input` (text or items) + `instructions` -> output items (response_output), whole or as
the Responses event stream (created, in_progress, the items' events, then completed — or incomplete when cut by
max_output_tokens, as OpenAI does).

`tools` (flat function tools, and `mcp` tools run here), `tool_choice` (enforced as on chat), `text.format`
(structured outputs) and `previous_response_id` over an in-memory store (`store: false` keeps a response out
of it). With MCP tools a response is a loop: the model's turn, its MCP calls run, their results fed back, the
next turn, until it answers, calls a client's function, waits for an approval, or spends `max_tool_calls`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from aiohttp import web

from tfserve.server.api import conversations
from tfserve.server.api.response_items import input_items, page, parse_input, resolve_references
from tfserve.server.api.response_output import ResponseOutput
from tfserve.server.chat_prompt import text_chars
from tfserve.server.errors import bad_request
from tfserve.server.generation import check_text_fits
from tfserve.server.media import gather_images
from tfserve.server.protocol import read_json, use_model
from tfserve.server.requests.input_items import (InputItem, McpApprovalRequestItem, McpApprovalResponseItem,
                                                 parse_item, parse_items, sent_items)
from tfserve.server.requests.responses import ResponseRequest
from tfserve.server.runtime.request_limits import check_messages
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.stores import StoredResponse, json_size
from tfserve.server.tools import mcp_tools
from tfserve.server.tools.mcp_tools import DEFAULT_MAX_TOOL_CALLS
from tfserve.server.tools.tool_loop import Turns, call, run_loop


@dataclass
class Conversation:
    """What a Responses request asks the model: the messages of its first turn (instructions, the stored history,
    the new input), the images they bring, the tools (the client's functions and the MCP servers' offer) and what
    every turn shares (`turns`). Every field is checked on the way (a 400 naming it)."""

    typed: ResponseRequest  # its fields, parsed
    items: str | list[InputItem]  # its input, typed, with its item references resolved
    model: str
    previous: StoredResponse | None
    history: list[dict]  # the conversation to store: the previous response's messages, then this input's
    messages: list[dict]  # the first turn's: the instructions, then the history
    image_refs: list
    offer: mcp_tools.McpOffer
    turns: Turns
    max_tool_calls: int
    thread: conversations.StoredConversation | None  # the conversation it goes on (`conversation`), or None


async def conversation(request: web.Request, typed: ResponseRequest) -> Conversation:
    """What the request `typed` asks the model."""
    state = request.app[STATE]
    items = resolve_references(typed.input, state.responses, state.conversations)
    model = await use_model(request, typed.model, state)
    instructions = typed.instructions
    thread = conversations.requested(typed.conversation, state.conversations)
    previous_id = typed.previous_response_id
    previous = state.responses.get(previous_id) if previous_id else None
    if thread is not None:  # its items come first, as if sent again before the input (read back: parsed again)
        earlier, earlier_images = parse_input(parse_items(thread.items)) if thread.items else ([], [])
    else:
        earlier, earlier_images = (previous.messages, previous.images) if previous else ([], [])
    new_messages, new_images = parse_input(items, earlier)
    history = earlier + new_messages
    check_messages(state.limits, history, "input")
    if thread is not None:  # its input goes on it: refused now if it would not fit, not after the reply
        state.conversations.check_fits(state.conversations.size_of(thread.id) + json_size(sent_items(items)),
                                       "the conversation", "conversation")
    # instructions are not carried over to the next response (as OpenAI): they lead this turn only, unstored
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    check_text_fits(state, text_chars(messages), "input")
    image_refs = earlier_images + new_images
    functions, specs = mcp_tools.split_tools(typed.tools or [])  # the function tools checked by the parse
    max_tool_calls = DEFAULT_MAX_TOOL_CALLS if typed.max_tool_calls is None else typed.max_tool_calls
    offer = await mcp_tools.resolve(state, specs, {tool["name"] for tool in functions})
    turns = Turns(state, typed, functions, offer)
    turns.kwargs.pop("n", None)
    return Conversation(typed, items, model, previous, history, messages, image_refs, offer, turns, max_tool_calls,
                        thread)


async def read_request(request: web.Request) -> ResponseRequest:
    """The body, typed; its `input` counted first, on the raw body, on purpose: the count alone refuses 400,000
    items cheaply."""
    body = await read_json(request)
    check_messages(request.app[STATE].limits, body.get("input"), "input")
    return ResponseRequest.parse(body)


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    typed = await read_request(request)
    if typed.background:
        raise bad_request("background responses are not supported here: send the request without background "
                          "(or stream it)", "background")
    talk = await conversation(request, typed)
    stream, store = bool(typed.stream), typed.stored
    if store:  # a response too large to keep is refused before it runs (store false answers it unkept)
        state.responses.check_fits(json_size(talk.history), "the stored response (the conversation so far)",
                                   "previous_response_id" if talk.previous else "input")
    model, previous, history, messages, image_refs, offer, turns, max_tool_calls = (
        talk.model, talk.previous, talk.history, talk.messages, talk.image_refs, talk.offer, talk.turns,
        talk.max_tool_calls)
    num_top = typed.num_top_logprobs
    if num_top is not None:
        turns.kwargs["logprobs"] = num_top
    await turns.check()
    output = ResponseOutput(model, typed, None, offer)
    output.num_top, output.token_texts = num_top, state.token_texts
    approved = _answer_approvals(talk.items, previous, offer, output)
    turns.images = await gather_images(state, image_refs)  # every field checked first: a bad one fetches nothing
    for item in approved:  # before the first turn, which reads their results
        await output.run_call(item, lambda item: call(state, offer, item))
    listed = previous.listed if previous else frozenset()
    usage = await run_loop(state, request, output, turns, messages, max_tool_calls, stream,
                           [item for item in offer.listings if item["server_label"] not in listed], approved)
    if output.failed:  # the error event went out
        return await output.sse.close()
    response = output.response(usage)  # the finished Response object: returned (or the last event) and stored
    new_items = input_items(talk.items)  # with ids, the same wherever this input is listed
    if talk.thread is not None:  # the conversation goes on with this turn's input and output
        present = {item.get("id") for item in talk.thread.items}  # an item_reference to one of its own: once
        state.conversations.add_items(talk.thread, [item for item in new_items + response["output"]
                                                    if item.get("id") not in present], check=False)
    if store:
        # the images as URLs (fetched again by the next turn), named by the field that brings them back
        state.responses.put(output.id, StoredResponse(
            history + output.messages, model, output.pending_approvals,
            listed | {item["server_label"] for item in offer.listings},
            [replace(ref, where="previous_response_id") for ref in image_refs], response, new_items))
    if output.sse is not None:
        await output.close(response)
        return await output.sse.close()
    return web.json_response(response)


async def count_input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens: the tokens the first turn's prompt of this body would take (its
    instructions, input, previous response and tools, through the model's chat template), without running it."""
    talk = await conversation(request, await read_request(request))
    talk.turns.images = await gather_images(request.app[STATE], talk.image_refs)
    tools = talk.turns.tools(first=True, tools_left=len(talk.offer.tools))
    prompt_ids, _ = await talk.turns.render(talk.messages, tools)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a stored response as it was returned. `?stream=true` (OpenAI's replay of a
    background response's events) is a 400: no response runs in the background here, so none has events left."""
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("stream is only for background responses, which this server does not run: retrieve the "
                          "response without stream", "stream")
    return web.json_response(request.app[STATE].responses.find(request.match_info["response_id"]).response)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forget a stored response (a later previous_response_id naming it is a 404)."""
    response_id = request.match_info["response_id"]
    request.app[STATE].responses.delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}/input_items: the input of a stored response, as a page (OpenAI's `limit`, `order`,
    `after`)."""
    items = request.app[STATE].responses.find(request.match_info["response_id"]).input_items
    return web.json_response(page(items, request.query))


def _answer_approvals(items: str | list[InputItem], previous: StoredResponse | None, offer: mcp_tools.McpOffer,
                      output: ResponseOutput) -> list[dict]:
    """The input's `mcp_approval_response` items against the approval requests of `previous_response_id` (or of
    the input itself): approved calls become `mcp_call` items to run first; declined ones, a note to the model."""
    items = items if isinstance(items, list) else []
    pending = {request_id: parse_item(stored, "previous_response_id")  # read back from the store: parsed again
               for request_id, stored in (previous.pending_approvals if previous else {}).items()}
    pending.update({item.id: item for item in items if isinstance(item, McpApprovalRequestItem)})
    approved = []
    for i, item in enumerate(items):
        if not isinstance(item, McpApprovalResponseItem):
            continue
        where = f"input[{i}]"
        request = pending.pop(item.approval_request_id, None)
        if request is None:
            raise bad_request(f"{where}.approval_request_id {item.approval_request_id!r} answers no pending "
                              "mcp_approval_request (send previous_response_id of the response that asked)",
                              f"{where}.approval_request_id")
        if item.approve:
            approved.append(output.add_approved_call(request))
        else:
            output.add_declined_call(request, item.reason)
    return approved
