"""Ollama's generating API: POST /api/chat and POST /api/generate, whole or as NDJSON lines (`stream` defaults
to true, as in Ollama). A request becomes the engine requests /v1/chat/completions makes (the same template,
grammar, tool-call parser); `options` map onto sampling, and an option that would change the output but is
not honoured is a 400. The model listing routes (/api/tags, /api/show, /api/ps, /api/version, /api/embed)
are in `ollama_models`."""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from tfserve.protocol.chat_template import has_chat_template
from tfserve.protocol.events import ReasoningDelta, TextDelta, merge
from tfserve.protocol.reasoning import reasoning_for
from tfserve.protocol.reply import ReplyParser
from tfserve.protocol.tool_formats import detect_format
from tfserve.server.api import ollama_models
from tfserve.server.chat_prompt import INLINE_PROMPT_CHARS, render_chat, render_multimodal, text_chars
from tfserve.server.errors import ApiError, bad_request, error_for
from tfserve.server.generation import admit, check_text_fits, run_choices
from tfserve.server.media import gather_images
from tfserve.server.protocol import make_params, read_json
from tfserve.server.requests.ollama import OllamaChatRequest, OllamaGenerateRequest
from tfserve.server.runtime.request_limits import check_messages
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.threads import in_daemon_thread
from tfserve.server.sse import EventStream
from tfserve.server.tools.output_spec import apply_spec, output_spec


def add_routes(app: web.Application) -> None:
    """Ollama's routes on `app`."""
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    ollama_models.add_routes(app)


