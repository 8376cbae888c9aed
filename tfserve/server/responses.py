"""POST /v1/responses: `input` (text or messages) + `instructions` -> one assistant message, whole or as the
Responses event stream (created, in_progress, output_item.added, content_part.added, output_text.delta...,
output_text.done, content_part.done, output_item.done, then completed — or incomplete when cut by
max_output_tokens, as OpenAI does), every event with an increasing `sequence_number`."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from tfserve.server.chat import render_chat, template_kwargs
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.generation import admit, run_choices
from tfserve.server.protocol import field, make_params, param_names, read_json, sampling_kwargs, text_of, use_model
from tfserve.server.sse import EventStream
from tfserve.server.state import STATE

_ROLES = ("system", "developer", "user", "assistant")


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = await use_model(request, body, state)
    for unsupported in ("previous_response_id", "conversation"):
        if body.get(unsupported) is not None:
            raise bad_request(f"{unsupported} is not supported: this server keeps no conversation state", unsupported)
    instructions = field(body, "instructions", str)
    metadata = field(body, "metadata", dict, {})
    messages = parse_input(body, instructions)
    kwargs = sampling_kwargs(body, max_tokens_fields=("max_output_tokens",))
    kwargs.pop("n", None)
    stream = field(body, "stream", bool, False)
    prompt_ids = render_chat(state.engine.tokenizer, messages, None, template_kwargs(state, body))
    names = param_names(body, ("max_output_tokens",), "input")
    params = make_params(kwargs, len(prompt_ids), state.engine, names)
    usage, engine_requests = admit(state, request, [prompt_ids], params, names)
    reply = _Reply(model, instructions, metadata, body, params)
    async with aclosing(run_choices(state, usage, engine_requests)) as outputs:
        if stream:
            return await reply.stream(request, outputs, usage)
        final = None
        async for _, output in outputs:
            final = output if output.finished else final
    return web.json_response(reply.response(final, usage))


def parse_input(body: dict[str, Any], instructions: str | None) -> list[dict[str, str]]:
    """`input` (a string or a list of message items) -> chat messages, `instructions` first as system."""
    items = field(body, "input", (str, list), required=True)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        if item.get("type", "message") != "message":
            raise bad_request(f"{where}.type {item.get('type')!r} is not supported; send message items", f"{where}.type")
        role = field(item, "role", str, required=True, param=f"{where}.role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})", f"{where}.role")
        content = field(item, "content", (str, list), required=True, param=f"{where}.content")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": text_of(content, f"{where}.content")})
    return messages


class _Reply:
    def __init__(self, model: str, instructions: str | None, metadata: dict, body: dict, params: Any) -> None:
        self.model, self.instructions, self.metadata, self.params = model, instructions, metadata, params
        self.max_output_tokens = body.get("max_output_tokens")
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence_number = 0

    def message(self, text: str, status: str) -> dict:
        content = [_text_part(text)] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def response(self, final: Any | None, usage: Any) -> dict:
        """The Response object: in progress (final None) or finished."""
        status, incomplete, output = "in_progress", None, []
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            output = [self.message(final.text, "incomplete" if incomplete else "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": self.params.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "none", "tools": [], "top_p": self.params.top_p, "truncation": "disabled",
            "metadata": self.metadata, "completed_at": int(time.time()) if status == "completed" else None,
            # OpenAI's schema types usage as an object: absent, not null, until there is one
            **({"usage": _usage(usage)} if final is not None else {}),
        }

    async def _event(self, sse: EventStream, kind: str, **data: Any) -> None:
        await sse.send({"type": kind, "sequence_number": self.sequence_number, **data}, event=kind)
        self.sequence_number += 1

    async def stream(self, request: web.Request, outputs, usage) -> web.StreamResponse:
        sse = EventStream(request)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        await self._event(sse, "response.created", response=self.response(None, usage))
        await self._event(sse, "response.in_progress", response=self.response(None, usage))
        await self._event(sse, "response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        await self._event(sse, "response.content_part.added", **where, part=_text_part(""))
        try:
            final = None
            async for _, output in outputs:
                if output.delta_text:
                    await self._event(sse, "response.output_text.delta", **where, delta=output.delta_text, logprobs=[])
                final = output if output.finished else final
        except ApiError as exc:
            await self._event(sse, "error", code=exc.code or exc.type, message=exc.message, param=exc.param)
            return await sse.close()
        done = self.response(final, usage)
        item = done["output"][0]
        await self._event(sse, "response.output_text.done", **where, text=final.text, logprobs=[])
        await self._event(sse, "response.content_part.done", **where, part=_text_part(final.text))
        await self._event(sse, "response.output_item.done", output_index=0, item=item)
        await self._event(sse, f"response.{done['status']}", response=done)
        return await sse.close()


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Any) -> dict:
    # the prompt tokens not read from the prefix cache were computed and written to it
    details = {"cached_tokens": usage.num_cached_tokens,
               "cache_write_tokens": usage.prompt_tokens - usage.num_cached_tokens}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
