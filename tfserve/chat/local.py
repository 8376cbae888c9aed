"""`LocalBackend`: chat with a model loaded in this process, through the engine's `BatchingManager` (no
server). The CLI loads the model; this module only renders the chat template and streams. The reply is read
by the server's own parser (`tfserve.protocol.reply`): a reasoning model's thinking apart, with tools their calls.
Images (data URL parts, as /image sends them) are decoded here and rendered by the engine's processor, as the
server does."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

from tfserve.chat.backend import ChatError, ContextFull, ReplyStats, Thinking, max_context_tokens_in
from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings
from tfserve.protocol.chat_template import has_chat_template, render_chat
from tfserve.protocol.events import ReasoningDelta, TextDelta, merge
from tfserve.protocol.reasoning import reasoning_for
from tfserve.protocol.reply import ReplyParser
from tfserve.protocol.tool_formats import detect_format
from tfserve.engine.request import RequestOutput
from tfserve.errors import ContextLengthError
from tfserve.images import ImageError, MediaImage, data_url_bytes, decode_image

POLL_S = 0.1  # wait for outputs in slices so Ctrl-C is seen at once


class LocalBackend:
    """The engine of a `BatchingManager` (started here if it is not yet) answers, under `model`'s name."""

    label = "in-process"

    def __init__(self, manager: Any, model: str) -> None:
        self.manager = manager.start()
        self.engine = manager.engine
        self.model = model
        if not has_chat_template(self.engine.tokenizer):
            raise ChatError(f"{model} has no chat template, so it cannot chat; try an instruct model")

    def list_models(self) -> list[str]:
        return [self.model]

    def stream(self, messages: list[dict[str, Any]], settings: Settings,
               tools: list[dict] | None = None, tool_choice: str = "auto") -> _LocalReply:
        # in-process the model is offered the tools and chooses ("required" is enforced by a server's grammar)
        tools = None if tool_choice == "none" else tools
        messages, images = self._split_images(messages)
        prompt_ids, mm = self._render([_template_message(m) for m in messages], tools or None, images)
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        try:  # the model's generation_config fills what the settings leave out, as the server does
            params = self.engine.sampling_params(len(prompt_ids), **settings.sampling_kwargs())
            if settings.max_tokens is None and params.max_tokens > DEFAULT_MAX_TOKENS:
                params = params.replace(max_tokens=DEFAULT_MAX_TOKENS)
            num_tokens = len(prompt_ids) + params.max_tokens
            context_capped = settings.max_tokens is None and num_tokens >= self.engine.max_model_len
            if mm is None:
                request_id = self.manager.add_request(prompt_ids, params=params, stream=True, sink=outputs.put)
            else:  # the engine builds the request with its vision inputs, as the server's admit does
                requests = self.engine.make_requests(prompt_ids, params, mm=mm)
                request_id = self.manager.add_requests(requests, stream=True, sink=outputs.put)[0]
        except ContextLengthError as exc:
            if exc.param == "prompt":  # the conversation alone fills the context
                raise ContextFull(max_context_tokens_in(str(exc))) from None
            raise ChatError(str(exc)) from None
        except ValueError as exc:
            raise ChatError(str(exc)) from None
        stats = ReplyStats(num_prompt_tokens=len(prompt_ids), context_capped=context_capped,
                           max_context_tokens=num_tokens if context_capped else None)
        tokenizer = self.engine.tokenizer
        parser = ReplyParser(detect_format(tokenizer) if tools else None, reasoning_for(tokenizer, prompt_ids))
        return _LocalReply(self.manager, request_id, outputs, stats, parser)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                images: list[MediaImage]) -> tuple[list[int], Any]:
        """(prompt ids, the engine's vision inputs or None) through the chat template, or the processor."""
        try:
            if not images:
                return render_chat(self.engine.tokenizer, messages, tools), None
            return self.engine.render_multimodal(messages, images, tools=tools, template_kwargs=None,
                                                 add_generation_prompt=True, continue_final_message=False)
        except ValueError as exc:  # ChatTemplateError, or more images than the model takes
            raise ChatError(str(exc)) from None

    def _split_images(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaImage]]:
        """Content parts -> HF-style parts (`{"type": "image"}` where an image was) and the decoded images in
        order; text-only content as it was (joined when it came as parts)."""
        result, images = [], []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):
                parts = [self._part(part, f"messages[{i}].content[{j}]", images) for j, part in enumerate(content)]
                joined = all(part["type"] == "text" for part in parts)
                message = {**message, "content": "".join(p["text"] for p in parts) if joined else parts}
            result.append(message)
        return result, images

    def _part(self, part: dict[str, Any], where: str, images: list[MediaImage]) -> dict[str, Any]:
        if part.get("type") != "image_url":
            return {"type": "text", "text": part.get("text") or ""}
        if getattr(self.engine, "processor", None) is None:
            raise ChatError(f"{self.model} does not take images: send text, or chat with a vision-language model")
        url = (part.get("image_url") or {}).get("url", "")
        try:
            if not url.startswith("data:"):
                raise ImageError("the in-process chat reads data: URLs only (as /image attaches them)")
            images.append(decode_image(data_url_bytes(url), where))
        except ImageError as exc:
            raise ChatError(f"image {len(images) + 1}: {exc}") from None
        return {"type": "image"}

    def close(self) -> None:
        self.manager.stop()


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """Chat templates read a call's `arguments` as a mapping (HF's convention); OpenAI's is a JSON string."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            pass  # left as the model wrote it
        calls.append({**call, "function": function})
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


class _LocalReply:
    """The deltas of one request on the engine, read by the reply `parser`: a reasoning model's thinking comes as
    `Thinking`, calls are kept out of the text and land in `stats.tool_calls` at the end."""

    def __init__(self, manager: Any, request_id: str, outputs: queue.SimpleQueue, stats: ReplyStats,
                 parser: ReplyParser | None = None) -> None:
        self._manager, self._request_id, self._outputs = manager, request_id, outputs
        self._parser = parser or ReplyParser()
        self._call_events: list = []
        self._finished = False  # the engine is done with the request
        self.stats = stats

    def __iter__(self) -> Iterator[str]:
        for output in self._engine_outputs():
            for event in self._parser.feed(output):
                if isinstance(event, ReasoningDelta):
                    yield Thinking(event)
                elif isinstance(event, TextDelta):
                    yield str(event)
                else:
                    self._call_events.append(event)
            if self._parser.repeated:  # a small model repeating a call: that reply is over (close() aborts it)
                break
        _, calls = merge(self._call_events)
        self.stats.tool_calls = [call.to_openai() for call in calls]
        if calls:
            self.stats.finish_reason = self._parser.finish_reason()

    def _engine_outputs(self) -> Iterator[RequestOutput]:
        while self.stats.finish_reason is None:
            try:
                output = self._outputs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if output.finished:
                self._finished = True
                self.stats.finish_reason = output.finish_reason
                self.stats.num_completion_tokens = len(output.generated_tokens)
                if output.finish_reason == "error":
                    raise ChatError(f"generation failed: {output.error}")
            yield output

    def close(self) -> None:
        """Abort the request if it is still running; its KV blocks are freed before the next step."""
        if not self._finished:
            self._manager.abort(self._request_id)
