"""The sampling extras for prompts, through the openai SDK: `echo` with `logprobs` on /v1/completions (the
prompt's tokens first, as OpenAI's legacy API gave them), vLLM's `prompt_logprobs` on completions and chat, and
`continue_final_message` (an assistant prefill) on chat."""

from __future__ import annotations

import pytest

from tiny import MODEL_NAME

GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
PREFILL = {"temperature": 0, "max_tokens": 6}
PROMPT = "hello world, the quick brown fox"


def test_completion_echo_with_logprobs_puts_the_prompt_first(server, tokenizer):
    client = server.client()
    prompt_ids = tokenizer.encode(PROMPT)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=2, **GREEDY)
    choice, logprobs = reply.choices[0], reply.choices[0].logprobs
    assert choice.text == PROMPT + plain.choices[0].text
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == num_prompt + 6
    assert "".join(logprobs.tokens[:num_prompt]) == PROMPT  # byte-level tokens of ASCII text: their own strings
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing comes before it
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    # each prompt token is among its position's top ones (OpenAI's legacy rule: up to logprobs + 1 of them)
    assert all(1 <= len(top) <= 3 and token in top for token, top in zip(logprobs.tokens[1:],
                                                                            logprobs.top_logprobs[1:]))
    # the generated part is what a request without echo gets, its offsets counted in the whole text
    assert logprobs.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[num_prompt] == len(PROMPT)
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, stream=True,
                                              **GREEDY))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens
    assert streamed[0].choices[0].text == PROMPT and streamed[0].choices[0].logprobs.token_logprobs[0] is None


def test_echo_with_max_tokens_0_scores_the_prompt(server, tokenizer):
    """lm-eval-harness's loglikelihood request: the prompt's logprobs and nothing generated, whole or streamed."""
    client = server.client()
    num_prompt = len(tokenizer.encode(PROMPT))
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    generated = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, **GREEDY)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.tokens == generated.choices[0].logprobs.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        generated.choices[0].logprobs.token_logprobs[1:num_prompt], abs=1e-5)
    assert scored.usage.prompt_tokens == num_prompt and scored.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    # without echo there is nothing to return: an empty completion (OpenAI's minimum is 0)
    status, _, reply = server.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT,
                                                                  "max_tokens": 0})
    assert status == 200 and reply["choices"][0]["text"] == "" and reply["usage"]["completion_tokens"] == 0


def test_completion_prompt_logprobs_score_the_prompt_as_the_model_scores_its_output(server, tokenizer):
    """The distribution after a prompt is the same whether the model samples from it or scores the next prompt
    token with it."""
    client = server.client()
    prompt_ids = tokenizer.encode(PROMPT)
    sampled = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, logprobs=5, **{**GREEDY, "max_tokens": 1})
    next_id = prompt_ids[0]  # any token: what matters is the distribution it is scored with
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt_ids + [next_id], max_tokens=1,
                                      extra_body={"prompt_logprobs": 5})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) + 1 and entries[0] is None
    # (the legacy field writes a token that is part of a character as "bytes:\\x..", vLLM's as U+FFFD: compare
    # the logprobs, in rank order)
    top = [entry["logprob"] for entry in sorted(entries[-1].values(), key=lambda e: e["rank"])[:5]]
    expected = sampled.choices[0].logprobs.top_logprobs[0]
    assert top == pytest.approx(list(expected.values()), abs=1e-4)
    for token_id, entry in zip(prompt_ids[1:] + [next_id], entries[1:]):
        own = entry[str(token_id)]  # the prompt's own token first, then the top 5 (6 keys when it is not among them)
        assert list(entry)[0] == str(token_id) and len(entry) in (5, 6)
        assert own["logprob"] <= 0 and own["rank"] >= 1
        assert sorted(e["rank"] for e in entry.values())[:5] == [1, 2, 3, 4, 5]
        best = max(entry.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1


def test_chat_prompt_logprobs_on_the_response(server):
    client = server.client()
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, seed=3,
                                           extra_body={"prompt_logprobs": 0, "ignore_eos": True}, max_tokens=2)
    entries = reply.model_extra["prompt_logprobs"]  # vLLM's place: one prompt, however many choices
    assert len(entries) == reply.usage.prompt_tokens and entries[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in entries[1:])
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_chat_prompt_logprobs_are_not_streamed(server):
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 1})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"


def test_chat_continue_final_message_prefills_the_reply(server, tokenizer):
    client = server.client()
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "Once upon a"}]
    prefilled = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)["input_ids"]
    assert tokenizer.decode(prefilled).endswith("<|im_start|>assistant\nOnce upon a")  # left open
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, **PREFILL,
                                           extra_body={"continue_final_message": True, "ignore_eos": True})
    assert reply.usage.prompt_tokens == len(prefilled)
    same = client.completions.create(model=MODEL_NAME, prompt=prefilled, **GREEDY)
    assert reply.choices[0].message.content == same.choices[0].text  # only the continuation
    explicit = client.chat.completions.create(model=MODEL_NAME, messages=messages, **PREFILL, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    assert explicit.choices[0].message.content == reply.choices[0].message.content
    # without it, the assistant message is closed and a new one begins
    closed = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    assert closed.usage.prompt_tokens > len(prefilled)


def test_chat_without_generation_prompt(server, tokenizer):
    messages = [{"role": "user", "content": "hello world"}]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                                    extra_body={"add_generation_prompt": False})
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)["input_ids"]
    assert reply.usage.prompt_tokens == len(expected)


def test_offsets_count_the_texts_characters_where_tokens_split_them(server, tokenizer):
    """Byte-level tokens that hold part of a character (an emoji, CJK) show as OpenAI's legacy API writes them,
    `bytes:\\x..`, and start where their character does: the offsets index the text, streamed or whole."""
    client = server.client()
    prompt = "Hello \u2603 world \U0001f31e!"
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    logprobs = scored.choices[0].logprobs
    assert any(token.startswith("bytes:\\x") for token in logprobs.tokens)
    world = logprobs.tokens.index(next(t for t in logprobs.tokens if "world" in t))
    assert logprobs.text_offset[world] + logprobs.tokens[world].index("world") == prompt.index("world")
    assert logprobs.text_offset[-1] == len(prompt) - 1  # "!"
    # a random model's draws over a byte-level vocabulary: characters split across tokens, and bytes no character
    body = dict(model=MODEL_NAME, prompt="x", logprobs=1, max_tokens=24, temperature=1.5, seed=5)
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    streamed = {key: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)]
                for key in ("tokens", "text_offset", "token_logprobs")}
    assert streamed["tokens"] == whole.logprobs.tokens and streamed["text_offset"] == whole.logprobs.text_offset
    offsets = whole.logprobs.text_offset
    assert offsets == sorted(offsets) and all(offset <= len(whole.text) for offset in offsets)
