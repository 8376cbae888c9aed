"""POST /v1/responses: `input` (text or items) + `instructions` -> output items (a `reasoning` item for a
reasoning model's thinking, an assistant message, and a `function_call` item per tool call), whole or as the
Responses event stream (created, in_progress, then per item output_item.added, its deltas, output_item.done,
then completed — or incomplete when cut by max_output_tokens, as OpenAI does), every event with an increasing
`sequence_number`.

`tools` (flat function tools), `tool_choice` (enforced as on chat), `text.format` (structured outputs) and
`previous_response_id` over an in-memory store (`store: false` keeps a response out of it)."""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from tfserve.server.chat import render_chat, template_kwargs
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.generation import admit, run_choices
from tfserve.server.protocol import field, make_params, param_names, read_json, sampling_kwargs, use_model
from tfserve.server.reasoning import Reasoning, reasoning_for
from tfserve.server.response_format import compile_grammar, requested_grammar
from tfserve.server.response_items import (StoredResponse, as_response_format, chat_tools, echo_tools, parse_input,
                                           parse_tools, text_format)
from tfserve.server.sse import EventStream
from tfserve.server.state import STATE
from tfserve.server.tool_calls import ArgumentsDelta, ToolCall, ToolCallStream, detect_format
from tfserve.server.tool_choice import forced_tools, needs_special_tokens, tool_call_grammar


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = await use_model(request, body, state)
    if body.get("conversation") is not None:
        raise bad_request("conversation is not supported: use previous_response_id", "conversation")
    instructions = field(body, "instructions", str)
    metadata = field(body, "metadata", dict, {})
    previous_id = field(body, "previous_response_id", str)
    history = state.responses.get(previous_id).messages if previous_id else []
    # instructions are not carried over from a previous response (as OpenAI): they lead this turn only
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + parse_input(body)
    tools = parse_tools(body)
    tool_choice = field(body, "tool_choice", (str, dict), "auto")
    fmt = text_format(body)
    kwargs = sampling_kwargs(body, max_tokens_fields=("max_output_tokens",))
    kwargs.pop("n", None)
    tokenizer = state.engine.tokenizer
    tool_format = detect_format(tokenizer)
    offered = tools if tools and tool_choice != "none" else []
    constraint = requested_grammar({"response_format": as_response_format(fmt)})
    if constraint is not None:
        constraint = (constraint[0], "text.format")
    forced = forced_tools(offered, tool_choice) if offered else None
    parallel = field(body, "parallel_tool_calls", bool, True)
    if forced:
        if constraint is not None:
            raise bad_request("text.format cannot be combined with tool_choice required or a named function",
                              "text.format")
        constraint = (tool_call_grammar(tool_format, forced, parallel, tokenizer), "tools")
    if constraint is not None:
        await compile_grammar(state.engine, *constraint)
        kwargs["grammar"] = constraint[0]
    if offered and needs_special_tokens(tool_format, tokenizer):
        kwargs["skip_special_tokens"] = False
    stream = field(body, "stream", bool, False)
    prompt_ids = render_chat(tokenizer, messages, chat_tools(offered) or None, template_kwargs(state, body))
    names = param_names(body, ("max_output_tokens",), "input")
    params = make_params(kwargs, len(prompt_ids), state.engine, names)
    usage, engine_requests = admit(state, request, [prompt_ids], params, names)
    reply = _Reply(model, body, params, tool_format if offered else None, reasoning_for(tokenizer, prompt_ids))
    async with aclosing(run_choices(state, usage, engine_requests, reply.stopped)) as outputs:
        if stream:
            response = await reply.stream(request, outputs, usage)
        else:
            response = None
            events, final = [], None
            async for _, output in outputs:  # fed as it comes, as when streamed: the same split and token count
                events += reply.events(output)
                final = output  # the finished one, or where a repeated tool call cut it
            reply.finish(final, events)
    if reply.done is not None and field(body, "store", bool, True):
        state.responses.put(reply.id, StoredResponse(messages + reply.as_messages(), model))
    return response if response is not None else web.json_response(reply.response(usage))


