"""The loop behind server-side tools: a model turn, its MCP calls run, their results fed back, the next turn,
until the model answers, calls a client's function, waits for an approval, or spends `max_tool_calls`. One
loop serves /v1/responses and chat completions' `mcp` tools; what a turn's items look like on the wire is the
output's business (response_output, chat_mcp)."""

from __future__ import annotations

import functools
from contextlib import aclosing
from typing import Any

from tfserve.protocol.reasoning import reasoning_for
from tfserve.protocol.tool_formats import detect_format
from tfserve.server.api.response_items import chat_tools
from tfserve.server.chat_prompt import render_chat, render_multimodal, template_kwargs
from tfserve.server.errors import ApiError
from tfserve.server.generation import admit, run_choices
from tfserve.server.protocol import make_params
from tfserve.server.sse import EventStream
from tfserve.server.tools import mcp_tools
from tfserve.server.tools.tool_choice import (ToolChoice, apply_constraint, callable_tools, forced_tools,
                                              reply_constraint)


class Turns:
    """What every model turn of one request shares: the tools, the constraint, the sampling fields.

    `typed` is the request (a `requests.ResponseRequest` or `ChatCompletionRequest`), `functions` the client's
    tools (flat, Responses-shaped)."""

    def __init__(self, state: Any, typed: Any, functions: list[dict], offer: mcp_tools.McpOffer) -> None:
        self.state, self.typed, self.functions, self.offer = state, typed, functions, offer
        self.constraint = typed.constraint  # the grammar and the field that asked for it (text.format, ...)
        self.tokenizer = state.engine.tokenizer
        self.tool_format = detect_format(self.tokenizer)
        self.tool_choice: ToolChoice = typed.tool_choice  # parsed by the typed request
        self.kwargs = typed.to_sampling_kwargs()
        self.names = typed.names
        self.template_kwargs = template_kwargs(state, {"chat_template_kwargs": typed.chat_template_kwargs})
        # the Responses API's truncation "auto": a conversation past the context drops its oldest turns
        self.truncate = getattr(typed, "truncate", False)
        self.offered: list[dict] = []
        self.images: list = []  # the conversation's MediaImages (media.gather_images, once check() passed)

    async def check(self) -> None:
        """Every field's 400 before anything runs: the first turn's constraint, compiled."""
        await self._kwargs(first=True, tools_left=len(self.offer.tools))

    def tools(self, first: bool, tools_left: int) -> list[dict]:
        """The tools a turn offers the model (Responses-shaped): none under tool_choice "none"."""
        tool_choice = self.tool_choice if first else self.tool_choice.after_first_turn()
        # MCP tools count against max_tool_calls (OpenAI's rule for its built-in tools); a client's functions do not
        tools = self.functions + (self.offer.function_tools() if tools_left > 0 else [])
        return tools if tool_choice.mode != "none" else []

    async def _kwargs(self, first: bool, tools_left: int) -> dict:
        tool_choice = self.tool_choice if first else self.tool_choice.after_first_turn()
        self.offered = self.tools(first, tools_left)
        kwargs = dict(self.kwargs)
        constraint = self.constraint
        mcp_names = functools.partial(mcp_tools.mcp_choice, offer=self.offer)
        if tool_choice.mcp is not None:
            names = mcp_names(tool_choice.mcp)
            forced = [tool for tool in self.offered if tool["name"] in names]
        else:
            forced = forced_tools(self.offered, tool_choice, mcp_names=mcp_names) if self.offered else None
        callable_ = callable_tools(self.offered, tool_choice, mcp_names) if self.offered else []
        constraint = reply_constraint(constraint, self.tool_format, callable_, forced, self.typed.parallel,
                                      self.tokenizer)
        await apply_constraint(self.state.engine, kwargs, constraint, forced, self.offered, self.tool_format,
                               self.tokenizer, self.typed.tools or [])
        return kwargs

    async def next(self, messages: list[dict], first: bool, tools_left: int, used_tokens: int
                   ) -> tuple[list[int], Any, Any]:
        """The next turn's prompt, sampling parameters (the output token limit shared by all turns) and what the
        engine made of the images (None without images), for `admit`."""
        kwargs = await self._kwargs(first, tools_left)
        if kwargs.get("max_tokens") is not None:
            kwargs["max_tokens"] = max(1, kwargs["max_tokens"] - used_tokens)
        while True:
            prompt_ids, mm = await self.render(messages, self.offered)
            try:
                return prompt_ids, make_params(kwargs, len(prompt_ids), self.state.engine, self.names), mm
            except ApiError as exc:
                shorter = truncated(messages) if self.truncate and not self.images else None
                if exc.code != "context_length_exceeded" or shorter is None:
                    raise
                messages = shorter

    async def render(self, messages: list[dict], offered: list[dict]) -> tuple[list[int], Any]:
        """`messages` with the `offered` tools through the chat template: the prompt's ids, and what the engine
        made of the conversation's images (None without images)."""
        tools = chat_tools(offered) or None
        param = self.names["prompt"]  # messages, or a response's input
        if self.images:
            return await render_multimodal(self.state, messages, self.images, tools, self.template_kwargs, param=param)
        return await render_chat(self.tokenizer, messages, tools, self.template_kwargs, param=param), None


