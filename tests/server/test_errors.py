"""Every error is an OpenAI error body with the right status: the bad-input matrix, limits, lifecycle, and
a failure of one request that leaves the others alone."""

from __future__ import annotations

import json
import logging
import socket
import threading

import openai
import pytest

from tiny import MODEL_NAME, scripted_generate

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": MODEL_NAME, "messages": OK_MESSAGES, "max_tokens": 2, **fields}


BAD_REQUESTS = [
    # (path, body, param the error names)
    (CHAT, b"{not json", None),
    (CHAT, b"", None),
    (CHAT, [1, 2], None),
    (CHAT, {"model": MODEL_NAME}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(top_p=-0.1), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(top_k=-5), "top_k"),
    (CHAT, chat(min_p=2), "min_p"),
    (CHAT, chat(presence_penalty=3), "presence_penalty"),
    (CHAT, chat(frequency_penalty=-3), "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=1.5), "n"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens="5"), "max_tokens"),
    (CHAT, chat(max_completion_tokens=-1), "max_completion_tokens"),
    (CHAT, chat(seed="x"), "seed"),
    (CHAT, chat(seed=2**70), "seed"),
    (CHAT, chat(n=1000), "n"),
    (CHAT, chat(stop=5), "stop"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logit_bias={"one": 5}), "logit_bias.one"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools[0]"),
    (CHAT, chat(tool_choice="sometimes"), "tool_choice"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (CHAT, chat(ignore_eos="yes"), "ignore_eos"),
    ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=-1), "prompt_logprobs"),
    (CHAT, chat(continue_final_message=True, add_generation_prompt=True), "continue_final_message"),
    (CHAT, chat(continue_final_message="yes"), "continue_final_message"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/responses", {"model": MODEL_NAME}, "input"),
    ("/v1/responses", {"input": [{"role": "user"}]}, "input[0].content"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    # checked before anything runs, streamed or not (a bad `store` once came after the stream had started)
    ("/v1/responses", {"input": "hi", "store": "yes", "stream": True}, "store"),
    ("/v1/responses", {"input": "hi", "stream": "yes"}, "stream"),
    ("/v1/responses", {"input": "hi", "parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ("/v1/responses", {"input": "hi", "metadata": {"a": 5}}, "metadata.a"),
    ("/v1/responses", {"input": "hi", "truncation": "sometimes"}, "truncation"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/responses", {"input": "hi", "prompt": {"id": "pmpt_1", "variables": {"a": "b"}}}, "prompt"),
    (CHAT, chat(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "modalities"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("/v1/responses", {"input": "hi", "include": "x"}, "include"),
    ("/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs", "x"]}, "include[1]"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low", "depth": 3}}, "reasoning.depth"),
    (CHAT, chat(reasoning_effort="extreme"), "reasoning_effort"),
    (CHAT, chat(service_tier="gold"), "service_tier"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "x"}}]},
     "tools[0].parameters.type"),
    (CHAT, chat(response_format={"a": 1}), "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"foo": 1}}, "structured_outputs.foo"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
    ("/v1/responses", {"input": "hi", "text": {"a": 1}}, "text.a"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"a": 1}}}, "text.format.type"),
    ("/v1/responses", {"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity"),
    (CHAT, chat(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": ["hi"]}]), "messages[0].content[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}, "hi"]}]), "messages[0].content[1]"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f" * 65}}]), "tools[0].function.name"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools[1].function.name"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "a.b"}]}, "tools[0].name"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 2}, "tools[1].name"),
    (CHAT, chat(user=5), "user"),
    (CHAT, chat(store="x"), "store"),
    (CHAT, chat(metadata="x"), "metadata"),
    (CHAT, chat(modalities="x"), "modalities"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    status, headers, data = server.request("POST", path, body)
    assert status == 400, data
    assert headers["Content-Type"].startswith("application/json")
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_a_content_part_without_a_type_says_so(server):
    status, _, data = server.request("POST", CHAT, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]))
    assert status == 400 and data["error"]["param"] == "messages[0].content[0].type"
    assert data["error"]["message"] == "messages[0].content[0].type is required"


@pytest.mark.parametrize("path", [CHAT, "/v1/responses"])
@pytest.mark.parametrize("tool_choice, says", [
    (-1, "must be a string or an object, not an integer"), ("1", "must be none, auto, required, a function"),
    (True, "must be a string or an object, not a boolean"), ([1], "must be a string or an object, not an array"),
    ({"a": 1}, "must be none, auto, required, a function"), ({"type": "function"}, "tool_choice.name is required")])
def test_a_malformed_tool_choice_is_the_same_400_with_or_without_tools(server, path, tool_choice, says):
    """Its type and shape come first; "the request has no tools" is only for a well-formed choice."""
    if path == CHAT:
        body, tools = chat(), [{"type": "function", "function": {"name": "f"}}]
    else:
        body, tools = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}, [{"type": "function", "name": "f"}]
    errors = []
    for extra in ({}, {"tools": tools}):
        status, _, data = server.request("POST", path, {**body, **extra, "tool_choice": tool_choice})
        assert status == 400, data
        errors.append(data["error"])
    assert errors[0] == errors[1] and says in errors[0]["message"], errors
    assert errors[0]["param"].startswith("tool_choice")


