"""Hermes/Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's
text become OpenAI `tool_calls`, whole (`parse_tool_calls`) or while streaming (`ToolCallStream`).

A block whose JSON does not parse is left in the content as the model wrote it: never lose text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

START = "<tool_call>"
END = "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    index: int = 0  # position among the calls of one reply

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call = {"index": index, **call}
        return call


def parse_call(raw: str) -> ToolCall | None:
    """The JSON inside one `<tool_call>` block -> a ToolCall, or None when it is not one."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(data["name"], arguments)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a whole output into (content outside the blocks, or None when empty; the calls)."""
    stream = ToolCallStream()
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        content = content.strip()
    return content or None, calls


class ToolCallStream:
    """Feed text deltas, get back content strings and whole ToolCalls in order.

    Text that may be the start of `<tool_call>` is held back until it is clearly not; a block is
    emitted as one ToolCall once `</tool_call>` arrives (or at `finish`, for a model stopped right before it).
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._pending_space = ""  # trailing whitespace: content if text follows, dropped if a call does
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        events: list[str | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    return events
                raw, self._buffer = self._buffer[:end], self._buffer[end + len(END):]
                self._in_call = False
                self._emit_block(raw, closed=True, events=events)
                continue
            start = self._buffer.find(START)
            if start >= 0:
                self._emit_text(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(START):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, START)
            self._emit_text(self._buffer[: len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return events

    def finish(self) -> list[str | ToolCall]:
        """Whatever is still held: an unclosed block that parses is a call, anything else is content."""
        events: list[str | ToolCall] = []
        if self._in_call:
            self._emit_block(self._buffer, closed=False, events=events)
        else:
            self._emit_text(self._buffer, events)
        if self._pending_space and not self.num_calls:
            events.append(self._pending_space)
        self._buffer, self._in_call, self._pending_space = "", False, ""
        return events

    def _emit_block(self, raw: str, closed: bool, events: list) -> None:
        call = parse_call(raw.strip())
        if call is None:
            self._emit_text(START + raw + (END if closed else ""), events, force=True)
            return
        call.index = self.num_calls
        self.num_calls += 1
        self._pending_space = ""  # models write newlines around calls; those are not content
        events.append(call)

    def _emit_text(self, text: str, events: list, force: bool = False) -> None:
        text = self._pending_space + text
        body = text if force else text.rstrip()
        self._pending_space = text[len(body):]
        if body:
            events.append(body)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
