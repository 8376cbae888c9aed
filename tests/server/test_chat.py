"""/v1/chat/completions through the openai SDK: whole and streamed, usage, n, stop, seeds, logprobs, tools."""

from __future__ import annotations

import json

import pytest

from tiny import MODEL_NAME, scripted_generate, sse_events

MESSAGES = [{"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def prompt_len(tokenizer, messages, tools=None) -> int:
    return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
               ["input_ids"])


def test_chat_completion_and_true_usage(server, tokenizer):
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert reply.object == "chat.completion" and reply.model == MODEL_NAME
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, MESSAGES)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(server):
    """prompt_tokens_details.cached_tokens, as OpenAI reports it (LangChain and litellm read it for costs)."""
    messages = [{"role": "user", "content": "cached prefix " * 40 + "end"}]
    first = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    again = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    scored = server.client().completions.create(model=MODEL_NAME, prompt="cached prefix " * 40, max_tokens=1,
                                                 n=3, seed=0, temperature=1)
    assert 0 <= scored.usage.prompt_tokens_details.cached_tokens <= scored.usage.prompt_tokens


def test_stream_chunks_are_shaped_as_openai_sends_them(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    status, headers, raw = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])
    middle = chunks[1:-2]
    assert all(set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None
               for c in middle)
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    whole = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert streamed == whole.choices[0].message.content


def test_stream_through_the_sdk_without_usage(server):
    stream = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_n2_whole_and_streamed(server, tokenizer):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, MESSAGES)  # the prompt counts once
    assert reply.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8, seed=3,
                                            stream=True, extra_body={"ignore_eos": True})
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in reply.choices}  # same seeds, same samples


def test_seed_makes_sampling_repeatable(server):
    client = server.client()
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0, "top_p": 0.95,
              "extra_body": {"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}}
    first = client.chat.completions.create(seed=42, **kwargs).choices[0].message.content
    assert client.chat.completions.create(seed=42, **kwargs).choices[0].message.content == first
    others = {client.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (1, 2, 3)}
    assert others != {first}


def test_top_p_0_keeps_only_the_most_likely_token(server):
    """OpenAI takes top_p 0: the nucleus is the top token alone, whatever the temperature (greedy)."""
    client = server.client()
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY).choices[0].message
    for seed in (1, 2):
        nucleus = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **{**GREEDY, "temperature": 1.5},
                                                 top_p=0, seed=seed).choices[0].message
        assert nucleus.content == greedy.content


def test_stop_string_cuts_the_text(server):
    client = server.client()
    text = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **{**GREEDY, "max_tokens": 30}) \
        .choices[0].message.content
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    expected = text[: text.index(stop)]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stop=[stop, "never-seen"],
                                           **{**GREEDY, "max_tokens": 30})
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stop=stop, stream=True,
                                              **{**GREEDY, "max_tokens": 30})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_logprobs_in_openai_format(server):
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, logprobs=True,
                                                    top_logprobs=3, **GREEDY)
    choice = reply.choices[0]
    items = choice.logprobs.content
    assert len(items) == 12
    for item in items:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token
    assert b"".join(bytes(i.bytes) for i in items).decode("utf-8", errors="replace") == choice.message.content
    stream = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, logprobs=True,
                                                     stream=True, **GREEDY)
    streamed = [i for c in stream if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in items]
    assert all(i.top_logprobs == [] for i in streamed)  # top_logprobs unset: 0 alternatives


def test_content_parts_roles_and_max_completion_tokens(server, tokenizer):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=50,
                                                    max_completion_tokens=3, extra_body={"ignore_eos": True})
    rendered = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, rendered)
    assert reply.usage.completion_tokens == 3