def test_context_overflow_says_both_numbers(server, engine):
    status, _, data = server.request("POST", CHAT, chat(max_tokens=1000))
    assert status == 400 and data["error"]["param"] == "max_tokens"
    assert data["error"]["code"] == "context_length_exceeded"
    assert "1000" in data["error"]["message"] and str(engine.max_model_len) in data["error"]["message"]
    status, _, data = server.request("POST", CHAT, chat(max_completion_tokens=1000))
    assert data["error"]["param"] == "max_completion_tokens" and "max_completion_tokens" in data["error"]["message"]


def test_context_overflow_is_worded_as_openai_words_it(server):
    """litellm (ContextWindowExceededError) and LangChain (OpenAIContextOverflowError) tell an overflow apart
    by OpenAI's words in the message: the SDK's exception text is the message alone."""
    for body in (chat(max_tokens=1000), chat(messages=[{"role": "user", "content": "hello " * 5000}])):
        status, _, data = server.request("POST", CHAT, body)
        assert status == 400 and data["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is" in data["error"]["message"]


def test_odd_but_valid_values_are_served(server):
    longest = {"type": "function", "function": {"name": "A-b_9" * 12 + "abcd"}}  # 64 of OpenAI's characters
    for extra in [{"top_k": 10**9}, {"seed": -1}, {"temperature": 2}, {"stop_token_ids": [10**9]}, {"top_p": 0},
                  {"tools": [longest]}]:
        status, _, data = server.request("POST", CHAT, chat(**extra))
        assert status == 200, (extra, data)
    refused = [{"role": "user", "content": "hi"},  # an assistant's refusal part, sent back as OpenAI defines it
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
               {"role": "user", "content": "why?"}]
    status, _, data = server.request("POST", CHAT, chat(messages=refused))
    assert status == 200, data


def test_sdk_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL_NAME, messages=OK_MESSAGES, temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_unknown_model_is_404_model_not_found(server):
    status, _, data = server.request("POST", CHAT, chat(model="gpt-4"))
    assert status == 404 and data["error"]["code"] == "model_not_found" and data["error"]["param"] == "model"


def test_unknown_route_and_wrong_method_are_json(server):
    status, _, data = server.request("GET", "/v1/nothing")
    assert status == 404 and "error" in data
    status, headers, data = server.request("GET", CHAT)
    assert status == 405 and "error" in data and "POST" in headers["Allow"]


@pytest.mark.parametrize("raw", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /v1/models HTTP/9.9\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
def test_requests_aiohttp_cannot_parse_are_json_400s(server, raw, caplog):
    """What never reaches the app (aiohttp answers it) is an OpenAI error body too, on one line; the log has one
    warning line for it, not a traceback."""
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0], head
    assert b"application/json" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_http_request"
    assert error["message"] and "\n" not in error["message"]
    assert server.request("GET", "/v1/models")[0] == 200  # and the server goes on
    logged = [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.INFO]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in logged)  # (aiohttp: debug for garbage)
    assert logged or raw.startswith(b"GARBAGE")


def test_body_over_the_limit_is_413(start_server):
    live = start_server(max_body_size=1000)
    status, _, data = live.request("POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 2000}]))
    assert status == 413 and data["error"]["code"] == "request_too_large"
    assert live.request("POST", CHAT, chat())[0] == 200


def test_what_cannot_fit_is_told_before_the_prompts_are_tokenized(start_server, monkeypatch):
    """Megabytes of text past any context, or more prompts than the queue takes: a 400 before tokenizing them
    (seconds of a core each, beside the others' requests)."""
    from tfserve.server.api import completions

    live = start_server(state_kwargs={"max_queued": 2})
    monkeypatch.setattr(completions, "parse_prompts", lambda *args: pytest.fail("tokenized"))
    huge = "hello world " * 200_000
    status, _, data = live.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": huge, "max_tokens": 2})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert data["error"]["param"] == "prompt" and "characters" in data["error"]["message"]
    status, _, data = live.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": ["a"] * 5000})
    assert status == 400 and data["error"]["param"] == "prompt" and "5000 sequences" in data["error"]["message"]
    status, _, data = live.request("POST", CHAT, chat(messages=[{"role": "user", "content": huge}]))
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert data["error"]["param"] == "messages" and "characters" in data["error"]["message"]
    status, _, data = live.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": huge})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert data["error"]["param"] == "input" and "characters" in data["error"]["message"]


def test_queue_beyond_max_queued_is_429_and_a_request_that_never_fits_is_a_400(start_server):
    live = start_server(state_kwargs={"max_queued": 2})
    status, _, data = live.request("POST", CHAT, chat(n=3))  # alone past the queue: retrying cannot help
    assert status == 400 and data["error"]["param"] == "n" and "--max-queued 2" in data["error"]["message"]
    status, _, data = live.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b", "c"],
                                                               "max_tokens": 2})
    assert status == 400 and data["error"]["param"] == "prompt"
    live.state.num_waiting = 1  # one sequence waiting already: two more must wait their turn
    status, _, data = live.request("POST", CHAT, chat(n=2))
    assert status == 429 and data["error"]["type"] == "rate_limit_error"
    live.state.num_waiting = 0
    assert live.request("POST", CHAT, chat(n=2))[0] == 200