async def chat(request: web.Request) -> web.StreamResponse:
    """POST /api/chat: `messages` (with `images`, `tool_calls`, `tool_name`), `tools`, `format`, `options`,
    `think` -> `message` (with `thinking`, `tool_calls`)."""
    state, body = request.app[STATE], await read_json(request)
    # on the raw body, before parsing, on purpose: the count alone refuses 400,000 messages cheaply
    check_messages(state.limits, body.get("messages"))
    typed = OllamaChatRequest.parse(body)
    model = await ollama_models.use_model(request, typed.model, state)
    if not typed.messages.rendered:  # Ollama's way to load a model: nothing to answer
        return web.json_response(_loaded(model, "message"))
    return await _run(request, state, typed, model, "message")


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /api/generate: a `prompt` (with `system`, `images`) through the chat template, or as it is with `raw`
    (or for a model without a template) -> `response`."""
    state = request.app[STATE]
    typed = OllamaGenerateRequest.parse(await read_json(request))
    model = await ollama_models.use_model(request, typed.model, state)
    prompt, images = typed.prompt, typed.images
    if not prompt and not images:
        return web.json_response(_loaded(model, "response"))
    if not typed.raw and has_chat_template(state.engine.tokenizer):
        return await _run(request, state, typed, model, "response")
    if images:
        raise bad_request("images need the chat template: leave out raw", "images")
    check_text_fits(state, len(prompt), "prompt")
    if len(prompt) < INLINE_PROMPT_CHARS:
        ids = state.engine.tokenizer.encode(prompt)
    else:  # megabytes of text to tokenize: on a thread, the event loop serving the others meanwhile
        ids = await in_daemon_thread(state.engine.tokenizer.encode, prompt)
    return await _run(request, state, typed, model, "response", prompt_ids=ids)


async def _run(request: web.Request, state: Any, typed: OllamaChatRequest | OllamaGenerateRequest, model: str,
               shape: str, prompt_ids: list[int] | None = None) -> web.StreamResponse:
    """Generate one reply and answer it in `shape`: "message" (/api/chat) or "response" (/api/generate); through
    the chat template unless `prompt_ids` are given (a raw prompt)."""
    kwargs = typed.sampling_kwargs()
    think, stream = typed.think, typed.stream is not False  # every field is checked before the engine requests
    tokenizer, tools = state.engine.tokenizer, typed.function_tools
    tool_format = detect_format(tokenizer)
    spec = output_spec(typed.constraint, tools, typed.tool_choice, True, tool_format, tokenizer)
    await apply_spec(state.engine, kwargs, spec, tokenizer)
    variables = {**state.chat_template_kwargs, **({"enable_thinking": False} if think is False else {})}
    if prompt_ids is None:
        messages = typed.messages.rendered
        check_text_fits(state, text_chars(messages), "messages")
        images = await gather_images(state, typed.messages.image_refs)
        if images:
            prompt_ids, mm = await render_multimodal(state, messages, images, tools, variables)
        else:
            prompt_ids, mm = await render_chat(tokenizer, messages, tools, variables), None
    else:
        mm = None
    names = {"max_tokens": "options.num_predict", "prompt": "messages" if shape == "message" else "prompt"}
    params = make_params(kwargs, len(prompt_ids), state.engine, names)
    usage, engine_requests = admit(state, request, [prompt_ids], params, names, mm=mm)
    parser = ReplyParser(tool_format if spec.parses_calls else None, reasoning_for(tokenizer, prompt_ids))
    reply = _Reply(model, shape, parser, think is not False)
    async with aclosing(run_choices(state, usage, engine_requests)) as outputs:
        if not stream:
            parts: list[dict] = [part async for part in reply.parts(outputs, usage)]
            return web.json_response(_joined(parts, shape))
        lines = _Lines(request)
        try:
            async for part in reply.parts(outputs, usage):
                await lines.send(part)
        except ApiError as exc:
            if not lines.is_open:
                raise
            await lines.send(error_for(request.path, exc)[0])
        return await lines.close()


class _Reply:
    """One reply's NDJSON parts: text (or thinking) as it comes, the tool calls once whole, then the final part
    with `done` and the counts."""

    def __init__(self, model: str, shape: str, parser: ReplyParser, think: bool) -> None:
        self.model, self.shape, self.parser, self.think = model, shape, parser, think
        self.started_ns = time.perf_counter_ns()

    def part(self, content: str = "", thinking: str = "", **extra: Any) -> dict[str, Any]:
        key = "content" if self.shape == "message" else "response"
        text: dict[str, Any] = {key: content, **({"thinking": thinking} if thinking and self.think else {})}
        if self.shape == "message":
            text = {"message": {"role": "assistant", **text, **extra.pop("message", {})}}
        return {"model": self.model, "created_at": _now(), **text, "done": False, **extra}

    async def parts(self, outputs: Any, usage: Any):
        calls: list = []
        final = None
        async for _, output in outputs:
            final = output
            events = self.parser.feed(output)
            thinking = "".join(event for event in events if isinstance(event, ReasoningDelta))
            content = "".join(event for event in events if isinstance(event, TextDelta))
            calls += [event for event in events if not isinstance(event, str)]  # calls and their arguments
            if content or (thinking and self.think):
                yield self.part(content, thinking)
        if calls:  # whole once the reply has ended
            yield self.part(message={"tool_calls": [ollama_call(call) for call in merge(calls)[1]]})
        elapsed_ns = time.perf_counter_ns() - self.started_ns
        first_ns = int((usage.ttft_s or 0) * 1e9)
        done = self.part(done_reason="length" if final.finish_reason == "length" else "stop",
                         total_duration=elapsed_ns, load_duration=0, prompt_eval_count=usage.prompt_tokens,
                         prompt_eval_duration=first_ns, eval_count=len(final.generated_tokens),
                         eval_duration=max(elapsed_ns - first_ns, 0))
        done["done"] = True
        if self.shape == "response":
            done["context"] = list(final.prompt_token_ids) + list(final.generated_tokens)
        yield done


def _joined(parts: list[dict], shape: str) -> dict[str, Any]:
    """The parts of a reply as one object (the last part's counts, the texts and calls joined)."""
    whole = dict(parts[-1])
    if shape == "response":
        whole["response"] = "".join(p["response"] for p in parts)
        thinking = "".join(p.get("thinking", "") for p in parts)
    else:
        message = whole["message"] = {"role": "assistant", "content": "".join(p["message"]["content"] for p in parts)}
        thinking = "".join(p["message"].get("thinking", "") for p in parts)
        calls = [c for p in parts for c in p["message"].get("tool_calls", ())]
        if calls:
            message["tool_calls"] = calls
        whole = {**whole, "message": message}
    if thinking:
        (whole["message"] if shape == "message" else whole)["thinking"] = thinking
    return whole


def _loaded(model: str, shape: str) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to answer: the model is loaded."""
    text = {"message": {"role": "assistant", "content": ""}} if shape == "message" else {"response": ""}
    return {"model": model, "created_at": _now(), **text, "done": True, "done_reason": "load"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class _Lines(EventStream):
    """Ollama's stream: one JSON object a line (application/x-ndjson), no closing marker."""

    def __init__(self, request: web.Request) -> None:
        super().__init__(request)
        self.response.headers["Content-Type"] = "application/x-ndjson"

    async def send(self, data: dict[str, Any], event: str | None = None) -> None:
        await self.open()
        await self.response.write(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")


def ollama_call(call: Any) -> dict[str, Any]:
    """A parsed call in Ollama's shape: arguments as an object (a model's malformed JSON: its text as it is)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = call.arguments
    return {"function": {"index": call.index, "name": call.name, "arguments": arguments}}