def test_stop_token_ids_end_a_reply_without_showing_the_token(server, tokenizer):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True}
    status, _, first = server.request("POST", "/v1/chat/completions", body)
    # make the model's greedy first token a stop token: the reply stops at once, with nothing shown
    raw = bytes(first["choices"][0]["logprobs"]["content"][0]["bytes"])
    token_id = next(i for i in range(len(tokenizer)) if server.state.token_texts(i)[1] == raw)
    status, _, stopped = server.request("POST", "/v1/chat/completions", {**body, "stop_token_ids": [token_id]})
    choice = stopped["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert choice["logprobs"]["content"] == [] and stopped["usage"]["completion_tokens"] == 1
    assert choice["stop_reason"] == token_id  # vLLM's: which stop fired
    # include_stop_str_in_output shows it, text and logprob, as vLLM does for a stop token
    status, _, shown = server.request("POST", "/v1/chat/completions",
                                      {**body, "stop_token_ids": [token_id], "include_stop_str_in_output": True})
    choice = shown["choices"][0]
    assert choice["message"]["content"].encode() == raw and len(choice["logprobs"]["content"]) == 1
    assert "stop_reason" not in first["choices"][0]  # a length cut: shaped as OpenAI's


def test_a_stop_string_cannot_end_within_min_tokens(server):
    """vLLM's min_tokens holds stop strings off as it holds EOS off: a match that ends in the text of the first
    min_tokens tokens does not count; the first that ends after does."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 30, "ignore_eos": True,
            "logprobs": True}
    whole = server.request("POST", "/v1/chat/completions", body)[2]["choices"][0]
    text = whole["message"]["content"]
    tokens = [bytes(item["bytes"]).decode("utf-8", errors="replace") for item in whole["logprobs"]["content"]]
    first = tokens[0].strip()[:1]
    assert first and text.count(first) >= 2, text  # a character that comes again later
    early = server.request("POST", "/v1/chat/completions", {**body, "stop": first})[2]["choices"][0]
    assert early["message"]["content"] == text[:text.index(first)] and early["stop_reason"] == first
    zone = len("".join(tokens[:3]))
    later = next((i for i in range(zone - len(first) + 1, len(text)) if text.startswith(first, i)), None)
    held = server.request("POST", "/v1/chat/completions", {**body, "stop": first, "min_tokens": 3})[2]["choices"][0]
    if later is None:
        assert held["message"]["content"] == text and held["finish_reason"] == "length"
    else:
        assert held["message"]["content"] == text[:later] and held["finish_reason"] == "stop"


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for path, extra in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "hello"})):
        request = {**body, **extra} if not extra else {k: v for k, v in {**body, **extra}.items() if k != "messages"}
        chunks = sse_events(server.request("POST", path, request)[2])[:-1]
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert all(c["choices"] == [] or c["usage"] is not None for c in chunks), path
        assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["usage"]["completion_tokens"] == 6
        assert len(set(c["usage"]["prompt_tokens"] for c in chunks)) == 1
    bad = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}
    status, _, error = server.request("POST", "/v1/chat/completions", bad)
    assert status == 400 and error["error"]["param"] == "stream_options.continuous_usage_stats"


def test_echo_puts_the_continued_assistant_message_before_the_reply(server):
    """vLLM's chat `echo`: with the last message the assistant's (continued), the reply's content starts with
    it, whole and streamed; without it, nothing is echoed."""
    messages = MESSAGES + [{"role": "assistant", "content": "Sure, "}]
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 5, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    plain = server.request("POST", "/v1/chat/completions", body)[2]["choices"][0]["message"]["content"]
    echoed = server.request("POST", "/v1/chat/completions", {**body, "echo": True})[2]
    assert echoed["choices"][0]["message"]["content"] == "Sure, " + plain
    chunks = sse_events(server.request("POST", "/v1/chat/completions", {**body, "echo": True, "stream": True})[2])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"]) == "Sure, " + plain
    status, _, user_last = server.request("POST", "/v1/chat/completions", {**body, "messages": MESSAGES, "echo": True,
                                                                          "continue_final_message": False,
                                                                          "add_generation_prompt": True})
    assert status == 200 and not user_last["choices"][0]["message"]["content"].startswith("hello world")
    status, _, error = server.request("POST", "/v1/chat/completions", {**body, "echo": "x"})
    assert status == 400 and error["error"]["param"] == "echo"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SCRIPT = ["Let me", " check.\n", "<tool", "_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
          "</tool_call>"]


@pytest.fixture
def scripted_server(start_server):
    live = start_server()
    live.state.generate = scripted_generate(SCRIPT)
    return live


def test_tool_calls_parsed_whole(scripted_server, tokenizer):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    reply = scripted_server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, messages, TOOLS)  # tools went into the template
    assert reply.usage.completion_tokens == len(SCRIPT)


def test_tool_calls_streamed_as_deltas(scripted_server):
    stream = scripted_server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    # as OpenAI streams them: the first delta opens the call (id, name, no arguments), the rest add arguments
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}


CALL = ['<tool_call>\n', '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_call>\n"]


@pytest.mark.parametrize("script,content,names,finish", [
    (["<tool", "_call>\n", '{"name": "get_'], "", [], "length"),  # a call cut open: no markup in the content
    (["<tool_"], "", [], "length"),
    (CALL + ["<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"ci'], None, ["get_weather"], "tool_calls"),
    (CALL + ["Then I", " will"], "Then I will", ["get_weather"], "length"),  # text after the call was cut
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_by_max_tokens_shows_no_markup_and_whole_calls_end_as_tool_calls(
        start_server, script, content, names, finish, stream):
    """max_tokens cutting a call open leaves its markup out of the content; cutting only a repeat the server held
    back (every call shown is whole) ends the reply as "tool_calls", as it would have without the limit."""
    live = start_server()
    live.state.generate = scripted_generate(script, finish_reason="length")
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=3)
    if not stream:
        choice = live.client().chat.completions.create(**kwargs).choices[0]
        message = choice.message
        got = (message.content, [c.function.name for c in message.tool_calls or []], choice.finish_reason)
    else:
        chunks = [c for c in live.client().chat.completions.create(**kwargs, stream=True) if c.choices]
        assert chunks[0].choices[0].delta.content is None  # content null where the reply may be calls
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function.name]
        got = (text.strip() if text or not names else None, calls, chunks[-1].choices[0].finish_reason)
    assert got == (content, names, finish)


@pytest.mark.parametrize("script,content,names,finish", [
    (["<tool_call>"], "", [], "stop"),  # stop "\n" right after the marker: no markup in the content
    (CALL[:2] + ['"arguments": {"city": "Paris"'], None, ["get_weather"], "stop"),  # cut open: not "tool_calls"
    (CALL + ["<tool_call>"], None, ["get_weather"], "tool_calls"),  # every call shown is whole
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_a_stop_string_cuts_is_read_as_one_max_tokens_cuts(start_server, script, content, names, finish,
                                                                   stream):
    live = start_server()
    live.state.generate = scripted_generate(script, stop_token_id="}")  # the stop string that matched
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, stop=["}"])
    if not stream:
        choice = live.client().chat.completions.create(**kwargs).choices[0]
        got = (choice.message.content, [c.function.name for c in choice.message.tool_calls or []],
               choice.finish_reason)
    else:
        chunks = [c for c in live.client().chat.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function.name]
        got = (text if text or not names else None, calls, chunks[-1].choices[0].finish_reason)
    assert got == (content, names, finish)


def test_stop_strings_do_not_cut_forced_calls(server):
    """A reply `tool_choice` forces is calls only: stop strings are not applied to it (as on OpenAI)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    for stop in (["}"], ["\n"], ['"']):
        reply = server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "weather in Paris?"}], tools=tools,
            tool_choice="required", stop=stop, max_tokens=60, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (stop, choice)
        assert "city" in json.loads(choice.message.tool_calls[0].function.arguments)


