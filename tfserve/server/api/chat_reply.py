"""A chat completion's reply: the engine's outputs of each choice through the one reply parser
(`tfserve.protocol.reply.ReplyParser`) into OpenAI's `chat.completion` body, or its stream of chunks (role chunk,
reasoning and content and tool-call chunks, a finish chunk per choice, a usage chunk when asked, [DONE])."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tfserve.protocol.events import ArgumentsDelta, ReasoningDelta, ToolCall, merge
from tfserve.protocol.reasoning import Reasoning
from tfserve.protocol.reply import ReplyParser
from tfserve.server.api.logprobs import chat_logprobs, prompt_logprobs, shown
from tfserve.server.errors import ApiError
from tfserve.server.generation import Reply
from tfserve.server.sse import EventStream
from tfserve.server.tools import chat_functions


class ChatReply(Reply):
    """Builds one chat request's response objects, whole (`complete`) or streamed (`stream`)."""

    chunk_object = "chat.completion.chunk"
    num_prompt_top: int | None = None  # vLLM's prompt_logprobs: the top tokens shown per prompt token

    def __init__(self, state: Any, model: str, num_top: int | None, parse_tools_enabled: bool,
                 tool_format: Any = None, legacy: bool = False) -> None:
        super().__init__(model, "chatcmpl")
        self.state, self.num_top, self.tools = state, num_top, parse_tools_enabled
        self.tool_format = tool_format
        self.legacy = legacy  # the request gave the legacy functions: calls go back as function_call
        self.reasoning: Reasoning | None = None  # a reasoning model's split of the output (reasoning_for)
        self.parsers: dict[int, ReplyParser] = {}  # one per choice
        self.stopped: set[int] = set()  # choices ended early (a repeated tool call), for run_choices
        self.echo = ""  # vLLM's `echo`: the last (assistant) message's text, which every choice's content begins with

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        if self.num_top is None:
            return None
        return {"content": chat_logprobs(entries or [], self.state.token_texts, self.num_top), "refusal": None}

    def _start(self, n: int) -> dict[int, ReplyParser]:
        tool_format = self.tool_format if self.tools else None
        self.parsers = {i: ReplyParser(tool_format, self.reasoning) for i in range(n)}
        return self.parsers

    def _feed(self, index: int, output: Any) -> list:
        """One output of choice `index` -> its events; a reply that repeats a call is ended there (its engine
        request aborted by run_choices)."""
        parser = self.parsers[index]
        events = parser.feed(output)
        if parser.repeated:
            self.stopped.add(index)
        return events

    async def complete(self, outputs, usage, n: int) -> web.Response:
        """The whole `chat.completion` body, the outputs fed as they come (as when streamed: the same split, calls
        and count)."""
        parsers = self._start(n)
        last: dict[int, Any] = {}
        events: dict[int, list] = {i: [] for i in range(n)}
        async for index, output in outputs:
            last[index] = output
            events[index] += self._feed(index, output)
        choices = []
        for index in range(n):
            output, parser = last[index], parsers[index]
            content, calls = merge(events[index])  # without a call cut short, whose markup is not content
            message: dict[str, Any] = {"role": "assistant", "content": content or "", "refusal": None}
            if parser.splits_reasoning:  # vLLM's field; present (null when empty) for every reasoning model
                thought = "".join(event for event in events[index] if isinstance(event, ReasoningDelta))
                message["reasoning_content"] = thought or None
            finish_reason = parser.finish_reason()
            if calls:
                message.update(content=content, tool_calls=[call.to_openai() for call in calls])
                if self.legacy:
                    chat_functions.reply_message(message)
                    finish_reason = chat_functions.finish_reason(finish_reason)
            if self.echo and isinstance(message["content"], str):
                message["content"] = self.echo + message["content"]
            choices.append({"index": index, "message": message,
                            "logprobs": self._logprobs(shown(output.logprobs, output)), "finish_reason": finish_reason,
                            **self.stop_reason(output)})
        return web.json_response(self.envelope("chat.completion", choices, usage=self._usage(usage),
                                               **self._prompt_logprobs(last[0])))

    def _prompt_logprobs(self, output: Any) -> dict:
        """vLLM's `prompt_logprobs`, when asked for: on the response, not a choice (every choice has one prompt)."""
        if self.num_prompt_top is None:
            return {}
        entries = output.prompt_logprobs or []
        return {"prompt_logprobs": prompt_logprobs(entries, self.state.token_texts, self.num_prompt_top)}

    def _usage(self, usage: Any) -> dict:
        body = usage.to_openai()
        if self.reasoning is not None:
            num_tokens = sum(parser.num_reasoning_tokens for parser in self.parsers.values())
            body["completion_tokens_details"] = {"reasoning_tokens": num_tokens}
        return body

    async def stream(self, request: web.Request, outputs, usage, include_usage: bool, n: int) -> web.StreamResponse:
        """The chunks of every choice as its outputs come, then the usage chunk (when asked) and [DONE]."""
        sse = EventStream(request)
        parsers = self._start(n)
        started: set[int] = set()
        try:
            async for index, output in outputs:
                parser = parsers[index]
                if index not in started:  # content null where the reply may be calls, as OpenAI's are
                    started.add(index)
                    opening = {"role": "assistant", "content": None if parser.parses_calls else ""}
                    await sse.send(self.chunk([{"index": index, "delta": opening, "logprobs": None,
                                                 "finish_reason": None}], include_usage))
                    if self.echo:
                        await sse.send(self.chunk([{"index": index, "delta": {"content": self.echo},
                                                     "logprobs": None, "finish_reason": None}], include_usage))
                for delta in self._deltas(index, output):
                    await sse.send(self.chunk([delta], include_usage))
                if output.finished or index in self.stopped:
                    finish_reason = parser.finish_reason()
                    if self.legacy:
                        finish_reason = chat_functions.finish_reason(finish_reason)
                    await sse.send(self.chunk([{"index": index, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish_reason,
                                                 **(self.stop_reason(output) if output.finished else {})}],
                                              include_usage))
            if include_usage:
                await sse.send(self.chunk([], True, self._usage(usage)))
        except ApiError as exc:
            if not sse.is_open:
                raise
            await sse.send_error(exc)
        return await sse.done()

    def _deltas(self, index: int, output: Any) -> list[dict]:
        """One output's choice deltas: reasoning first, then content and calls as the model wrote them."""
        entries = shown(output.delta_logprobs, output)
        logprobs = self._logprobs(entries) if entries else None
        deltas, first_shown = [], None
        for event in self._feed(index, output):
            if isinstance(event, ReasoningDelta):
                delta: dict[str, Any] = {"reasoning_content": str(event)}
            elif isinstance(event, ToolCall):  # a call opens: id and name (arguments follow, or are whole here)
                delta = {"tool_calls": [event.to_openai(index=event.index)]}
            elif isinstance(event, ArgumentsDelta):
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            else:
                delta = {"content": str(event)}
            if self.legacy:
                delta = chat_functions.reply_delta(delta)
            if first_shown is None and not isinstance(event, ReasoningDelta):
                first_shown = len(deltas)
            deltas.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
        if logprobs is not None:  # the tokens' logprobs ride on this step's first content or call, or their own
            if first_shown is not None:
                deltas[first_shown]["logprobs"] = logprobs
            else:
                deltas.append({"index": index, "delta": {"content": ""}, "logprobs": logprobs, "finish_reason": None})
        return deltas
