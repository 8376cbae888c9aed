"""The Hermes/Qwen tool-call parser, whole and streamed, without a model."""

from __future__ import annotations

import json

import pytest

from tfserve.protocol.events import ToolCall, merge

from tfserve.protocol.tool_calls import ToolCallStream, parse_tool_calls

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_plain_text_has_no_calls():
    assert parse_tool_calls("just text <tool") == ("just text <tool", [])


def test_one_call_and_surrounding_content():
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


def test_two_calls_only_calls_means_no_content():
    content, calls = parse_tool_calls(f"{CALL}\n{CALL.replace('Paris', 'Rome')}")
    assert content is None
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def test_string_arguments_and_parameters_alias():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == '{"x": 1}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>')
    assert json.loads(calls[0].arguments) == {"y": 2}


@pytest.mark.parametrize("bad", ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                 "<tool_call>[1, 2]</tool_call>"])
def test_a_block_that_is_not_a_call_stays_content(bad):
    assert parse_tool_calls(f"a {bad} b") == (f"a {bad} b", [])


def test_unclosed_block_at_the_end():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert content is None and calls[0].name == "f"
    assert parse_tool_calls("<tool_call>{half") == ("<tool_call>{half", [])


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_in_any_chunking_equals_whole_parse(size):
    text = f"Sure. {CALL}\nand <tool_ not a call {CALL.replace('Paris', 'Rome')}"
    stream = ToolCallStream()
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert content == "Sure.\nand <tool_ not a call"
    assert [(c.name, c.index) for c in calls] == [("get_weather", 0), ("get_weather", 1)]
    assert stream.num_calls == 2


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_text_after_calls_streams_as_the_whole_parse_gives_it(size):
    """The streamed content, concatenated, is the non-streamed content: a reply that opens with a call has no
    newline before the text that follows it; text before a call keeps its break from text after."""
    for text, expected in ((f"{CALL}\nThe weather is sunny.", "The weather is sunny."),
                           (f"Checking.\n{CALL}\nDone.", "Checking.\nDone.")):
        stream = ToolCallStream()
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
        assert "".join(e for e in events if isinstance(e, str)) == expected == parse_tool_calls(text)[0]


def test_streaming_holds_back_a_possible_start_tag():
    stream = ToolCallStream()
    assert stream.feed("hello <tool") == ["hello"]  # the space waits: a call would drop it
    assert stream.feed("box ") == [" <toolbox"]
    assert stream.finish() == [" "]  # trailing space is content when no call follows


def test_to_openai_shape():
    call = ToolCall("f", "{}", id="call_1")
    assert call.to_openai() == {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert call.to_openai(index=2)["index"] == 2


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_repeated_call_is_dropped_and_ends_the_reply(size):
    rome = CALL.replace("Paris", "Rome")
    prefix = CALL.replace("Paris", "Pari")  # begins like the first call, then differs: it streams once it differs
    text = f"{CALL}\n{prefix}\n{rome}\n{CALL}\n{rome}\nmore text"
    stream = ToolCallStream()
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    events += stream.finish()
    content, calls = merge(events)
    assert stream.repeated and content is None
    assert [(c.index, json.loads(c.arguments)["city"]) for c in calls] == [(0, "Paris"), (1, "Pari"), (2, "Rome")]
    # the repeat never began on the wire: no event belongs to a fourth call
    assert all(getattr(e, "index", 0) <= 2 for e in events)


def test_a_call_cut_by_max_tokens_leaves_no_markup_in_the_content():
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    for cut_at in ('<tool_call>\n{"name": "get_weather", "arguments":', "<tool_call>\n", "<", '<tool_call>{"na'):
        stream = ToolCallStream()
        events = stream.feed(first + cut_at) + stream.finish(cut=True)
        content, calls = merge(events)
        assert content is None and [c.name for c in calls] == ["get_weather"], cut_at
        stream = ToolCallStream()  # alone, a call's opening is dropped; a "<" may be text
        assert merge(stream.feed(cut_at) + stream.finish(cut=True)) == ("<" if cut_at == "<" else None, []), cut_at
    stream = ToolCallStream()  # more of the marker than a "<" is markup
    assert merge(stream.feed("<tool_") + stream.finish(cut=True)) == (None, [])
    # a reply that stopped on its own in a malformed block: its text is given back
    stream = ToolCallStream()
    assert merge(stream.feed("<tool_call>{half") + stream.finish()) == ("<tool_call>{half", [])


@pytest.mark.parametrize("cut_at,whole", [
    ("<tool_call>\n", True),  # the next call's marker, held back
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', True),  # a repeat, held back
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "C', False),  # a new call, streaming: cut open
    ("", True),  # right after the call's end
    ("Done, and th", False),  # text after the call, cut
])
def test_calls_are_whole_when_max_tokens_cut_only_what_was_held_back(cut_at, whole):
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    stream = ToolCallStream()
    events = stream.feed(first + cut_at) + stream.finish(cut=True)
    assert [c.name for c in merge(events)[1]] == (["get_weather", "get_time"] if "get_time" in cut_at
                                                  else ["get_weather"])
    assert stream.calls_whole is whole
