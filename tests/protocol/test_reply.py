"""The one reply parser: engine outputs (or text) -> reasoning, text, calls and their arguments, and a finish reason,
for every template family's call format; streamed in any chunking it gives what the whole reply gives. No model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from tfserve.protocol.events import ArgumentsDelta, ReasoningDelta, TextDelta, ToolCall, merge
from tfserve.protocol.reasoning import CONTENT, REASONING, START, THINK, Reasoning
from tfserve.protocol.reply import ReplyParser
from tfserve.protocol.tool_formats import HERMES, LLAMA3_JSON, MISTRAL

WEATHER = {"city": "Paris", "days": [1, 2]}
REPLIES = {  # each family's way of writing one call after a sentence (Llama 3's JSON is the whole reply)
    "hermes": (HERMES, f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}\n'
                       "</tool_call>", "Let me look."),
    "mistral": (MISTRAL, f'Let me look.[TOOL_CALLS][{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}]',
                "Let me look."),
    "llama3_json": (LLAMA3_JSON, f'{{"name": "weather", "parameters": {json.dumps(WEATHER)}}}', None),
}


@dataclass
class Output:
    """An engine output as the parser reads it."""

    delta_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_tokens: list = field(default_factory=lambda: [1])


def outputs(text: str, size: int, finish_reason: str = "stop", stop_reason: int | str | None = 2) -> list[Output]:
    """`text` as engine outputs of `size` characters each, the last one finished."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    result = [Output(piece) for piece in pieces]
    result[-1].finished, result[-1].finish_reason, result[-1].stop_reason = True, finish_reason, stop_reason
    return result


def parse(parser: ReplyParser, text: str, size: int | None = None, **finish) -> list:
    """Every event of `text` fed `size` characters at a time (whole when None)."""
    return [event for output in outputs(text, size or max(len(text), 1), **finish) for event in parser.feed(output)]


def reasoning_of(events: list) -> str:
    return "".join(event for event in events if isinstance(event, ReasoningDelta))


@pytest.mark.parametrize("family", sorted(REPLIES))
def test_each_familys_call_opens_then_streams_its_arguments(family):
    fmt, text, content = REPLIES[family]
    events = parse(ReplyParser(fmt), text, size=4)
    kinds = [type(event) for event in events]
    first_call = kinds.index(ToolCall)
    assert all(kind is TextDelta for kind in kinds[:first_call])
    assert set(kinds[first_call + 1:]) == {ArgumentsDelta}  # the name first, then the arguments as written
    opened = events[first_call]
    assert (opened.name, opened.arguments, opened.index) == ("weather", "", 0)
    merged_content, (call,) = merge(events)
    assert merged_content == content
    assert json.loads(call.arguments) == WEATHER and call.id.startswith("call_")


@pytest.mark.parametrize("family", sorted(REPLIES))
@pytest.mark.parametrize("size", [1, 3, 7, 11])
def test_streamed_in_any_chunking_equals_the_whole_reply(family, size):
    fmt, text, _ = REPLIES[family]
    reasoning = Reasoning(THINK, START)
    text = "<think>\nWhich city?\n</think>\n\n" + text
    whole_parser, streamed_parser = ReplyParser(fmt, reasoning), ReplyParser(fmt, reasoning)
    whole, streamed = parse(whole_parser, text), parse(streamed_parser, text, size)
    assert reasoning_of(streamed) == reasoning_of(whole) == "Which city?"
    (content, calls), (whole_content, whole_calls) = merge(streamed), merge(whole)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert streamed_parser.finish_reason() == whole_parser.finish_reason() == "tool_calls"


def test_reasoning_comes_first_and_is_not_content():
    parser = ReplyParser(reasoning=Reasoning(THINK, REASONING))  # the prompt opened the block
    events = parse(parser, "I should greet.</think>\n\nHello!", size=5)
    assert isinstance(events[0], ReasoningDelta)
    assert reasoning_of(events) == "I should greet."
    assert merge(events) == ("Hello!", [])
    assert parser.reasoning_closed and parser.splits_reasoning and not parser.parses_calls


def test_reasoning_tokens_are_counted_from_the_outputs():
    parser = ReplyParser(reasoning=Reasoning(THINK, START))
    for piece in ["<think>", "a", "b", "</think>", "done"]:
        parser.feed(Output(piece))
    parser.feed(Output("", finished=True, finish_reason="stop", delta_tokens=[]))
    assert parser.num_reasoning_tokens == 4  # the opening marker, two tokens of thought, the closing marker


def test_an_empty_block_in_the_prompt_leaves_all_content():
    events = parse(ReplyParser(reasoning=Reasoning(THINK, CONTENT)), "<think>not reasoning</think>")
    assert reasoning_of(events) == "" and merge(events) == ("<think>not reasoning</think>", [])


def test_without_tools_markup_is_text():
    parser = ReplyParser()
    text = REPLIES["hermes"][1]
    events = parse(parser, text, size=6)
    assert all(type(event) is TextDelta for event in events) and "".join(events) == text
    assert parser.finish_reason() == "stop" and parser.num_calls == 0


def test_text_deltas_and_finish_work_without_engine_outputs():
    parser = ReplyParser(HERMES)
    events = parser.feed('<tool_call>{"name": "f", ') + parser.feed('"arguments": {}}</tool_call>')
    assert parser.finish_reason() is None  # still running
    events += parser.finish("stop")
    assert merge(events)[1][0].name == "f" and parser.finish_reason() == "tool_calls"
    assert parser.feed("more") == []  # finished: nothing more is read


@pytest.mark.parametrize("tail, finish_reason, stop_reason", [
    ("", "stop", 2),  # the model ended its turn (EOS or a stop token)
    ("\n<tool_", "stop", "STOP"),  # a stop string cut only what followed a whole call
    ("\n<tool_", "length", None),  # max_tokens cut only the next call's marker, held back
])
def test_whole_calls_end_tool_calls(tail, finish_reason, stop_reason):
    parser = ReplyParser(HERMES)
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' + tail
    events = parse(parser, text, size=5, finish_reason=finish_reason, stop_reason=stop_reason)
    assert merge(events)[0] is None  # a cut marker is not content
    assert parser.finish_reason() == "tool_calls"


@pytest.mark.parametrize("finish_reason, stop_reason", [("length", None), ("stop", "STOP")])
def test_a_call_cut_open_keeps_the_engines_reason(finish_reason, stop_reason):
    parser = ReplyParser(HERMES)
    events = parse(parser, 'Sure.<tool_call>{"name": "f", "arguments": {"a": 1', size=4,
                   finish_reason=finish_reason, stop_reason=stop_reason)
    content, (call,) = merge(events)
    assert content == "Sure." and call.arguments == '{"a": 1'
    assert parser.finish_reason() == finish_reason


def test_a_reply_without_calls_keeps_the_engines_reason():
    for reason in ("stop", "length"):
        parser = ReplyParser(HERMES)
        parse(parser, "Just text.", size=3, finish_reason=reason)
        assert parser.finish_reason() == reason


def test_a_repeated_call_ends_the_reply_with_tool_calls():
    parser = ReplyParser(HERMES)
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    events = []
    for piece in [call, "\n", call, "\n", call]:
        events += parser.feed(Output(piece))
    assert parser.repeated and len(merge(events)[1]) == 1
    assert parser.finish_reason() == "tool_calls"  # the engine request is aborted, never finished
