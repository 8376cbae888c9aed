"""Concurrent streams with clients that leave midway, the API key, CORS, the access log and draining."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import aiohttp
import openai
import pytest

from tiny import MODEL_NAME, build_engine, make_state, scripted_generate, wait_until_idle

CHAT = "/v1/chat/completions"


async def _stream(session: aiohttp.ClientSession, url: str, i: int, leave_after: int | None):
    # those that leave ask for many tokens, so that they are surely still generating when they go
    max_tokens = 40 if leave_after is None else 400
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"story number {i}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "seed": i}
    events = []
    async with session.post(url, json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: "):].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
            if leave_after is not None and len(events) >= leave_after:
                response.close()  # the client goes away mid-stream
                return None
    return events


def test_40_streams_15_leave_midway(server, engine, caplog):
    caplog.set_level(logging.INFO, logger="tfserve.access")
    registry = server.state.metrics.registry
    labels = {"endpoint": CHAT, "status": "499"}
    num_left_before = registry.get_sample_value("tfserve_requests_total", labels) or 0
    generated_before = registry.get_sample_value("tfserve_generation_tokens_total") or 0

    async def run():
        async with aiohttp.ClientSession() as session:
            url = f"{server.base_url}{CHAT}"
            return await asyncio.gather(*(_stream(session, url, i, 3 + i % 5 if i % 8 < 3 else None)
                                          for i in range(40)))

    results = asyncio.run(run())
    complete = [events for events in results if events is not None]
    assert len(complete) == 25
    for events in complete:
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 40
        assert len({c["id"] for c in chunks}) == 1
    assert registry.get_sample_value("tfserve_requests_total", labels) - num_left_before == 15
    # one access line for each, those whose client left too; a stream's line is written once its handler returns,
    # which may be just after its client read [DONE]
    def access_statuses() -> list[str]:
        return [r.getMessage().split()[2] for r in caplog.records if r.name == "tfserve.access"]

    deadline = time.monotonic() + 10
    while len(access_statuses()) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    statuses = access_statuses()
    assert sorted(statuses) == ["200"] * 25 + ["499"] * 15, statuses
    # the tokens of a stream its client left count (its access line, /metrics): each had sent 2 or more
    left = [r.getMessage() for r in caplog.records if r.name == "tfserve.access" and r.getMessage().split()[2] == "499"]
    assert all(int(line.split("tokens=")[1].split()[0].split("/")[1]) >= 2 for line in left), left
    generated = registry.get_sample_value("tfserve_generation_tokens_total") - generated_before
    assert generated >= 25 * 40 + 15 * 2
    assert wait_until_idle(engine), "KV blocks leaked"
    assert server.state.num_waiting == 0
    status, _, body = server.request("GET", "/health")
    assert status == 200 and body["num_running"] == 0 and body["num_waiting"] == 0
    assert server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "still there?"}], max_tokens=3).usage


def test_api_key(start_server, monkeypatch):
    live = start_server(api_key="sekret")
    with pytest.raises(openai.AuthenticationError) as info:
        live.client(api_key="wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    status, _, data = live.request("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 401 and data["error"]["type"] == "authentication_error"
    assert [m.id for m in live.client(api_key="sekret").models.list()] == [MODEL_NAME]
    assert live.request("GET", "/health")[0] == 200  # open to load balancers


@pytest.mark.parametrize("origins", [["https://app.example"], ["*"]])
def test_cors(start_server, origins):
    live = start_server(cors_allow_origins=origins)
    status, headers, _ = live.request("OPTIONS", CHAT, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    status, headers, _ = live.request("GET", "/v1/models", headers={"Origin": "https://app.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    status, headers, _ = live.request("GET", "/v1/models", headers={"Origin": "https://evil.example"})
    assert ("Access-Control-Allow-Origin" in headers) == (origins == ["*"])
    # errors that come from no route (404, 405) too, so a browser can read them
    for method, path, code in (("GET", "/v1/nope", 404), ("GET", CHAT, 405)):
        status, headers, _ = live.request(method, path, headers={"Origin": "https://app.example"})
        assert status == code and headers["Access-Control-Allow-Origin"] == "https://app.example"
        status, headers, _ = live.request(method, path, headers={"Origin": "https://evil.example"})
        assert ("Access-Control-Allow-Origin" in headers) == (origins == ["*"])


def test_one_access_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="tfserve.access"):
        server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 2
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    (record,) = [r for r in caplog.records if r.name == "tfserve.access"]
    line = record.getMessage()
    assert line.startswith("POST /v1/chat/completions 200 tokens=") and "/4 " in line
    assert "ttft=" in line and "duration=" in line and "ttft=-" not in line


def test_an_aborted_streams_tokens_are_in_its_access_line(start_server, caplog):
    """A stream the server aborts (shutting down) logs the tokens it sent, not 0."""
    live = start_server()
    live.state.generate = scripted_generate(["a", "b", "c"], finish_reason="abort")
    with caplog.at_level(logging.INFO, logger="tfserve.access"):
        status, _, raw = live.request("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                     "stream": True})
        deadline = time.monotonic() + 2
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
    assert status == 200 and "server_draining" in raw
    (record,) = [r for r in caplog.records if r.name == "tfserve.access"]
    assert "/3 " in record.getMessage()


def _start_stream(live, max_tokens: int, first_chunk: threading.Event, result: dict) -> threading.Thread:
    def run():
        client = live.client()
        text = ""
        try:
            stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=max_tokens, stream=True,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                first_chunk.set()
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    result["finish_reason"] = chunk.choices[0].finish_reason or result.get("finish_reason")
        except openai.APIError as exc:
            result["error"] = exc
        result["text"] = text
        first_chunk.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_drain_lets_in_flight_requests_finish(start_server, async_engine):
    from tfserve.server.run import drain

    live = start_server()
    first_chunk, result = threading.Event(), {}
    thread = _start_stream(live, 150, first_chunk, result)
    assert first_chunk.wait(30)
    draining = asyncio.run_coroutine_threadsafe(drain(live.state, timeout=60), live.loop)
    deadline = time.monotonic() + 10
    while live.state.status != "draining" and time.monotonic() < deadline:
        time.sleep(0.005)
    status, _, data = live.request("POST", CHAT, {"messages": [{"role": "user", "content": "late"}]})
    assert status == 503 and data["error"]["code"] == "server_draining"
    assert draining.result(60) == 0  # nothing was left to abort
    thread.join(30)
    assert result["finish_reason"] == "length" and "error" not in result


@pytest.mark.parametrize("second_signal", [False, True])
def test_drain_aborts_what_is_left_at_its_timeout_or_a_second_signal(tokenizer, start_server, second_signal):
    """Draining aborts the requests still in flight at `--drain-timeout`, or at once on a second Ctrl+C."""
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.server.run import drain

    engine = build_engine(tokenizer, num_blocks=64)
    step = engine.step

    def slow_step():  # 400 tokens of the tiny model took under 0.3 s on a fast CPU: the stream must outlast the wait
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    live = start_server(state=make_state(AsyncEngine(engine).start()))
    first_chunk, result = threading.Event(), {}
    thread = _start_stream(live, 400, first_chunk, result)
    assert first_chunk.wait(30)
    hurry = asyncio.Event()
    draining = asyncio.run_coroutine_threadsafe(drain(live.state, 600 if second_signal else 0.1, hurry), live.loop)
    if second_signal:
        time.sleep(0.3)
        assert not draining.done()  # waiting for the stream
        live.loop.call_soon_threadsafe(hurry.set)
    assert draining.result(30) == 1
    thread.join(30)
    assert "error" in result and result.get("finish_reason") is None
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "word " * 20_000}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "word " * 20_000, "max_tokens": 1}),
    ("/v1/responses", {"input": "word " * 20_000, "max_output_tokens": 1}),
])
def test_a_long_prompt_renders_off_the_event_loop(server, monkeypatch, path, body):
    """A prompt of megabytes takes seconds to render and tokenize: meanwhile the server answers the others."""
    from tfserve.protocol import chat_template

    started = threading.Event()

    def slowly(fn):  # stands for the template's and tokenizer's work on a huge prompt
        def slow(*args, **kwargs):
            started.set()
            time.sleep(1.5)
            return fn(*args, **kwargs)
        return slow

    from tfserve.server import generation

    tokenizer = server.state.engine.tokenizer
    # as for a model whose context takes the prompt (the tiny one's 512 tokens cannot: refused before rendering)
    monkeypatch.setitem(generation._LONGEST_ENTRY, tokenizer, 0)
    monkeypatch.setattr(chat_template, "render_chat", slowly(chat_template.render_chat))
    monkeypatch.setattr(tokenizer, "encode", slowly(tokenizer.encode))
    long_request = threading.Thread(target=server.request, args=("POST", path, {"model": MODEL_NAME, **body}))
    long_request.start()
    assert started.wait(10)
    begin = time.perf_counter()
    assert server.request("GET", "/health")[0] == 200
    assert time.perf_counter() - begin < 0.75  # not behind the 1.5 s render
    long_request.join()
