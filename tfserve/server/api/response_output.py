"""The output items of one /v1/responses request as they form, over one or more model turns (a turn per round of
MCP calls): a `reasoning` item for thinking, a `message` for text, a `function_call` per call of a client's tool,
an `mcp_call` (or an `mcp_approval_request`) per call of an MCP tool, and the `mcp_list_tools` items first.

Streamed or not, the items are built by the same code; with a stream (`sse`) each change also goes out as
OpenAI's event (output_item.added, its deltas, output_item.done ...), every event with an increasing
`sequence_number`."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tfserve.protocol.events import ArgumentsDelta, ReasoningDelta, TextDelta, ToolCall
from tfserve.protocol.reasoning import Reasoning
from tfserve.protocol.reply import ReplyParser
from tfserve.server.api.logprobs import chat_logprobs, shown
from tfserve.server.api.response_items import echo_tools
from tfserve.server.chat_prompt import template_arguments
from tfserve.server.requests.input_items import McpApprovalRequestItem
from tfserve.server.sse import EventStream
from tfserve.server.tools.mcp_tools import McpOffer, error_text


class ResponseOutput:
    """A Response object's output items and the events that build them."""

    def __init__(self, model: str, typed: Any, params: Any, offer: McpOffer | None = None) -> None:
        self.model, self.typed, self.params = model, typed, params  # typed: the ResponseRequest
        self.offer = offer or McpOffer()
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence_number = 0
        self.sse: EventStream | None = None  # set by `open` when streamed
        self.items: list[dict] = []  # in output order
        self.messages: list[dict] = []  # the turns as chat messages (calls and their results), for the next turn
        self.pending_approvals: dict[str, dict] = {}  # approval request id -> its item
        self.num_reasoning_tokens = 0
        self.num_calls = 0  # MCP calls run (or refused past max_tool_calls) in this response
        self.done: Any = None  # the last turn's final engine output
        self.cut = False  # max_output_tokens cut the last turn
        self.failed = False  # an error ended the stream (its event went out)
        self._call_ids: dict[str, str] = {}  # MCP item id -> the id the model's call gets in the chat messages
        # include message.output_text.logprobs: the top count and the token texts (logprobs.TokenTexts)
        self.num_top: int | None = None
        self.token_texts: Any = None
        self.begin_turn(None, None)

    # -- one model turn -----------------------------------------------------------------------------------

    def begin_turn(self, tool_format: Any, reasoning: Reasoning | None) -> None:
        """A new model turn: its own reply parser (calls in `tool_format` where tools were offered, `reasoning`
        for a reasoning model)."""
        self.parser = ReplyParser(tool_format, reasoning)
        self.turn_start = len(self.items)
        self.message: dict | None = None  # the turn's message item, once text arrives
        self.thought: dict | None = None  # the turn's reasoning item, once reasoning text arrives
        self.thought_sent = False  # its done events went out (before the items that follow it)
        self.closed: set[str] = set()  # ids of the turn's messages and calls whose done events went out
        self.stopped: set[int] = set()  # for run_choices: the turn ended early (a repeated tool call)

    def events(self, output: Any) -> list:
        """An output's events from the turn's reply parser: a reasoning model's thinking first, then text and
        calls as the model wrote them."""
        events = self.parser.feed(output)
        if self.parser.repeated:  # a repeated tool call ends the turn (run_choices aborts the rest)
            self.stopped.add(0)
        return events

    async def run_turn(self, outputs) -> Any:
        """Feed a turn's engine outputs into items (and events); returns its last output."""
        final = None
        pending: list[dict] = []  # logprobs of tokens whose text has not come out yet (half a character)
        async for _, output in outputs:
            if self.num_top is not None:
                pending += shown(output.delta_logprobs, output) or []
            for event in self.events(output):
                if isinstance(event, TextDelta):  # message text: the tokens so far are its tokens
                    await self._apply(event, pending)
                    pending = [] if event else pending
                else:  # reasoning or a call: the tokens so far were theirs
                    await self._apply(event)
                    pending = []
            final = output  # the finished one, or where a repeated tool call cut it
        return final

    async def end_turn(self, final: Any) -> None:
        """Close the turn's items (an empty turn is an empty message) and record it as chat messages."""
        self.num_reasoning_tokens += self.parser.num_reasoning_tokens
        if len(self.items) == self.turn_start:
            await self._apply("")
        # cut by max_output_tokens, unless all it cut was held back by the parser (every call shown is whole)
        self.cut = self.parser.finish_reason() == "length"
        self.done = final
        status = "incomplete" if self.cut else "completed"
        turn = self.items[self.turn_start:]
        for item in turn:
            if item["type"] in ("message", "function_call") and item["id"] not in self.closed:
                item["status"] = status
            elif item is self.thought:  # a reasoning block that was closed is whole even when the turn was cut
                item["status"] = "completed" if self.parser.reasoning_closed else status
        for item in turn:
            if (item is self.thought and self.thought_sent) or item["id"] in self.closed:
                continue
            if item["type"] == "mcp_call":
                await self._event("response.mcp_call_arguments.done", item_id=item["id"],
                                  output_index=self.items.index(item), arguments=item["arguments"])
            else:
                await self._item_done(item)
            if item["type"] == "mcp_approval_request":
                self.pending_approvals[item["id"]] = item
        text = "".join(part["text"] for item in turn if item["type"] == "message" for part in item["content"])
        calls = [self._chat_call(item) for item in turn if item["type"] in ("function_call", "mcp_call")]
        if text or calls or not self.turn_items("mcp_approval_request"):  # approved calls join later, on their own
            self.messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})

    def _chat_call(self, item: dict) -> dict:
        call_id = item["call_id"] if item["type"] == "function_call" else self._call_ids[item["id"]]
        return _chat_call(call_id, item["name"], item["arguments"])

    def turn_items(self, kind: str) -> list[dict]:
        return [item for item in self.items[self.turn_start:] if item["type"] == kind]

    # -- MCP ------------------------------------------------------------------------------------------------

    async def add_listings(self, listings: list[dict]) -> None:
        """The `mcp_list_tools` items, each whole (the listing is done before the first turn), first in the output."""
        for index, listing in enumerate(listings):
            self.items.insert(index, listing)  # before calls approved in this request, not announced yet
            await self._event("response.output_item.added", output_index=index, item=dict(listing, tools=[]))
            await self._event("response.mcp_list_tools.in_progress", item_id=listing["id"], output_index=index)
            await self._event("response.mcp_list_tools.completed", item_id=listing["id"], output_index=index)
            await self._event("response.output_item.done", output_index=index, item=listing)
        self.turn_start = len(self.items)

    def add_approved_call(self, request: McpApprovalRequestItem) -> dict:
        """An `mcp_call` item for a call the client approved (`mcp_approval_response`), to run before the turn."""
        item = self._mcp_call_item(request.server_label, request.name, request.arguments)
        item["approval_request_id"] = request.id
        self.items.append(item)
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [self._chat_call(item)]})
        return item

    def add_declined_call(self, request: McpApprovalRequestItem, reason: str | None) -> None:
        """A call the client declined: the model reads that it did not run (no output item, as OpenAI)."""
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        call = _chat_call(call_id, request.name, request.arguments)
        self.messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call_id,
                           "content": "The user declined this tool call." + (f" Reason: {reason}" if reason else "")}]

    async def run_call(self, item: dict, run) -> None:
        """Run one `mcp_call` item through `run(item) -> {output, error, status}`, close it and give the model its
        result."""
        index = self.items.index(item)
        await self._event("response.mcp_call.in_progress", item_id=item["id"], output_index=index)
        self.num_calls += 1
        item.update(await run(item))
        await self._event(f"response.mcp_call.{item['status']}", item_id=item["id"], output_index=index)
        await self._event("response.output_item.done", output_index=index, item=item)
        content = item["output"] if item["error"] is None else error_text(item["error"])
        self.messages.append({"role": "tool", "tool_call_id": self._call_ids[item["id"]], "content": content or ""})

    async def announce_calls(self, items: list[dict]) -> None:
        """The events of calls that ran before the stream opened (approved in this request), in order."""
        for item in items:
            index = self.items.index(item)
            await self._event("response.output_item.added", output_index=index,
                              item=dict(item, output=None, error=None, status="in_progress"))
            await self._event("response.mcp_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
            await self._event("response.mcp_call.in_progress", item_id=item["id"], output_index=index)
            await self._event(f"response.mcp_call.{item['status']}", item_id=item["id"], output_index=index)
            await self._event("response.output_item.done", output_index=index, item=item)

    def _mcp_call_item(self, server_label: str, name: str, arguments: str, call_id: str | None = None) -> dict:
        item = {"id": f"mcp_{uuid.uuid4().hex}", "type": "mcp_call", "server_label": server_label, "name": name,
                "arguments": arguments, "output": None, "error": None, "status": "in_progress",
                "approval_request_id": None}
        self._call_ids[item["id"]] = call_id or f"call_{uuid.uuid4().hex[:24]}"
        return item

    # -- items and their events -----------------------------------------------------------------------------

    async def _apply(self, event: Any, entries: list[dict] | None = None) -> None:
        if isinstance(event, ReasoningDelta):
            if self.thought is None:
                self.thought = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                                "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
                await self._add(self.thought, content=[])
            self.thought["content"][0]["text"] += event
            await self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=self.items.index(self.thought), content_index=0, delta=str(event))
            return
        if self.thought is not None and not self.thought_sent:  # the reasoning is over: done before what follows
            self.thought["status"], self.thought_sent = "completed", True
            await self._item_done(self.thought)
        if isinstance(event, ToolCall):
            await self._close_open()
            await self._add(self._call_item(event))
            if event.arguments:  # a call parsed whole
                await self._apply(ArgumentsDelta(event.index, event.arguments))
        elif isinstance(event, ArgumentsDelta):
            item = next(i for i in reversed(self.items) if i["type"] in CALL_TYPES)
            item["arguments"] += event.text
            kind = {"function_call": "function_call", "mcp_call": "mcp_call"}.get(item["type"])
            if kind is not None:  # an approval request's arguments come whole, with its done event
                await self._event(f"response.{kind}_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=event.text)
        else:
            if self.message is None or self.message["id"] in self.closed:  # (text after a call: a new message)
                await self._close_open()
                self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}
                await self._add(self.message, content=[])
                self.message["content"].append(_text_part(""))
                await self._event("response.content_part.added", **self._where(), part=_text_part(""))
            if event:
                part = self.message["content"][0]
                logprobs = chat_logprobs(entries, self.token_texts, self.num_top) if entries else []
                part["text"] += event
                part["logprobs"] += logprobs
                await self._event("response.output_text.delta", **self._where(), delta=event, logprobs=logprobs)

    async def _close_open(self) -> None:
        """Finish the turn's open message and function calls before a new item starts, as OpenAI streams them
        (each item's done events before the next one's added); MCP items finish when they have run."""
        for item in self.items[self.turn_start:]:
            if item["type"] in ("message", "function_call") and item["id"] not in self.closed:
                item["status"] = "completed"  # something follows it: it was not cut
                self.closed.add(item["id"])
                await self._item_done(item)

    def _call_item(self, call: ToolCall) -> dict:
        """A model's call as a client's `function_call`, an `mcp_call`, or an `mcp_approval_request`."""
        offered = self.offer.tools.get(call.name)
        if offered is None:
            return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call.id, "name": call.name, "arguments": ""}
        if offered.needs_approval:
            return {"id": f"mcpr_{uuid.uuid4().hex}", "type": "mcp_approval_request",
                    "server_label": offered.server_label, "name": call.name, "arguments": ""}
        return self._mcp_call_item(offered.server_label, call.name, "", call.id)

    async def _add(self, item: dict, **shown: Any) -> None:
        self.items.append(item)
        await self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item, **shown))

    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.items.index(self.message), "content_index": 0}

    async def _item_done(self, item: dict) -> None:
        index = self.items.index(item)
        if item["type"] == "function_call":
            await self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])
        elif item["type"] == "reasoning":
            await self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            await self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
            await self._event("response.content_part.done", **where, part=part)
        await self._event("response.output_item.done", output_index=index, item=item)

    # -- the stream -----------------------------------------------------------------------------------------

    async def _event(self, kind: str, **data: Any) -> None:
        if self.sse is None:
            return
        await self.sse.send({"type": kind, "sequence_number": self.sequence_number, **data}, event=kind)
        self.sequence_number += 1

    async def open(self, sse: EventStream, usage: Any) -> None:
        self.sse = sse
        await self._event("response.created", response=self.response(usage))
        await self._event("response.in_progress", response=self.response(usage))

    async def close(self, done: dict) -> None:
        """The last event: the finished Response object (`response`), completed or incomplete."""
        await self._event(f"response.{done['status']}", response=done)

    async def error(self, exc: Any) -> None:
        """An ApiError after the stream opened: OpenAI's `error` event."""
        self.failed = True
        await self._event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)

    # -- the Response object --------------------------------------------------------------------------------

    def response(self, usage: Any) -> dict:
        """The Response object: in progress (before the last turn ended) or finished."""
        status, incomplete, output = "in_progress", None, []
        final = self.done
        if final is not None:
            status = "incomplete" if self.cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            output = self.items
        typed = self.typed  # the request's fields echoed as parsed (a null sent: the default it stands for)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": typed.instructions,
            "max_output_tokens": typed.max_output_tokens, "max_tool_calls": typed.max_tool_calls,
            "model": self.model, "output": output, "parallel_tool_calls": typed.parallel,
            "previous_response_id": typed.previous_response_id,
            "conversation": None if typed.conversation is None else {"id": typed.conversation},
            "reasoning": {key: (typed.reasoning or {}).get(key) for key in ("effort", "summary")},
            "store": typed.stored,
            "temperature": self.params.temperature, "text": {"format": typed.text_format},
            "tool_choice": "auto" if typed.tool_choice.sent is None else typed.tool_choice.sent,
            "tools": echo_tools(typed.tools or []),
            "top_p": self.params.top_p, "truncation": typed.truncation or "disabled",
            "metadata": typed.metadata or {},
            # as the request gave them (service_tier: the tier it ran on, which here is the one there is; the
            # schema has `user`, deprecated, as a string only: absent when not given)
            "safety_identifier": typed.safety_identifier, "prompt_cache_key": typed.prompt_cache_key,
            "top_logprobs": typed.top_logprobs, "service_tier": "default",
            **({"user": typed.user} if typed.user is not None else {}),
            "completed_at": int(time.time()) if status == "completed" else None,
            # OpenAI's schema types usage as an object: absent, not null, until there is one
            **({"usage": _usage(usage, self.num_reasoning_tokens)} if final is not None else {}),
        }


CALL_TYPES = ("function_call", "mcp_call", "mcp_approval_request")


def _chat_call(call_id: str, name: str, arguments: str) -> dict:
    """A call as chat templates read it (`template_arguments`: the arguments' object, HF's convention)."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": template_arguments(arguments, "arguments")}}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Any, num_reasoning_tokens: int) -> dict:
    # the prompt tokens not read from the prefix cache were computed and written to it
    details = {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
