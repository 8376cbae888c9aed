"""/tokenize and /detokenize in vLLM's shapes on the tiny live server: a prompt or chat messages -> the ids a
generation request would use, ids -> text; the API key guards them; mistakes are 400s naming the field."""

from __future__ import annotations

from tiny import MODEL_NAME

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]


def test_prompt_counts_the_tokens_a_completion_reads(server, tokenizer):
    status, _, body = server.request("POST", "/tokenize", {"model": MODEL_NAME, "prompt": "hello world"})
    assert status == 200
    assert body["tokens"] == tokenizer.encode("hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.state.engine.max_model_len
    usage = server.client().completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]


def test_messages_count_the_tokens_a_chat_completion_reads(server):
    status, _, body = server.request("POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200
    usage = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    _, _, without = server.request("POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without["count"] < body["count"]
    assert without["tokens"] == body["tokens"][:without["count"]]


def test_token_strs_and_detokenize_round_trip(server, tokenizer):
    _, _, body = server.request("POST", "/tokenize", {"prompt": "the quick brown fox", "return_token_strs": True,
                                                       "add_special_tokens": False})
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    status, _, text = server.request("POST", "/detokenize", {"model": MODEL_NAME, "tokens": body["tokens"]})
    assert status == 200
    assert text == {"prompt": "the quick brown fox"}


def test_mistakes_are_400s_naming_the_field(server):
    vocab_size = server.state.engine.vocab_size
    cases = [({}, "prompt"), ({"prompt": "a", "messages": MESSAGES}, "prompt"), ({"prompt": 5}, "prompt"),
             ({"messages": []}, "messages"),
             ({"messages": MESSAGES, "add_special_tokens": "yes"}, "add_special_tokens")]
    for body, param in cases:
        status, _, error = server.request("POST", "/tokenize", body)
        assert (status, error["error"]["param"]) == (400, param), body
    for tokens, param in (([vocab_size], "tokens[0]"), ([1, True], "tokens[1]"), ("1 2", "tokens")):
        status, _, error = server.request("POST", "/detokenize", {"tokens": tokens})
        assert (status, error["error"]["param"]) == (400, param), tokens


def test_a_text_past_any_context_is_refused_before_tokenizing(server):
    status, _, error = server.request("POST", "/tokenize", {"prompt": "word " * 400_000})
    assert status == 400
    assert error["error"]["code"] == "context_length_exceeded"


def test_the_api_key_guards_them(start_server):
    live = start_server(api_key="sekret")
    assert live.request("POST", "/tokenize", {"prompt": "hi"})[0] == 401
    assert live.request("POST", "/detokenize", {"tokens": [1]})[0] == 401
    ok = live.request("POST", "/tokenize", {"prompt": "hi"}, headers={"Authorization": "Bearer sekret"})
    assert ok[0] == 200
