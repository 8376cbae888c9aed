"""POST /v1/chat/completions: messages -> the model's chat template -> choices, whole or streamed as
OpenAI sends them (role chunk, content chunks, a finish chunk per choice, a usage chunk when asked, [DONE])."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from tfserve.server import chat_functions
from tfserve.server.chat_mcp import chat_with_mcp
from tfserve.server.chat_prompt import (parse_tools, render_chat, render_multimodal, render_options, template_kwargs,
                                        template_arguments, text_chars)
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.generation import Reply, admit, check_text_fits, run_choices
from tfserve.server.logprobs import chat_logprobs, prompt_logprobs, requested_prompt_logprobs, shown, top_count
from tfserve.server.media import ImageRef, content_of, gather_images
from tfserve.server.protocol import (CHAT_FIELDS, check_fields, continuous_usage, field, make_params, one_of,
                                     param_names, read_json, sampling_kwargs, stream_options, use_model)
from tfserve.server.reasoning import Reasoning, ReasoningStream, reasoning_for
from tfserve.server.request_limits import check_messages, check_num_sequences
from tfserve.server.sse import EventStream
from tfserve.server.state import STATE
from tfserve.server.response_format import requested_grammar
from tfserve.engine.tool_calls import ArgumentsDelta, ToolCall, ToolCallStream, cut_short, detect_format, merge
from tfserve.server.tool_choice import apply_constraint, callable_tools, forced_tools, reply_constraint

ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # function: a legacy call's result


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    check_messages(state.limits, body.get("messages"))  # before any is read: the count alone refuses 400,000
    check_num_sequences(state.limits, body.get("n"))
    check_fields(body, CHAT_FIELDS)
    audio_modality = "audio" in (body.get("modalities") or ())
    if audio_modality or body.get("audio") is not None:
        raise bad_request("audio output is not supported: this server answers in text (leave out modalities "
                          "audio and the audio parameter)", "modalities" if audio_modality else "audio")
    body, legacy = chat_functions.as_tools(body)
    model = await use_model(request, body, state)
    messages, image_refs = parse_messages(body)
    if any(isinstance(t, dict) and t.get("type") == "mcp" for t in field(body, "tools", list, [])):
        # the server runs those tools' calls: a loop of turns
        return await chat_with_mcp(request, state, body, model, messages, image_refs)
    max_tokens_fields = ("max_completion_tokens", "max_tokens")
    kwargs = sampling_kwargs(body, max_tokens_fields=max_tokens_fields)
    num_top = parse_logprobs(body)
    if num_top is not None:
        kwargs["logprobs"] = num_top
    tool_format = detect_format(state.engine.tokenizer)
    try:
        tools = parse_tools(body)
        await constrain(state, body, tools, tool_format, kwargs)
    except ApiError as error:
        raise chat_functions.in_legacy_terms(error) if legacy else error from None
    stream, include_usage = stream_options(body)
    num_prompt_top = requested_prompt_logprobs(body, stream)
    if num_prompt_top is not None:
        kwargs["prompt_logprobs"] = num_prompt_top
    echoed = _echoed(body, messages)
    variables, options = template_kwargs(state, body), render_options(body)
    check_text_fits(state, text_chars(messages), "messages")
    images = await gather_images(state, image_refs)  # every field checked first: a bad one fetches nothing
    if images:
        prompt_ids, mm = await render_multimodal(state, messages, images, tools, variables, **options)
    else:
        prompt_ids, mm = await render_chat(state.engine.tokenizer, messages, tools, variables, **options), None
    names = param_names(body, max_tokens_fields, "messages")
    params = make_params(kwargs, len(prompt_ids), state.engine, names)
    usage, engine_requests = admit(state, request, [prompt_ids], params, names, mm=mm)
    reply = _Reply(state, model, num_top, parse_tools_enabled=bool(tools), tool_format=tool_format, legacy=legacy)
    reply.reasoning = reasoning_for(state.engine.tokenizer, prompt_ids)
    reply.num_prompt_top = num_prompt_top
    reply.stop_token_ids = frozenset(params.stop_token_ids)
    reply.echo = echoed
    if continuous_usage(body):
        reply.continuous = usage
    async with aclosing(run_choices(state, usage, engine_requests, reply.stopped)) as outputs:
        if stream:
            return await reply.stream(request, outputs, usage, include_usage, params.n)
        return await reply.complete(outputs, usage, params.n)


def _echoed(body: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """vLLM's chat `echo`: the reply's content starts with the last message's text when that message is the
    assistant's (the reply continues it, `continue_final_message`); else nothing."""
    if not field(body, "echo", bool, False) or messages[-1]["role"] != "assistant":
        return ""
    content = messages[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def parse_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """`messages` -> plain dicts for the chat template (text parts joined, developer -> system; a content with
    image parts stays a list of HF-style parts) and the image parts' refs in order of appearance."""
    messages = field(body, "messages", list, required=True)
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    result, images = [], []
    legacy_call = None  # the id of the last legacy function_call, which a function message answers
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = field(message, "role", str, required=True, param=f"{where}.role")
        one_of(role, ROLES, f"{where}.role")
        tool_calls = field(message, "tool_calls", list, param=f"{where}.tool_calls") if role == "assistant" else None
        if role == "assistant" and not tool_calls and message.get("function_call") is not None:
            tool_calls = [chat_functions.call_of(message, i)]
            legacy_call = tool_calls[0]["id"]
        if role == "function":  # a legacy call's result: a tool message
            message = {**message, "role": "tool", "tool_call_id": legacy_call or chat_functions.call_id(i)}
            field(message, "name", str, required=True, param=f"{where}.name")
            role = "tool"
        content = message.get("content")
        if content is None and role == "assistant":  # a refusal's message: what the model said is its refusal
            content = field(message, "refusal", str, param=f"{where}.refusal")
        if content is None and not tool_calls:
            raise bad_request(f"{where}.content is required", f"{where}.content")
        if content == []:  # as OpenAI: a list of parts holds at least one
            raise bad_request(f"{where}.content must not be an empty array", f"{where}.content")
        rendered: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                    "content": "" if content is None else content_of(content, f"{where}.content",
                                                                                      images)}
        if tool_calls:
            rendered["tool_calls"] = [_template_tool_call(call, f"{where}.tool_calls[{j}]")
                                      for j, call in enumerate(tool_calls)]
        if role == "tool":
            rendered["tool_call_id"] = field(message, "tool_call_id", str, param=f"{where}.tool_call_id")
        name = field(message, "name", str, param=f"{where}.name")
        if name is not None:
            rendered["name"] = name
        result.append(rendered)
    return result, images


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    # chat templates expect `arguments` as a mapping (HF convention); OpenAI sends a JSON string
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request(f"{where} must be an object with a function", where)
    function = call["function"]
    field(call, "id", str, param=f"{where}.id")
    one_of(field(call, "type", str, param=f"{where}.type"), ("function",), f"{where}.type")
    name = field(function, "name", str, required=True, param=f"{where}.function.name")
    arguments = template_arguments(function.get("arguments") or "{}", f"{where}.function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_logprobs(body: dict[str, Any]) -> int | None:
    """`logprobs` + `top_logprobs` -> the engine's top count (None: no logprobs)."""
    logprobs = field(body, "logprobs", bool, False)
    top = top_count(body, "top_logprobs")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if logprobs else None


async def constrain(state: Any, body: dict[str, Any], tools: list | None, tool_format: Any,
                    kwargs: dict[str, Any]) -> None:
    """The grammar a reply must follow, compiled, into `kwargs`: `response_format` (and vLLM's fields), calls of
    the forced tools (`tool_choice` "required" or named) in the model's own format, or either."""
    constraint = requested_grammar(body)
    tool_choice = field(body, "tool_choice", (str, dict))
    forced = forced_tools(tools, tool_choice) if tools else None
    parallel = field(body, "parallel_tool_calls", bool, True)
    tokenizer = state.engine.tokenizer
    offered = callable_tools(tools, tool_choice) if tools else []
    constraint = reply_constraint(constraint, tool_format, offered, forced, parallel, tokenizer)
    await apply_constraint(state.engine, kwargs, constraint, forced, tools, tool_format, tokenizer)


class _Reply(Reply):
    """Builds one request's response objects."""

    chunk_object = "chat.completion.chunk"
    num_prompt_top: int | None = None  # vLLM's prompt_logprobs: the top tokens shown per prompt token

    def __init__(self, state: Any, model: str, num_top: int | None, parse_tools_enabled: bool,
                 tool_format: Any = None, legacy: bool = False) -> None:
        super().__init__(model, "chatcmpl")
        self.state, self.num_top, self.tools = state, num_top, parse_tools_enabled
        self.tool_format = tool_format
        self.legacy = legacy  # the request gave the legacy functions: calls go back as function_call
        self.reasoning: Reasoning | None = None  # a reasoning model's split of the output (reasoning_for)
        self.num_reasoning_tokens = 0
        self.stopped: set[int] = set()  # choices ended early (a repeated tool call), for run_choices
        self.echo = ""  # vLLM's `echo`: the last (assistant) message's text, which every choice's content begins with

    def _logprobs(self, entries: list[dict] | None) -> dict | None:
        if self.num_top is None:
            return None
        return {"content": chat_logprobs(entries or [], self.state.token_texts, self.num_top), "refusal": None}

    async def complete(self, outputs, usage, n: int) -> web.Response:
        last: dict[int, Any] = {}
        splits, parsers = self._splitters(n), self._parsers(n)
        thoughts: dict[int, list[str]] = {i: [] for i in range(n)}
        texts: dict[int, list[str]] = {i: [] for i in range(n)}
        events: dict[int, list] = {i: [] for i in range(n)}
        async for index, output in outputs:  # fed as it comes, as when streamed: the same split, calls and count
            last[index] = output
            reasoning, content = self._split(splits[index], output) if index in splits else ("", output.delta_text)
            thoughts[index].append(reasoning)
            texts[index].append(content)
            if index in parsers:
                events[index] += self._feed(index, parsers[index], content, output)
        choices = []
        for index in range(n):
            output = last[index]
            whole = output.finished and index not in splits
            text = output.text if whole else "".join(texts[index])
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if index in splits:  # vLLM's field; present (null when empty) for every reasoning model
                message["reasoning_content"] = "".join(thoughts[index]) or None
            finish_reason = output.finish_reason
            if index in parsers:
                content, calls = merge(events[index])
                message["content"] = content or ""  # without a call cut short, whose markup is not content
                if calls:
                    message.update(content=content, tool_calls=[call.to_openai() for call in calls])
                    finish_reason = _calls_finish(finish_reason, parsers[index])
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

    def _parsers(self, n: int) -> dict[int, ToolCallStream]:
        return {i: ToolCallStream(self.tool_format) for i in range(n)} if self.tools else {}

    def _feed(self, index: int, parser: ToolCallStream, text: str, output: Any) -> list:
        """Content text of `output` -> tool-call events; a reply that repeats a call is ended there (its engine
        request aborted by run_choices)."""
        events = parser.feed(text)
        if output.finished:
            events += parser.finish(cut=cut_short(output))
        if parser.repeated:
            self.stopped.add(index)
        return events

    def _splitters(self, n: int) -> dict[int, ReasoningStream]:
        return {i: self.reasoning.stream() for i in range(n)} if self.reasoning is not None else {}

    def _split(self, splitter: ReasoningStream, output: Any) -> tuple[str, str]:
        """One output's new text -> (reasoning, content); the splitter's token count joins the reply's."""
        before = splitter.num_reasoning_tokens
        reasoning, content = splitter.feed(output.delta_text, len(output.delta_tokens))
        if output.finished:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        self.num_reasoning_tokens += splitter.num_reasoning_tokens - before
        return reasoning, content

    def _usage(self, usage: Any) -> dict:
        body = usage.to_openai()
        if self.reasoning is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": self.num_reasoning_tokens}
        return body

    async def stream(self, request: web.Request, outputs, usage, include_usage: bool, n: int) -> web.StreamResponse:
        sse = EventStream(request)
        parsers, splits = self._parsers(n), self._splitters(n)
        started: set[int] = set()
        try:
            async for index, output in outputs:
                if index not in started:  # content null where the reply may be calls, as OpenAI's are
                    started.add(index)
                    opening = {"role": "assistant", "content": None if index in parsers else ""}
                    await sse.send(self.chunk([{"index": index, "delta": opening, "logprobs": None,
                                                 "finish_reason": None}], include_usage))
                    if self.echo:
                        await sse.send(self.chunk([{"index": index, "delta": {"content": self.echo},
                                                     "logprobs": None, "finish_reason": None}], include_usage))
                if index in splits:  # reasoning first, then the content goes on as the model's whole text would
                    reasoning, content = self._split(splits[index], output)
                    if reasoning:
                        await sse.send(self.chunk([{"index": index, "delta": {"reasoning_content": reasoning},
                                                     "logprobs": None, "finish_reason": None}], include_usage))
                    output = replace(output, delta_text=content)
                for delta in self._deltas(index, output, parsers.get(index)):
                    await sse.send(self.chunk([delta], include_usage))
                if output.finished or index in self.stopped:
                    finish_reason = output.finish_reason if output.finished else None
                    if parsers.get(index) and parsers[index].num_calls:
                        finish_reason = _calls_finish(finish_reason, parsers[index])
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

    def _deltas(self, index: int, output: Any, parser: ToolCallStream | None) -> list[dict]:
        entries = shown(output.delta_logprobs, output)
        logprobs = self._logprobs(entries) if entries else None
        if parser is None:
            if not output.delta_text and logprobs is None:
                return []
            return [{"index": index, "delta": {"content": output.delta_text}, "logprobs": logprobs,
                     "finish_reason": None}]
        events = self._feed(index, parser, output.delta_text, output)
        deltas = []
        for event in events:
            if isinstance(event, ToolCall):  # a call opens: id and name (arguments follow, or are whole here)
                delta = {"tool_calls": [event.to_openai(index=event.index)]}
            elif isinstance(event, ArgumentsDelta):
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            else:
                delta = {"content": event}
            if self.legacy:
                delta = chat_functions.reply_delta(delta)
            deltas.append({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
        if logprobs is not None:  # logprobs ride on the first chunk of this step, or one of their own
            if deltas:
                deltas[0]["logprobs"] = logprobs
            else:
                deltas.append({"index": index, "delta": {"content": ""}, "logprobs": logprobs, "finish_reason": None})
        return deltas


def _calls_finish(finish_reason: str | None, parser: ToolCallStream) -> str | None:
    """A reply with calls ends with "tool_calls", also where max_tokens or a stop string cut only what the parser
    held back (a repeat of a call, the next call's marker): every call it shows is whole. A call a stop string
    cut open ends "stop"."""
    if finish_reason is None or parser.calls_whole or (finish_reason == "stop" and not parser.cut):
        return "tool_calls"
    return finish_reason