def truncated(messages: list[dict]) -> list[dict] | None:
    """`messages` without their oldest turn past the leading system messages (an assistant's tool calls go with
    their results), or None when only the last message is left to drop (as OpenAI's truncation "auto", which
    drops input items from the start of the conversation, never the instructions)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
    end = first + 1
    while end < len(messages) and messages[end].get("role") == "tool":  # the results of the calls dropped
        end += 1
    if end >= len(messages):
        return None
    return messages[:first] + messages[end:]


async def run_loop(state: Any, request: Any, output: Any, turns: Turns, messages: list[dict], max_tool_calls: int,
                   stream: bool, listings: list[dict] = (), approved: list[dict] = ()) -> Any:
    """Run turns into `output` (a ResponseOutput) until the loop ends; returns the request's Usage. A stream opens
    once the first turn is admitted (its 400/429/503 stay HTTP errors); an error after that is an event."""
    usage = None
    try:
        for number in range(max_tool_calls + 1):
            # the first turn may be forced (tool_choice); later ones choose freely, with no MCP tools once the
            # call budget is spent
            prompt_ids, params, mm = await turns.next(messages + output.messages, first=number == 0,
                                                      tools_left=max_tool_calls - output.num_calls,
                                                      used_tokens=usage.completion_tokens if usage else 0)
            output.params = params
            usage, engine_requests = admit(state, request, [prompt_ids], params, turns.names, mm=mm)
            if number == 0:
                if stream:
                    await output.open(EventStream(request), usage)
                await output.add_listings(list(listings))
                await output.announce_calls(list(approved))
            output.begin_turn(turns.tool_format if turns.offered else None, reasoning_for(turns.tokenizer, prompt_ids))
            async with aclosing(run_choices(state, usage, engine_requests, output.stopped)) as outputs:
                final = await output.run_turn(outputs)
            await output.end_turn(final)
            calls = output.turn_items("mcp_call")
            for item in calls:
                await output.run_call(item, lambda item: call(state, turns.offer, item,
                                                              over_budget=output.num_calls > max_tool_calls))
            if (not calls or output.cut or output.turn_items("function_call")
                    or output.turn_items("mcp_approval_request")):
                break
    except ApiError as exc:
        if output.sse is None:
            raise
        await output.error(exc)
    return usage


async def call(state: Any, offer: mcp_tools.McpOffer, item: dict, over_budget: bool = False) -> dict:
    """Run an `mcp_call` item's call: its output, error and status."""
    if over_budget:  # OpenAI ignores calls past max_tool_calls; the model reads why
        error = {"type": "mcp_protocol_error", "code": -32000, "message": "max_tool_calls reached: not run"}
        return {"output": None, "error": error, "status": "failed"}
    offered = offer.tools.get(item["name"])
    if offered is None:  # an approved call whose tool this request no longer offers
        error = {"type": "mcp_protocol_error", "code": -32601,
                 "message": f"tool {item['name']!r} is not among this request's mcp tools"}
        return {"output": None, "error": error, "status": "failed"}
    return await mcp_tools.call(state, offered, item["name"], item["arguments"])
