"""`LocalBackend`: chat with a model loaded in this process, through the engine's `BatchingManager` (no
server). The CLI loads the model; this module only renders the chat template and streams."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

from tfserve.chat.client import ChatError, ReplyStats
from tfserve.chat.conversation import DEFAULT_MAX_TOKENS, Settings
from tfserve.engine.chat_template import ChatTemplateError, has_chat_template, render_chat
from tfserve.engine.request import RequestOutput

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

    def stream(self, messages: list[dict[str, str]], settings: Settings) -> _LocalReply:
        prompt_ids = self._render(messages)
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        try:  # the model's generation_config fills what the settings leave out, as the server does
            params = self.engine.sampling_params(len(prompt_ids), **settings.sampling_kwargs())
            if settings.max_tokens is None and params.max_tokens > DEFAULT_MAX_TOKENS:
                params = params.replace(max_tokens=DEFAULT_MAX_TOKENS)
            request_id = self.manager.add_request(prompt_ids, params=params, stream=True, sink=outputs.put)
        except ValueError as exc:
            raise ChatError(str(exc)) from None
        return _LocalReply(self.manager, request_id, outputs, len(prompt_ids))

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            return render_chat(self.engine.tokenizer, messages)
        except ChatTemplateError as exc:
            raise ChatError(str(exc)) from None

    def close(self) -> None:
        self.manager.stop()


class _LocalReply:
    """The deltas of one request on the engine."""

    def __init__(self, manager: Any, request_id: str, outputs: queue.SimpleQueue, num_prompt_tokens: int) -> None:
        self._manager, self._request_id, self._outputs = manager, request_id, outputs
        self.stats = ReplyStats(num_prompt_tokens=num_prompt_tokens)

    def __iter__(self) -> Iterator[str]:
        while self.stats.finish_reason is None:
            try:
                output = self._outputs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if output.finished:
                self.stats.finish_reason = output.finish_reason
                self.stats.num_completion_tokens = len(output.generated_tokens)
                if output.finish_reason == "error":
                    raise ChatError(f"generation failed: {output.error}")
            if output.delta_text:
                yield output.delta_text

    def close(self) -> None:
        """Abort the request if it is still running; its KV blocks are freed before the next step."""
        if self.stats.finish_reason is None:
            self._manager.abort(self._request_id)
