"""Reasoning models: the splitter without a model (whole, streamed at every split point, token counts), then a
live server over the tiny llama with reasoning chat templates, driven by the openai SDK. Most live tests script
the model's text (as the tool-call tests do) so the split is checked against known strings; one runs the
random-weight model itself."""

from __future__ import annotations

import json

import pytest
from test_openapi import check, event_schemas, stream

from tfserve.protocol.chat_template import render_chat
from tfserve.protocol.reasoning import (CONTENT, REASONING, START, THINK, ReasoningStream, detect_markers, output_phase,
                                      reasoning_for, split_reasoning, starts_in_reasoning)
from tiny import CHAT_TEMPLATE, MODEL_NAME, scripted_generate

# Qwen3's shape: the model opens <think> itself; enable_thinking false writes an empty block into the prompt
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's shape: the generation prompt opens the block; old reasoning is cut from the history
R1_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]
THOUGHT = ["<think>", "\nThe user", " greets", " me.\n", "</think>", "\n\n", "Hello", "!"]  # 5 reasoning tokens
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


# -- the splitter ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, phase, expected", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", START, ("The user greets me.", "Hello!")),
    ("  \n<think>a</think>b", START, ("a", "b")),
    ("The user greets me.\n</think>\n\nHello!", REASONING, ("The user greets me.", "Hello!")),
    ("<think>\nstill thinking ", START, ("still thinking", "")),  # cut by max_tokens: all reasoning
    ("still thinking </th", REASONING, ("still thinking </th", "")),  # a partial marker is text
    ("<think>\n\n</think>\n\nHi", START, (None, "Hi")),
    (" Hello <think>x</think>", START, (None, " Hello <think>x</think>")),  # only at the start; as written
    ("<think>x</think>Hi", CONTENT, (None, "<think>x</think>Hi")),  # the prompt closed the block
    ("<thin", START, (None, "<thin")),
    ("", START, (None, "")),
    ("", REASONING, (None, "")),
    ("a </think> b </think> c", REASONING, ("a", "b </think> c")),
])
def test_split_whole(text, phase, expected):
    assert split_reasoning(text, THINK, phase) == expected


def _fed(pieces: list[str], phase: str = START) -> tuple[str, str]:
    stream = ReasoningStream(THINK, phase)
    parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("text, phase", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", START),
    ("\n<think> a <b>\n\n c </think>\n\n<think>not reasoning</think>", START),
    ("The user greets me.\n</think>\n\nHello!", REASONING),
    ("<think>\nno end yet <", START),
    ("<thinking>is not the marker", START),
    ("Plain reply, no block.", START),
])
def test_streamed_at_every_split_point_equals_whole(text, phase):
    reasoning, content = split_reasoning(text, THINK, phase)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _fed([text[:i], text[i:j], text[j:]], phase) == (reasoning or "", content), (i, j)
    assert _fed(list(text), phase) == (reasoning or "", content)  # a character at a time


def test_markers_split_across_deltas_are_held_back():
    stream = ReasoningStream(THINK)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nhello </th") == ("hello", "")  # the space waits: the block may end here
    assert stream.feed("ink>\n") == ("", "")  # the newline after the block is not content
    assert stream.feed("\nHi </think>") == ("", "Hi </think>")
    assert stream.finish() == ("", "")
    assert stream.closed


def test_reasoning_whitespace_is_kept_inside_and_dropped_at_the_edges():
    stream = ReasoningStream(THINK, REASONING)
    assert stream.feed("\n  step one") == ("step one", "")
    assert stream.feed("\n\n") == ("", "")
    assert stream.feed("step two\n") == ("\n\nstep two", "")
    assert stream.finish() == ("", "")
    assert not stream.closed  # never closed: a reply cut while thinking


@pytest.mark.parametrize("pieces, phase, num_tokens", [
    (THOUGHT, START, 5),
    (["\n", "<think>", "x", "</think>", "y"], START, 4),  # whitespace before the block is part of it
    (["a", "b", "</think>", "\n\n", "Hi"], REASONING, 3),
    (["<think>", "a", "b"], START, 3),  # no end: every token is reasoning
    (["\n", "Hi", "!"], START, 0),
    (["<think>x</think>", "Hi"], CONTENT, 0),
])
def test_reasoning_tokens_are_counted_per_delta(pieces, phase, num_tokens):
    stream = ReasoningStream(THINK, phase)
    for piece in pieces:
        stream.feed(piece, 1)
    stream.finish()
    assert stream.num_reasoning_tokens == num_tokens