def test_requests_admitted_together_count_against_max_queued_before_they_reach_the_engine(start_server):
    """Handlers admit a request, then await (a stream's headers, an MCP listing) before its sequences reach the
    engine: requests arriving together all passed a limit of 8 (43 of 60 did). Admitted sequences now count
    at once; one whose handler ends before submitting it counts no longer."""
    import gc

    from tfserve import SamplingParams
    from tfserve.server.errors import ApiError
    from tfserve.server.generation import admit

    live = start_server(state_kwargs={"max_queued": 3})
    state, prompt = live.state, [5, 6, 7]
    first = admit(state, {}, [prompt], SamplingParams(n=2, max_tokens=2))[1]
    with pytest.raises(ApiError) as info:
        admit(state, {}, [prompt], SamplingParams(n=2, max_tokens=2))
    assert info.value.status == 429 and "2 sequences waiting for their first token" in info.value.message
    second = admit(state, {}, [prompt], SamplingParams(max_tokens=2))[1]
    del first, second
    gc.collect()
    assert len(admit(state, {}, [prompt], SamplingParams(n=3, max_tokens=2))[1]) == 3


@pytest.mark.parametrize("path,body,last", [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, b'"finish_reason":"'),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16}, b"response.output_text.done"),
])
def test_a_client_that_leaves_after_the_last_token_leaves_no_traceback(server, caplog, path, body, last):
    """The openai SDK's stream helpers close the connection as soon as a reply ends by length (before [DONE]);
    the writes after it failed on the closed connection and aiohttp logged each as a traceback."""
    import struct

    payload = json.dumps({"model": MODEL_NAME, "stream": True, **body}).encode()
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d"
                         b"\r\n\r\n" % (path.encode(), len(payload)) + payload)
            seen = b""
            while last not in seen and (chunk := sock.recv(65536)):
                seen += chunk
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, at once
            sock.close()
        assert server.request("GET", "/health")[0] == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or "Error handling request" in r.getMessage()]
    assert not errors, errors[0].getMessage()


def test_loading_and_draining_are_503(start_server, async_engine):
    from tfserve.server.runtime.state import ServerState

    loading = start_server(state=ServerState())
    for path, body in [(CHAT, chat()), ("/health", None)]:
        status, headers, data = loading.request("POST" if body else "GET", path, body)
        assert status == 503 and data["error"]["code"] == "model_loading"
        assert int(headers["Retry-After"]) > 0  # a client's retry loop waits that long
    live = start_server()
    live.state.begin_drain()
    status, _, data = live.request("POST", CHAT, chat())
    assert status == 503 and data["error"]["code"] == "server_draining"
    assert live.request("GET", "/health")[0] == 503


def test_one_failing_request_is_a_500_for_it_alone(start_server, async_engine):
    live = start_server()
    real = live.state.generate

    def generate(request):
        if request.params.max_tokens == 7:
            return scripted_generate([], fail_with=RuntimeError("boom"))(request)
        return real(request)

    live.state.generate = generate
    results = {}

    def call(name, max_tokens):
        results[name] = live.request("POST", CHAT, chat(max_tokens=max_tokens, ignore_eos=True))

    threads = [threading.Thread(target=call, args=(name, m)) for name, m in [("bad", 7), ("good", 20)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    status, _, data = results["bad"]
    assert status == 500 and data["error"]["type"] == "server_error" and "boom" in data["error"]["message"]
    status, _, data = results["good"]
    assert status == 200 and data["usage"]["completion_tokens"] == 20


def test_an_engine_error_fails_its_request_and_its_stream(start_server):
    live = start_server()
    live.state.generate = scripted_generate(["a", "b"], finish_reason="error", error="CUDA fell over")
    status, _, data = live.request("POST", CHAT, chat())
    assert status == 500 and "CUDA fell over" in data["error"]["message"]
    status, _, raw = live.request("POST", CHAT, chat(stream=True))
    assert status == 200 and '"error"' in raw and "CUDA fell over" in raw and raw.endswith("data: [DONE]\n\n")
    with pytest.raises(openai.APIError):
        list(live.client().chat.completions.create(model=MODEL_NAME, messages=OK_MESSAGES, stream=True))


def test_a_grammar_that_fails_while_generating_is_a_400(start_server):
    """llguidance meeting a limit only while generating (the grammar compiled): the client's schema is at fault."""
    from tfserve.errors import GrammarFailed

    live = start_server()
    live.state.generate = scripted_generate(["{"], finish_reason="error", error=GrammarFailed("Too many items"))
    status, _, data = live.request("POST", CHAT, chat())
    assert status == 400 and data["error"]["code"] == "invalid_grammar" and "Too many items" in data["error"]["message"]
