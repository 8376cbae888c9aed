"""One reply parser: a model's output -> events, the same for every caller (chat completions whole or streamed, the
Responses API's items, Ollama's parts, the in-process chat).

A reasoning model's thinking comes first (`ReasoningDelta`), split off by `reasoning.ReasoningStream`; the rest
is content (`TextDelta`) and, where the request offered tools, the calls in the model's format (`ToolCall`, then
`ArgumentsDelta`s) read by `tool_calls.ToolCallStream`. Whole replies are streamed ones fed at once: feed every
output, then read the events (`events.merge` joins them) and `finish_reason()`.
"""

from __future__ import annotations

from typing import Any

from tfserve.protocol.events import ReasoningDelta, TextDelta
from tfserve.protocol.reasoning import Reasoning
from tfserve.protocol.tool_calls import ToolCallStream
from tfserve.protocol.tool_formats import ToolCallFormat


def cut_short(output: Any) -> bool:
    """The engine ended the `output` before the model did: max_tokens, or a stop string (never inside a forced reply
    of calls; `tool_choice` "auto" leaves them to the text and calls alike)."""
    return output.finish_reason == "length" or (output.finish_reason == "stop" and isinstance(output.stop_reason, str))


class ReplyParser:
    """Feed one reply's engine outputs (or plain text deltas), get back its events in the order the model wrote
    them. `tool_format`: the model's call format, or None where the request offered no tools (all text is
    content); `reasoning`: how a reasoning model's output splits (`reasoning.reasoning_for`), or None."""

    def __init__(self, tool_format: ToolCallFormat | None = None, reasoning: Reasoning | None = None) -> None:
        self._splitter = reasoning.stream() if reasoning is not None else None
        self._calls = ToolCallStream(tool_format) if tool_format is not None else None
        self.finished = False  # the engine's last output (or `finish`) was fed
        self._engine_reason: str | None = None  # why the engine ended the output

    @property
    def parses_calls(self) -> bool:
        """Whether tool calls are read from the text (the request offered tools)."""
        return self._calls is not None

    @property
    def splits_reasoning(self) -> bool:
        """Whether the model is a reasoning model (its reply may hold reasoning; vLLM shows the field then)."""
        return self._splitter is not None

    @property
    def num_calls(self) -> int:
        """The calls handed out so far."""
        return self._calls.num_calls if self._calls is not None else 0

    @property
    def repeated(self) -> bool:
        """The model repeated an earlier call of this reply: the reply is over (the caller aborts its request)."""
        return self._calls is not None and self._calls.repeated

    @property
    def num_reasoning_tokens(self) -> int:
        """The tokens fed while the model was reasoning (`ReasoningStream.num_reasoning_tokens`)."""
        return self._splitter.num_reasoning_tokens if self._splitter is not None else 0

    @property
    def reasoning_closed(self) -> bool:
        """The reasoning block was closed by its marker: whole even where the reply was cut."""
        return self._splitter is not None and self._splitter.closed

    def feed(self, output: Any) -> list:
        """One engine output (its `delta_text`, `delta_tokens` and, on the last, `finish_reason` and `stop_reason`)
        or one text delta -> the events it completes."""
        if isinstance(output, str):
            return self._feed(output, 0, None)
        return self._feed(output.delta_text, len(output.delta_tokens), output if output.finished else None)

    def finish(self, finish_reason: str | None = "stop", stop_reason: Any = None) -> list:
        """The end of a reply fed as text: whatever the parsers held back, as events."""
        return self._feed("", 0, _End(finish_reason, stop_reason))

    def finish_reason(self) -> str | None:
        """OpenAI's finish reason: the engine's, except that a reply with calls ends "tool_calls", also where
        max_tokens or a stop string cut only what the parser held back (a repeat of a call, the next call's
        marker), since every call shown is whole; a call that a stop string cut open ends "stop". None while the
        reply runs, unless a repeated call ended it."""
        reason = self._engine_reason
        if not self.num_calls or not (self.finished or self.repeated):
            return reason
        if reason is None or self._calls.calls_whole or (reason == "stop" and not self._calls.cut):
            return "tool_calls"
        return reason

    def _feed(self, text: str, num_tokens: int, end: Any) -> list:
        if self.finished:
            return []
        events: list = []
        if self._splitter is not None:
            reasoning, text = self._splitter.feed(text, num_tokens)
            if end is not None:
                more_reasoning, more_text = self._splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                events.append(ReasoningDelta(reasoning))
        if end is not None:
            self.finished, self._engine_reason = True, end.finish_reason
        if self._calls is None:
            return events + ([TextDelta(text)] if text else [])
        found = self._calls.feed(text)
        if end is not None:
            found += self._calls.finish(cut=cut_short(end))
        return events + [TextDelta(event) if isinstance(event, str) else event for event in found]


class _End:
    """Why a reply fed as text ended, in an engine output's terms."""

    __slots__ = ("finish_reason", "stop_reason")

    def __init__(self, finish_reason: str | None, stop_reason: Any) -> None:
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
