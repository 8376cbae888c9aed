"""Tool calls in the model's text -> OpenAI `tool_calls`, whole (`parse_tool_calls`) or while streaming
(`ToolCallStream`), in the format the model's chat template uses (`tool_formats.ToolCallFormat`).

Streaming follows OpenAI: a call's first delta carries its id and name with empty arguments, then the
arguments arrive as they are written. A block that is not a call is left in the content as the model wrote
it: never lose text.
"""

from __future__ import annotations

import json
import re

from tfserve.protocol.events import ArgumentsDelta, ToolCall, merge
from tfserve.protocol.tool_formats import HERMES, ToolCallFormat


def parse_call(raw: str) -> ToolCall | None:
    """One call's JSON object -> a ToolCall, or None when it is not one."""
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


def parse_tool_calls(text: str, fmt: ToolCallFormat | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split a whole output into (content outside the calls, or None when empty; the calls)."""
    stream = ToolCallStream(fmt)
    return merge(stream.feed(text) + stream.finish())


# the opening of a call object whose name comes first: its arguments can stream as they are written
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


class ToolCallStream:
    """Feed text deltas, get back content strings, ToolCalls and ArgumentsDeltas in order.

    Text that may be the start of a call region is held back until it is clearly not. Inside a region each
    call object is read as it comes: with its name first, the call opens at once and its arguments stream;
    otherwise it is parsed whole when its object closes.

    A call that repeats an earlier call of the same reply exactly (name and arguments) is dropped and ends the
    reply (`repeated`): small models, allowed several calls, tend to write the same one until max_tokens. While
    a call is still a prefix of an earlier one it is held back, so a client never sees a repeat begin.
    """

    def __init__(self, fmt: ToolCallFormat | None = None) -> None:
        self.fmt = fmt or HERMES
        self._buffer = ""
        self._in_region = False
        self._object: _ObjectReader | None = None  # the call object being read
        self._region_raw = ""  # the region's text so far, given back as content if it holds no call
        self._region_calls = 0
        self._pending_space = ""  # trailing whitespace: content if text follows, dropped if a call does
        self._seen_text = False
        self._done: list[tuple[str, str]] = []  # (name, arguments) of the calls so far
        self._current: list[str] = ["", ""]  # the streaming call's name and arguments so far
        self._held: list | None = None  # its events, while it may still repeat an earlier call
        self.num_calls = 0
        self.repeated = False
        self.cut = False  # the reply was cut short (max_tokens, a stop string)
        self.calls_whole = False  # cut where the reply shown ends with whole calls
        self._text_after_call = False

    def feed(self, text: str) -> list:
        if self.repeated:
            return []
        self._buffer += text
        events: list = []
        while self._buffer:
            if self._in_region:
                if not self._feed_region(events):
                    break
            elif not self._feed_outside(events):
                break
        return events

    def finish(self, cut: bool = False) -> list:
        """Whatever is still held: a call cut short is parsed if it can be, anything else is content, except,
        where the reply was `cut` (max_tokens), a call its format's marker opened: no markup is content."""
        events: list = []
        self.cut = cut
        if self.repeated:
            return events
        # a call whose name and arguments were already streaming (not held as a possible repeat) is cut open
        open_call = self._in_region and self._object is not None and self._object.opened and self._held is None
        if self._held is not None:  # cut short while it was still repeating an earlier call: dropped
            self._held, self.num_calls = None, self.num_calls - 1
        if self._in_region:
            reader = self._object
            call = parse_call(reader.text) if reader is not None and not reader.streaming else None
            # text after a bare `{` (formats without a marker) may be a JSON answer, not a call
            marked = cut and bool(self.fmt.start) and self._region_raw.startswith(self.fmt.start)
            if call is not None:
                self._whole_call(call, events)
            elif self._region_calls == 0 and (reader is None or not reader.streaming) and not marked:
                self._emit_text(self._region_raw + self._buffer, events, force=True)
        elif not (cut and (self.num_calls or self._holds_marker())):  # a marker's beginning, cut: markup
            self._emit_text(self._buffer, events)
        if self._pending_space and not self.num_calls:
            events.append(self._pending_space)
        self.calls_whole = cut and self.num_calls > 0 and not open_call and not self._text_after_call
        self._buffer, self._in_region, self._pending_space, self._object = "", False, "", None
        return events

    def _holds_marker(self) -> bool:
        """The held text begins the format's call marker (`<tool_`; a lone `<` may be text)."""
        held = self._buffer.strip()
        return len(held) > 1 and bool(self.fmt.start) and self.fmt.start.startswith(held)

    def _feed_outside(self, events: list) -> bool:
        fmt = self.fmt
        start = self._buffer.find(fmt.start)
        if fmt.bare_json_start and not self._seen_text and self._buffer.lstrip().startswith("{"):
            start, skip = len(self._buffer) - len(self._buffer.lstrip()), 0
        else:
            skip = len(fmt.start)
        if start >= 0:
            self._emit_text(self._buffer[:start], events)
            self._region_raw = self._buffer[start:start + skip]
            self._buffer = self._buffer[start + skip:]
            self._in_region, self._region_calls = True, 0
            return True
        keep = partial_suffix(self._buffer, fmt.start)
        if fmt.bare_json_start and not self._seen_text and not self._buffer.strip():
            keep = len(self._buffer)  # only whitespace yet: the reply may still open with `{`
        self._emit_text(self._buffer[: len(self._buffer) - keep], events)
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _feed_region(self, events: list) -> bool:
        """Consume region text; False when more text is needed."""
        if self._object is not None:
            consumed, done = self._object.feed(self._buffer)
            self._region_raw += self._buffer[:consumed]
            if self._object.streaming and not self._object.opened:
                self._call_opened(ToolCall(self._object.name, ""), events)
                self._object.opened = True
            if self._object.streaming and self._object.arguments:
                self._arguments(self._object.arguments, events)
                self._object.arguments = ""
            self._buffer = self._buffer[consumed:]
            if not done:
                return False
            if not self._object.streaming:
                call = parse_call(self._object.text)
                if call is None:
                    return self._give_up(events)
                self._whole_call(call, events)
            else:
                self._call_closed(events)
            self._object, self._region_calls = None, self._region_calls + 1
            if self.repeated:
                self._buffer = ""
                return False
            return True
        stripped = self._buffer.lstrip(" \t\r\n,;[]" if self.fmt.list_of_calls or self.fmt.bare_json_start else " \t\r\n")
        self._region_raw += self._buffer[: len(self._buffer) - len(stripped)]
        self._buffer = stripped
        if not stripped:
            return False
        if self.fmt.end and stripped.startswith(self.fmt.end):
            self._buffer = stripped[len(self.fmt.end):]
            if self._region_calls == 0:  # an empty block: content as written
                self._emit_text(self._region_raw + self.fmt.end, events, force=True)
            self._in_region = False
            return True
        if self.fmt.end and partial_suffix(stripped, self.fmt.end) == len(stripped):
            return False
        if stripped.startswith("{"):
            self._object = _ObjectReader()
            return True
        return self._give_up(events)

    def _give_up(self, events: list) -> bool:
        """The region is not calls: its text (and, for a format with an end, up to that end) is content."""
        fmt = self.fmt
        raw, self._object = self._region_raw, None
        if fmt.end:
            end = self._buffer.find(fmt.end)
            if end < 0:
                self._region_raw = raw
                return False  # wait for the end (or finish) to give it all back
            raw += self._buffer[: end + len(fmt.end)]
            self._buffer = self._buffer[end + len(fmt.end):]
        else:
            raw += self._buffer
            self._buffer = ""
        if self._region_calls == 0:
            self._emit_text(raw, events, force=True)
        self._in_region = False
        return True

    def _call_opened(self, call: ToolCall, events: list) -> None:
        """A streaming call's name is known; its arguments follow (`_arguments`), then `_call_closed`."""
        call.index = self.num_calls
        self.num_calls += 1
        self._pending_space = ""  # models write newlines around calls; those are not content
        self._text_after_call = False
        self._current = [call.name, ""]
        if any(name == call.name for name, _ in self._done):
            self._held = [call]
        else:
            events.append(call)

    def _arguments(self, text: str, events: list) -> None:
        self._current[1] += text
        delta = ArgumentsDelta(self.num_calls - 1, text)
        if self._held is None:
            events.append(delta)
            return
        self._held.append(delta)
        name, so_far = self._current
        if not any(n == name and arguments.startswith(so_far) for n, arguments in self._done):
            events.extend(self._held)  # no longer an earlier call's beginning: out it goes
            self._held = None

    def _call_closed(self, events: list) -> None:
        call = tuple(self._current)
        if self._held is not None:
            self._held = None
            if call in self._done:
                self.num_calls -= 1
                self.repeated = True
                return
        self._done.append(call)

    def _whole_call(self, call: ToolCall, events: list) -> None:
        """A call parsed whole (its name did not come first, or it was cut short)."""
        if (call.name, call.arguments) in self._done:
            self.repeated = True
            return
        self._done.append((call.name, call.arguments))
        call.index = self.num_calls
        self.num_calls += 1
        self._pending_space, self._text_after_call = "", False
        events.append(call)

    def _emit_text(self, text: str, events: list, force: bool = False) -> None:
        text = self._pending_space + text
        if self.num_calls and not self._seen_text:  # a reply's text opens with no space, after calls too
            text = text.lstrip()
        body = text if force else text.rstrip()
        self._pending_space = text[len(body):]
        if body:
            self._seen_text = self._text_after_call = True
            events.append(body)


class _ObjectReader:
    """Reads one JSON object as it streams, tracking strings and nesting. Once `{"name": "...", "arguments": `
    is read (`streaming`), the arguments value's text is handed out as it comes (`arguments`)."""

    def __init__(self) -> None:
        self.text = ""  # the object so far (until it streams)
        self.name = ""
        self.streaming = False
        self.opened = False
        self.arguments = ""  # arguments text not yet handed out
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._args_depth = None  # depth at which the arguments value started

    def feed(self, text: str) -> tuple[int, bool]:
        """Consume from `text`; returns (characters consumed, whether the object closed)."""
        for i, char in enumerate(text):
            done = self._step(char)
            if self.streaming:
                if self._args_depth is not None:
                    closes = self._depth == self._args_depth and char in "}]" and not self._in_string
                    if self._depth > self._args_depth or closes:
                        self.arguments += char
                    if closes:  # the arguments value is whole: the rest is the object's tail
                        self._args_depth = None
            else:
                self.text += char
                if char in "{[" and self._depth == 2 and not self._in_string:
                    match = _HEADER.match(self.text)
                    if match and match.end() == len(self.text) - 1:
                        self.name = json.loads(f'"{match.group(1)}"')
                        self.streaming, self._args_depth, self.arguments = True, 1, char
            if done:
                return i + 1, True
        return len(text), False

    def _step(self, char: str) -> bool:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return False
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth == 0
        return False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