def test_without_tools_the_text_is_left_alone(scripted_server):
    reply = scripted_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert reply.choices[0].message.content == "".join(SCRIPT) and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None


def test_assistant_tool_calls_and_tool_results_render(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=2)
    assert reply.usage.completion_tokens <= 2


@pytest.mark.parametrize("arguments", ['{"city": "Pa', '["Paris"]', "Paris"])
def test_past_calls_whose_arguments_are_not_an_object_go_back_as_written(server, tokenizer, arguments):
    """A call max_tokens cut short (or a model's malformed JSON) is sent back as the reply gave it: OpenAI takes
    any string, and the template shows the model what it wrote."""
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "user", "content": "try again"},
    ]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=2)
    rendered = [*messages[:1], {**messages[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        messages[2]]
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, rendered, TOOLS)
    status, _, error = server.request("POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "max_tokens": 2, "messages": [messages[0], {**messages[1], "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": 7}}]}]})
    assert status == 400 and error["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_an_assistant_refusal_in_the_history_is_what_it_said(server, tokenizer):
    messages = [{"role": "user", "content": "help me"},
                {"role": "assistant", "content": None, "refusal": "I can't help with that."},
                {"role": "user", "content": "ok"}]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    rendered = [messages[0], {"role": "assistant", "content": "I can't help with that."}, messages[2]]
    assert reply.usage.prompt_tokens == prompt_len(tokenizer, rendered)


def test_errors_name_the_fields_and_values_as_the_client_wrote_them(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_completion_tokens": 5, "min_tokens": 10}
    status, _, error = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and error["error"]["param"] == "min_tokens"
    assert "max_completion_tokens" in error["error"]["message"] and "max_tokens]" not in error["error"]["message"]
    status, _, error = server.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES,
                                                                      "logit_bias": {"5": None}})
    assert status == 400 and "null" in error["error"]["message"] and "None" not in error["error"]["message"]
