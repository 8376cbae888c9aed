"""Chat completions with `mcp` tools (a tfserve extension: `tools: [{"type": "mcp", "server_label": ...}]`): the
server runs the model's calls of them as /v1/responses does (tool_loop) and answers once the model has. The
calls come back in `message.mcp_calls` (streamed: a `delta.mcp_calls` chunk as each call ends), in the shape of
the Responses API's `mcp_call` items; text of every turn is the message's content; calls of the client's own
function tools end the reply as usual (`tool_calls`, finish_reason "tool_calls").

There is no approval round trip on chat: a tool the operator configured runs when the model calls it, and a
request asking for approval is a 400 pointing at /v1/responses."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tfserve.server.api.response_output import ResponseOutput
from tfserve.server.chat_prompt import parse_tools
from tfserve.server.errors import bad_request
from tfserve.server.generation import Reply
from tfserve.server.media import ImageRef, gather_images
from tfserve.server.tools import mcp_tools
from tfserve.server.tools.tool_loop import Turns, run_loop


async def chat_with_mcp(request: web.Request, state: Any, model: str, messages: list[dict],
                        image_refs: list[ImageRef] | None = None, *, typed: Any) -> web.StreamResponse:
    """`typed`: the body's `ChatCompletionRequest` (its sampling fields, constraint and tool choice)."""
    parsed = parse_tools({"tools": typed.tools, "tool_choice": typed.tool_choice})
    function_tools, specs = mcp_tools.split_tools(parsed or [], default_approval="never")
    if typed.n not in (None, 1):
        raise bad_request("n must be 1 with mcp tools", "n")
    for unsupported in ("logprobs", "prompt_logprobs", "continue_final_message"):
        if getattr(typed, unsupported):
            raise bad_request(f"{unsupported} is not supported with mcp tools", unsupported)
    for spec in specs:
        if spec.approval != "never":
            raise bad_request("require_approval is not supported on chat completions (calls run when the model "
                              "makes them): leave it out, or use /v1/responses for approvals",
                              f"{spec.where}.require_approval")
    functions = [{"type": "function", **tool["function"]} for tool in function_tools]  # flat, as on responses
    offer = await mcp_tools.resolve(state, specs, {tool["name"] for tool in functions})
    turns = Turns(state, typed, functions, offer)
    turns.kwargs.pop("n", None)
    await turns.check()
    stream, include_usage = bool(typed.stream), typed.include_usage
    turns.images = await gather_images(state, image_refs or [])
    output = ChatOutput(model, typed, offer, include_usage)
    max_tool_calls = mcp_tools.DEFAULT_MAX_TOOL_CALLS if typed.max_tool_calls is None else typed.max_tool_calls
    usage = await run_loop(state, request, output, turns, messages, max_tool_calls, stream)
    if output.sse is not None:
        if not output.failed:
            await output.finish_chunks(usage)
        return await output.sse.done()
    return web.json_response(output.completion(usage))


class ChatOutput(ResponseOutput):
    """The loop's items as one chat completion choice, whole or as chunks (the Responses events translated)."""

    def __init__(self, model: str, typed: Any, offer: mcp_tools.McpOffer, include_usage: bool) -> None:
        super().__init__(model, typed, None, offer)
        self.reply = Reply(model, "chatcmpl")
        self.reply.chunk_object = "chat.completion.chunk"
        self.include_usage = include_usage

    async def open(self, sse: Any, usage: Any) -> None:
        self.sse = sse
        await self._send({"role": "assistant", "content": ""})

    async def _event(self, kind: str, **data: Any) -> None:
        if self.sse is None:
            return
        if kind == "response.output_text.delta":
            await self._send({"content": data["delta"]})
        elif kind == "response.reasoning_text.delta":
            await self._send({"reasoning_content": data["delta"]})
        elif kind in ("response.mcp_call.completed", "response.mcp_call.failed"):
            await self._send({"mcp_calls": [self.items[data["output_index"]]]})
        elif kind == "response.output_item.done" and data["item"]["type"] == "function_call":
            calls = self._function_calls()
            await self._send({"tool_calls": [dict(calls[-1], index=len(calls) - 1)]})

    async def _send(self, delta: dict) -> None:
        await self.sse.send(self.reply.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                                             self.include_usage))

    async def error(self, exc: Any) -> None:
        self.failed = True
        await self.sse.send_error(exc)

    def _function_calls(self) -> list[dict]:
        return [{"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}}
                for item in self.items if item["type"] == "function_call"]

    def _finish_reason(self) -> str:
        if self.cut:
            return "length"
        return "tool_calls" if self._function_calls() else "stop"

    def _usage(self, usage: Any) -> dict:
        body = usage.to_openai()
        if any(item["type"] == "reasoning" for item in self.items):
            body["completion_tokens_details"] = {"reasoning_tokens": self.num_reasoning_tokens}
        return body

    async def finish_chunks(self, usage: Any) -> None:
        await self.sse.send(self.reply.chunk([{"index": 0, "delta": {}, "logprobs": None,
                                               "finish_reason": self._finish_reason()}], self.include_usage))
        if self.include_usage:
            await self.sse.send(self.reply.chunk([], True, self._usage(usage)))

    def completion(self, usage: Any) -> dict:
        texts = [item["content"][0]["text"] for item in self.items if item["type"] == "message"]
        thoughts = [item["content"][0]["text"] for item in self.items if item["type"] == "reasoning"]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts), "refusal": None}
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        calls = self._function_calls()
        if calls:
            message["tool_calls"] = calls
        message["mcp_calls"] = [item for item in self.items if item["type"] == "mcp_call"]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish_reason()}
        return self.reply.envelope("chat.completion", [choice], usage=self._usage(usage))
