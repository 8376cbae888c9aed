"""What one reply parser hands out (`reply.ReplyParser`): the model's text split into reasoning, content, tool
calls and their arguments, in the order the model wrote them. Text events are `str`s, so they join and compare as
text."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


class ReasoningDelta(str):
    """More of a reasoning model's thinking (the text inside its `<think>` block, markers left out)."""


class TextDelta(str):
    """More of the reply's content: the text outside reasoning and tool calls."""


@dataclass(slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    index: int = 0  # position among the calls of one reply

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's `tool_calls` entry (with `index` for a streamed delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call = {"index": index, **call}
        return call


@dataclass(slots=True)
class ArgumentsDelta:
    """More of the arguments of call `index` (streamed after the ToolCall that opened it with "")."""

    index: int
    text: str


def merge(events: list) -> tuple[str | None, list[ToolCall]]:
    """Events -> (content or None, whole calls); reasoning is not content."""
    calls: list[ToolCall] = []
    texts = []
    for event in events:
        if isinstance(event, ToolCall):
            calls.append(ToolCall(event.name, event.arguments, event.id, event.index))
        elif isinstance(event, ArgumentsDelta):
            calls[-1].arguments += event.text
        elif not isinstance(event, ReasoningDelta):
            texts.append(event)
    content = "".join(texts)
    if calls:
        content = content.strip()
    return content or None, calls