class ReasoningDelta(str):
    """Reasoning text, among the content strings and calls of `_Reply.events`."""


class _Reply:
    """The output items of one response as they form: a reasoning item for thinking, a message for text, a
    function_call per call."""

    def __init__(self, model: str, body: dict, params: Any, tool_format: Any,
                 reasoning: Reasoning | None = None) -> None:
        self.model, self.body, self.params = model, body, params
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence_number = 0
        self.parser = ToolCallStream(tool_format) if tool_format is not None else None
        self.items: list[dict] = []  # in output order
        self.message: dict | None = None  # the message item, once text arrives
        self.splitter = reasoning.stream() if reasoning is not None else None
        self.thought: dict | None = None  # the reasoning item, once reasoning text arrives
        self.thought_sent = False  # its done events went out (streaming: before the items that follow it)
        self.done: Any = None  # the final engine output
        self.stopped: set[int] = set()  # for run_choices: the reply ended early (a repeated tool call)

    # -- items ------------------------------------------------------------------------------------------

    def events(self, output: Any) -> list:
        """An output's new text as a ReasoningDelta (a reasoning model's thinking, first), then content strings
        and calls (through the tool-call parser when tools are on)."""
        text, finished, events = output.delta_text, output.finished, []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text, len(output.delta_tokens))
            if finished:
                more_reasoning, more_text = self.splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                events.append(ReasoningDelta(reasoning))
        if self.parser is None:
            return events + ([text] if text else [])
        events += self.parser.feed(text) + (self.parser.finish() if finished else [])
        if self.parser.repeated:  # a repeated tool call ends the reply (run_choices aborts the rest)
            self.stopped.add(0)
        return events

    @property
    def num_reasoning_tokens(self) -> int:
        return self.splitter.num_reasoning_tokens if self.splitter is not None else 0

    def _open_thought(self) -> dict:
        self.thought = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress", "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}]}
        self.items.append(self.thought)
        return self.thought

    def _open_message(self) -> dict:
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
        self.items.append(self.message)
        return self.message

    def _open_call(self, call: ToolCall) -> dict:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}
        self.items.append(item)
        return item

    def finish(self, final: Any, events: list) -> None:
        """Build the items of a whole (not streamed) reply from its `events`."""
        for event in events:
            if isinstance(event, ReasoningDelta):
                (self.thought or self._open_thought())["content"][0]["text"] += event
            elif isinstance(event, ToolCall):
                self._open_call(event)
            elif isinstance(event, ArgumentsDelta):
                self.items[-1]["arguments"] += event.text
            else:
                message = self.message or self._open_message()
                if not message["content"]:
                    message["content"].append(_text_part(""))
                message["content"][0]["text"] += event
        self._close(final)

    def _close(self, final: Any) -> None:
        self.done = final
        status = "incomplete" if final.finish_reason == "length" else "completed"
        for item in self.items:  # a reasoning block that was closed is whole even when the reply was cut later
            item["status"] = "completed" if item is self.thought and self.splitter.closed else status
        if self.message is None and not self.items:  # an empty reply is still a message
            self._open_message()["status"] = status
            self.message["content"].append(_text_part(""))

    def as_messages(self) -> list[dict]:
        """This response's output as chat messages, for a later `previous_response_id`."""
        text = "".join(part["text"] for part in self.message["content"]) if self.message else ""
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": _arguments(item["arguments"])}}
                 for item in self.items if item["type"] == "function_call"]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]

    def response(self, usage: Any) -> dict:
        """The Response object: in progress (before `finish`/`_close`) or finished."""
        status, incomplete, output = "in_progress", None, []
        final = self.done
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            output = self.items
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.model, "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "store": body.get("store", True),
            "temperature": self.params.temperature, "text": {"format": text_format(body)},
            "tool_choice": body.get("tool_choice", "auto"), "tools": echo_tools(body.get("tools") or []),
            "top_p": self.params.top_p, "truncation": "disabled", "metadata": body.get("metadata") or {},
            "completed_at": int(time.time()) if status == "completed" else None,
            # OpenAI's schema types usage as an object: absent, not null, until there is one
            **({"usage": _usage(usage, self.num_reasoning_tokens)} if final is not None else {}),
        }

    # -- stream ---------------------------------------------------------------------------------------------

    async def _event(self, sse: EventStream, kind: str, **data: Any) -> None:
        await sse.send({"type": kind, "sequence_number": self.sequence_number, **data}, event=kind)
        self.sequence_number += 1

    async def stream(self, request: web.Request, outputs, usage) -> web.StreamResponse:
        sse = EventStream(request)
        await self._event(sse, "response.created", response=self.response(usage))
        await self._event(sse, "response.in_progress", response=self.response(usage))
        try:
            final = None
            async for _, output in outputs:
                for event in self.events(output):
                    await self._stream_event(sse, event)
                final = output  # the finished one, or where a repeated tool call cut it
        except ApiError as exc:
            await self._event(sse, "error", code=exc.code or exc.type, message=exc.message, param=exc.param)
            return await sse.close()
        if self.message is None and not self.items:
            await self._stream_event(sse, "")
        self._close(final)
        for index, item in enumerate(self.items):
            if not (item is self.thought and self.thought_sent):
                await self._stream_item_done(sse, index, item)
        done = self.response(usage)
        await self._event(sse, f"response.{done['status']}", response=done)
        return await sse.close()

    async def _stream_event(self, sse: EventStream, event: Any) -> None:
        if isinstance(event, ReasoningDelta):
            if self.thought is None:
                item = self._open_thought()
                await self._event(sse, "response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(item, content=[]))
            self.thought["content"][0]["text"] += event
            await self._event(sse, "response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=self.items.index(self.thought), content_index=0, delta=str(event))
            return
        if self.thought is not None and not self.thought_sent:  # the reasoning is over: done before what follows
            self.thought["status"], self.thought_sent = "completed", True
            await self._stream_item_done(sse, self.items.index(self.thought), self.thought)
        if isinstance(event, ToolCall):
            item = self._open_call(ToolCall(event.name, "", event.id))
            index = len(self.items) - 1
            await self._event(sse, "response.output_item.added", output_index=index, item=dict(item))
            if event.arguments:  # a call parsed whole
                await self._stream_event(sse, ArgumentsDelta(event.index, event.arguments))
            return
        if isinstance(event, ArgumentsDelta):
            item = next(i for i in reversed(self.items) if i["type"] == "function_call")
            item["arguments"] += event.text
            await self._event(sse, "response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.items.index(item), delta=event.text)
            return
        if self.message is None:
            message = self._open_message()
            index = len(self.items) - 1
            await self._event(sse, "response.output_item.added", output_index=index, item=dict(message, content=[]))
            message["content"].append(_text_part(""))
            await self._event(sse, "response.content_part.added", **self._where(), part=_text_part(""))
        if event:
            self.message["content"][0]["text"] += event
            await self._event(sse, "response.output_text.delta", **self._where(), delta=event, logprobs=[])

    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.items.index(self.message), "content_index": 0}

    async def _stream_item_done(self, sse: EventStream, index: int, item: dict) -> None:
        if item["type"] == "function_call":
            await self._event(sse, "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              name=item["name"], arguments=item["arguments"])
        elif item["type"] == "reasoning":
            await self._event(sse, "response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=item["content"][0]["text"])
        else:
            text = item["content"][0]["text"]
            await self._event(sse, "response.output_text.done", **self._where(), text=text, logprobs=[])
            await self._event(sse, "response.content_part.done", **self._where(), part=_text_part(text))
        await self._event(sse, "response.output_item.done", output_index=index, item=item)


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Any, num_reasoning_tokens: int) -> dict:
    # the prompt tokens not read from the prefix cache were computed and written to it
    details = {"cached_tokens": usage.num_cached_tokens,
               "cache_write_tokens": usage.prompt_tokens - usage.num_cached_tokens}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