@pytest.mark.parametrize("prompt, phase", [
    ("<|im_start|>assistant\n<think>\n", REASONING),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CONTENT),
    ("<|im_start|>assistant\n", START),
    ("<think>old</think> and <think>", REASONING),
])
def test_where_the_output_begins_is_read_from_the_prompt_tail(prompt, phase):
    assert output_phase(prompt, THINK) == phase
    assert starts_in_reasoning(prompt, THINK) == (phase == REASONING)


class _Tokenizer:
    def __init__(self, template, added=None):
        self.chat_template, self.added = template, added or {}

    def get_added_vocab(self):
        return self.added


def test_markers_come_from_the_template_or_the_added_tokens():
    assert detect_markers(_Tokenizer(QWEN3_TEMPLATE)) == THINK
    assert detect_markers(_Tokenizer({"default": R1_TEMPLATE, "tool_use": CHAT_TEMPLATE})) == THINK
    assert detect_markers(_Tokenizer(CHAT_TEMPLATE)) is None
    assert detect_markers(_Tokenizer(CHAT_TEMPLATE, {"<think>": 5, "</think>": 6})) == THINK
    assert detect_markers(_Tokenizer(None)) is None


@pytest.mark.parametrize("template, template_kwargs, phase", [
    (QWEN3_TEMPLATE, {}, START), (QWEN3_TEMPLATE, {"enable_thinking": False}, CONTENT),
    (QWEN3_TEMPLATE, {"enable_thinking": True}, START), (R1_TEMPLATE, {}, REASONING),
], ids=["qwen3", "qwen3-thinking-off", "qwen3-thinking-on", "r1"])
def test_reasoning_for_a_rendered_prompt(tokenizer, monkeypatch, template, template_kwargs, phase):
    monkeypatch.setattr(tokenizer, "chat_template", template)
    prompt_ids = render_chat(tokenizer, MESSAGES, None, template_kwargs)
    reasoning = reasoning_for(tokenizer, prompt_ids)
    assert reasoning.markers == THINK and reasoning.phase == phase
    monkeypatch.setattr(tokenizer, "chat_template", CHAT_TEMPLATE)
    assert reasoning_for(tokenizer, prompt_ids) is None


# -- a live server -----------------------------------------------------------------------------------------

@pytest.fixture
def reasoning_server(start_server, tokenizer, monkeypatch):
    """`reasoning_server(pieces, template=QWEN3_TEMPLATE, **script)`: a server whose model has a reasoning
    template and "generates" `pieces`."""

    def start(pieces, template=QWEN3_TEMPLATE, state_kwargs=None, **script):
        monkeypatch.setattr(tokenizer, "chat_template", template)  # the session tokenizer, restored after
        live = start_server(state_kwargs=state_kwargs)
        live.state.generate = scripted_generate(pieces, **script)
        return live

    return start


def _streamed_chat(live, **kwargs) -> tuple[str, str, str, object, list]:
    chunks = list(live.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kwargs))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return reasoning, content, finish, chunks[-1].usage, chunks


def test_chat_splits_reasoning_whole_and_streamed(reasoning_server):
    live = reasoning_server(THOUGHT)
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    message = reply.choices[0].message
    assert message.reasoning_content == "The user greets me." and message.content == "Hello!"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 8 and reply.usage.completion_tokens_details.reasoning_tokens == 5
    reasoning, content, finish, usage, chunks = _streamed_chat(live)
    assert (reasoning, content, finish) == ("The user greets me.", "Hello!", "stop")
    assert usage.completion_tokens_details.reasoning_tokens == 5
    for chunk in stream(live, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES,
                                                       "stream_options": {"include_usage": True}}):
        check("CreateChatCompletionStreamResponse", chunk)
    check("CreateChatCompletionResponse", live.request("POST", "/v1/chat/completions",
                                                       {"model": MODEL_NAME, "messages": MESSAGES})[2])


def test_chat_prompt_opened_reasoning(reasoning_server):
    live = reasoning_server(["Paris is", " in France", ".", "</think>", "\n\n", "Paris."], template=R1_TEMPLATE)
    message = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES).choices[0].message
    assert message.reasoning_content == "Paris is in France." and message.content == "Paris."
    reasoning, content, _, usage, _ = _streamed_chat(live)
    assert (reasoning, content, usage.completion_tokens_details.reasoning_tokens) == ("Paris is in France.",
                                                                                      "Paris.", 4)


def test_chat_cut_while_thinking_is_all_reasoning(reasoning_server):
    live = reasoning_server(["<think>", "still", " thinking"], finish_reason="length")
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    choice = reply.choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        "still thinking", "", "length")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 3
    reasoning, content, finish, usage, _ = _streamed_chat(live)
    assert (reasoning, content, finish, usage.completion_tokens_details.reasoning_tokens) == (
        "still thinking", "", "length", 3)


def test_enable_thinking_false_gives_plain_content(reasoning_server):
    script = ["<think>", "x", "</think>", "Hi"]  # a model told not to think that writes a block anyway
    live = reasoning_server(script, state_kwargs={"chat_template_kwargs": {"enable_thinking": False}})
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    message = reply.choices[0].message
    assert message.content == "<think>x</think>Hi" and message.reasoning_content is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    # the request's own chat_template_kwargs win over the server's default, both ways
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    message = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                    extra_body=on).choices[0].message
    assert (message.reasoning_content, message.content) == ("x", "Hi")
    live = reasoning_server(script)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _streamed_chat(live, extra_body=off)[:2] == ("", "<think>x</think>Hi")


def test_models_without_markers_get_no_reasoning_fields(reasoning_server):
    live = reasoning_server(THOUGHT, template=CHAT_TEMPLATE)
    status, _, reply = live.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES})
    assert status == 200 and reply["choices"][0]["message"]["content"] == "".join(THOUGHT)
    assert "reasoning_content" not in reply["choices"][0]["message"]
    assert "completion_tokens_details" not in reply["usage"]


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_tool_calls_after_the_reasoning(reasoning_server):
    live = reasoning_server(["<think>", "I need <tool_call>", " weather", "</think>", "\n", "<tool_call>", CALL,
                             "</tool_call>"])
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "I need <tool_call> weather"  # a tag inside is only reasoning
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                         stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert reasoning == "I need <tool_call> weather" and calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}
    assert not any(c.choices[0].delta.content for c in chunks)


def test_responses_reasoning_item_whole(reasoning_server):
    live = reasoning_server(THOUGHT)
    response = live.client().responses.create(model=MODEL_NAME, input="hello world")
    thought, message = response.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", "The user greets me.")]
    assert message.type == "message" and response.output_text == "Hello!"
    assert response.usage.output_tokens_details.reasoning_tokens == 5 and response.usage.output_tokens == 8
    check("Response", live.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "hello world"})[2])


def test_responses_reasoning_events(reasoning_server):
    live = reasoning_server(THOUGHT)
    events = stream(live, "/v1/responses", {"model": MODEL_NAME, "input": "hello world"})
    for event in events:
        check(event_schemas()[event["type"]], event)
    kinds = [e["type"] for e in events]
    # the reasoning item is whole (done) before the message item is added
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    done = kinds.index("response.reasoning_text.done")
    assert "".join(deltas) == events[done]["text"] == "The user greets me."
    assert kinds[done + 1] == "response.output_item.done" and events[done + 1]["item"]["status"] == "completed"
    assert events[done + 2]["type"] == "response.output_item.added" and events[done + 2]["output_index"] == 1
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed" and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "Hello!"


def test_responses_cut_while_thinking(reasoning_server):
    live = reasoning_server(["still", " thinking"], template=R1_TEMPLATE, finish_reason="length")
    body = {"model": MODEL_NAME, "input": "hello world", "max_output_tokens": 2}
    whole = live.request("POST", "/v1/responses", body)[2]
    check("Response", whole)
    assert whole["status"] == "incomplete" and [item["type"] for item in whole["output"]] == ["reasoning"]
    assert whole["output"][0]["content"][0]["text"] == "still thinking"
    assert whole["output"][0]["status"] == "incomplete"
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    events = stream(live, "/v1/responses", body)
    for event in events:
        check(event_schemas()[event["type"]], event)
    assert events[-1]["type"] == "response.incomplete"
    streamed = events[-1]["response"]["output"]
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in streamed] == [
        ("reasoning", "incomplete", "still thinking")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "still thinking"


def test_the_random_model_thinks_until_max_tokens(start_server, tokenizer, monkeypatch):
    """The real engine under a prompt-opened block: every token is reasoning, the text is the raw completion."""
    monkeypatch.setattr(tokenizer, "chat_template", R1_TEMPLATE)
    live = start_server()
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    reply = live.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **greedy})[2]
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    raw = live.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, **greedy})[2]
    text = raw["choices"][0]["text"]
    reasoning, content = split_reasoning(text, THINK, REASONING)
    choice = reply["choices"][0]
    assert choice["message"]["reasoning_content"] == reasoning and choice["message"]["content"] == content
    assert choice["finish_reason"] == "length" and raw["usage"]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    if "</think>" not in text:
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
