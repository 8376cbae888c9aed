"""/v1/completions, /v1/responses, /v1/models, /health and /metrics."""

from __future__ import annotations

import openai
import pytest

from tiny import MODEL_NAME, scripted_generate, sse_events

GREEDY = {"temperature": 0, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def test_completion_whole_streamed_and_usage(server, tokenizer):
    client = server.client()
    reply = client.completions.create(model=MODEL_NAME, prompt="hello world", **GREEDY)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert reply.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="hello world", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completion_echo_token_prompts_and_batches(server, tokenizer):
    client = server.client()
    reply = client.completions.create(model=MODEL_NAME, prompt="hello", echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt="hello", **GREEDY)
    assert reply.choices[0].text == "hello" + plain.choices[0].text
    streamed = client.completions.create(model=MODEL_NAME, prompt="hello", echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text
    ids = tokenizer.encode("hello")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == plain.choices[0].text
    batch = client.completions.create(model=MODEL_NAME, prompt=["hello", [ids[0]]], n=2, max_tokens=3, seed=1,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(ids) + 1 and batch.usage.completion_tokens == 12


def test_completion_legacy_logprobs(server):
    client = server.client()
    reply = client.completions.create(model=MODEL_NAME, prompt="hello world", logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 10
    assert "".join(logprobs.tokens) == reply.choices[0].text or "\ufffd" in reply.choices[0].text
    # the sampled token is always among them (OpenAI's legacy rule: up to logprobs + 1 entries)
    assert all(len(top) <= 3 and top[token] >= lp for token, top, lp in zip(logprobs.tokens, logprobs.top_logprobs,
                                                                               logprobs.token_logprobs))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = client.completions.create(model=MODEL_NAME, prompt="hello world", logprobs=2, stream=True, **GREEDY)
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


def test_completion_with_max_tokens_0_reads_the_prompt_only(server):
    """OpenAI's minimum is 0: an empty completion, as vLLM gives, echo or not."""
    reply = server.client().completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=0)
    assert reply.choices[0].text == "" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens > 0


def test_completion_legacy_logprobs_show_the_sampled_token(server):
    """logprobs=0 shows the sampled token alone; a hot draw outside the top one shows beside it."""
    client = server.client()
    reply = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is the", logprobs=0,
                                      max_tokens=8, temperature=1.5, seed=3)
    logprobs = reply.choices[0].logprobs
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]
    reply = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is the", logprobs=1,
                                      max_tokens=16, temperature=1.5, seed=3)
    logprobs = reply.choices[0].logprobs
    tops = logprobs.top_logprobs
    assert all(list(top)[-1] == token for token, top in zip(logprobs.tokens, tops))
    assert any(len(top) == 2 for top in tops)  # a token that was not the likeliest: the likeliest, then it


def test_responses_whole(server, tokenizer):
    client = server.client()
    reply = client.responses.create(model=MODEL_NAME, input="hello", instructions="be brief", max_output_tokens=6,
                                    temperature=0, metadata={"trace": "abc"}, extra_body={"ignore_eos": True})
    assert reply.object == "response" and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.instructions == "be brief" and reply.metadata == {"trace": "abc"}
    assert reply.user is None and reply.service_tier == "default"
    echoed = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=1, user="u1",
                                     safety_identifier="s1", prompt_cache_key="k1", top_logprobs=2)
    assert (echoed.user, echoed.safety_identifier, echoed.prompt_cache_key, echoed.top_logprobs) == ("u1", "s1",
                                                                                                     "k1", 2)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    expected = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert reply.usage.input_tokens == expected and reply.usage.output_tokens == 6
    assert reply.usage.total_tokens == expected + 6
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, **{**GREEDY, "max_tokens": 6})
    assert reply.output_text == chat.choices[0].message.content


def test_responses_message_list_input(server):
    reply = server.client().responses.create(
        model=MODEL_NAME, max_output_tokens=3,
        input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}])
    assert reply.output[0].role == "assistant" and reply.usage.output_tokens <= 3


def test_every_answer_carries_a_request_id(server):
    """x-request-id, as OpenAI's answers do (the SDK's `_request_id`): the client's own when it sends one."""
    reply = server.client().chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert reply.headers["x-request-id"].startswith("req_") and reply.parse().choices
    status, headers, _ = server.request("GET", "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42"
    status, headers, _ = server.request("GET", "/v1/nope", headers={"X-Request-Id": "bad id\twith tab"})
    assert status == 404 and headers["x-request-id"].startswith("req_")


def test_stored_responses_are_retrieved_listed_and_deleted(server):
    client = server.client()
    reply = client.responses.create(
        model=MODEL_NAME, max_output_tokens=3,
        input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}])
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()
    status, _, error = server.request("GET", f"/v1/responses/{reply.id}?stream=true")  # no background runs here
    assert status == 400 and error["error"]["param"] == "stream"
    items = client.responses.input_items.list(reply.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant", "user"]
    assert items.data[0].content[0].text == "hi" and len({item.id for item in items.data}) == 3
    newest = client.responses.input_items.list(reply.id, limit=2)  # newest first, by default
    assert [item.content[0].text for item in newest.data] == ["again", "hello"] and newest.has_more
    rest = client.responses.input_items.list(reply.id, limit=2, after=newest.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["hi"] and not rest.has_more
    unstored = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False)
    client.responses.delete(reply.id)
    for response_id in (reply.id, unstored.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    with pytest.raises(openai.BadRequestError):  # previous_response_id naming it too (400, as OpenAI)
        client.responses.create(model=MODEL_NAME, input="and?", previous_response_id=reply.id, max_output_tokens=2)
    status, _, body = server.request("GET", f"/v1/responses/{unstored.id}/input_items")
    assert status == 404 and body["error"]["code"] == "not_found"
    kept = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    for query, param in (("limit=500", "limit"), ("order=up", "order"), ("after=nope", "after")):
        status, _, body = server.request("GET", f"/v1/responses/{kept.id}/input_items?{query}")
        assert status == 400 and body["error"]["param"] == param


RESPONSE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added"]
def test_responses_output_text_logprobs(server):
    """include: ["message.output_text.logprobs"] gives each output token with its top_logprobs, as chat does,
    on the text part and on each delta."""
    client = server.client()
    body = {"model": MODEL_NAME, "input": "hello", "max_output_tokens": 6, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"], "extra_body": {"ignore_eos": True}}
    reply = client.responses.create(**body)
    logprobs = reply.output[0].content[0].logprobs
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                          logprobs=True, top_logprobs=2, **{**GREEDY, "max_tokens": 6})
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in logprobs] == [lp.token for lp in expected] and len(logprobs) == 6
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = list(client.responses.create(**body, stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in logprobs]
    assert [lp.token for lp in next(e for e in events if e.type == "response.output_text.done").logprobs] == streamed
    plain = client.responses.create(**{**body, "include": [], "reasoning": {"effort": "low"}})  # not asked for: none
    assert plain.output[0].content[0].logprobs == []
    assert plain.reasoning.effort == "low" and plain.reasoning.summary is None  # echoed, as OpenAI does
    status, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "hi",
                                                                "top_logprobs": 21})
    assert status == 400 and error["error"]["param"] == "top_logprobs"


RESPONSE_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_stream_event_order(server):
    events = list(server.client().responses.create(model=MODEL_NAME, input="hello", max_output_tokens=5,
                                                   stream=True, temperature=0, extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == RESPONSE_EVENTS + ["response.output_text.delta"] * len(deltas) + RESPONSE_TAIL + \
        ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-4]
    assert "".join(d.delta for d in deltas) == done.text
    assert events[-1].response.usage.output_tokens == 5 and events[-1].response.output_text == done.text


def test_responses_stream_completes_when_the_model_stops(start_server):
    live = start_server()
    live.state.generate = scripted_generate(["Paris", " is", " nice."])
    status, _, raw = live.request("POST", "/v1/responses", {"input": "hi", "stream": True})
    events = sse_events(raw)
    assert status == 200 and [e["type"] for e in events] == RESPONSE_EVENTS + ["response.output_text.delta"] * 3 + \
        RESPONSE_TAIL + ["response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Paris is nice."
    assert final["usage"]["output_tokens"] == 3
    assert "[DONE]" not in raw  # the Responses stream ends without it, as OpenAI's does


def test_models(server):
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_whisper_1_is_the_speech_model_everywhere(server):
    """OpenAI's name works for transcriptions (the default speech model), so it is retrieved as that model and
    refused for text as a speech model is."""
    whisper = server.client().models.retrieve("whisper-1")
    assert whisper.id == "whisper-1" and whisper.model_extra["input_modalities"] == ["audio"]
    status, _, data = server.request("POST", "/v1/chat/completions", {"model": "whisper-1", "max_tokens": 2,
                                                                      "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and data["error"]["param"] == "model"
    assert "is a speech-to-text model" in data["error"]["message"]


def test_force_model_ignores_the_request_model(start_server):
    live = start_server(state_kwargs={"force_model": True})
    reply = live.client().chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert reply.model == MODEL_NAME


def test_health_is_503_at_once_when_a_tensor_parallel_rank_is_gone(server, monkeypatch):
    """A dead rank fails the next step only after the collectives' timeout: /health says it as soon as the
    worker process has exited."""
    class Workers:
        def dead(self, wait_s: float = 1.0) -> list[str]:
            return ["rank 1 (killed by SIGKILL)"]

    monkeypatch.setattr(server.state.engine, "_workers", Workers(), raising=False)
    status, _, body = server.request("GET", "/health")
    assert status == 503 and body["status"] == "failed" and "rank 1 (killed by SIGKILL)" in body["error"]["message"]
    monkeypatch.undo()
    assert server.request("GET", "/health")[0] == 200


def test_health_and_metrics(server):
    server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True).close()
    server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3)
    status, _, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL_NAME
    status, headers, text = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ['tfserve_requests_total{endpoint="/v1/chat/completions",status="200"}',
                 "tfserve_prompt_tokens_total", "tfserve_generation_tokens_total",
                 "tfserve_time_to_first_token_seconds_count", "tfserve_inter_token_latency_seconds_count",
                 "tfserve_e2e_request_latency_seconds_count", "tfserve_num_requests_running",
                 "tfserve_num_requests_waiting", "tfserve_kv_cache_blocks_used", "tfserve_kv_cache_blocks_total",
                 "tfserve_prefix_cache_hit_rate", "tfserve_spec_decode_draft_tokens",
                 "tfserve_spec_decode_accepted_tokens", "tfserve_spec_decode_acceptance_rate",
                 "tfserve_cuda_graphs_captured 0.0", "tfserve_cuda_graph_replays 0.0"]:  # on CPU: none
        assert name in text, name
    value = next(line for line in text.splitlines() if line.startswith("tfserve_generation_tokens_total"))
    assert float(value.split()[-1]) >= 3
    preempted = server.state.engine.scheduler.num_preemptions  # what the scheduler counts, as it counts it
    text = server.request("GET", "/metrics")[2]
    assert f"tfserve_num_preemptions {float(preempted)}" in text
    assert f'tfserve_replica_num_preemptions{{replica="0"}} {float(preempted)}' in text
    # which instructions each CPU kernel path runs on: the engine's table, as it is on this machine (none without
    # the kernels)
    paths = server.state.engine.kernel_paths
    assert "# TYPE tfserve_kernel_path_info gauge" in text
    assert text.count("tfserve_kernel_path_info{") == len(paths)
    for path, isa in paths.items():
        assert f'tfserve_kernel_path_info{{isa="{isa}",path="{path}"}} 1.0' in text, path


def test_huggingface_hub_inference_client_works_unmodified(server, monkeypatch):
    """InferenceClient pointed at a base URL sends the placeholder model "dummy": it means the served one."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # the tests' offline mode; this is localhost

    client = InferenceClient(base_url=f"{server.base_url}/v1")
    reply = client.chat_completion(messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0)
    assert reply.model == MODEL_NAME
    assert reply.usage.completion_tokens >= 1
    chunks = list(client.chat_completion(messages=[{"role": "user", "content": "hello"}], max_tokens=4,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_queued_sequences_are_never_counted_twice():
    """The waiting gauge: the engine's queue is among the sequences without a first token; one waiting for its
    model (or the engine's next step) counts too."""
    from types import SimpleNamespace

    from tfserve.server.runtime.state import ServerState

    state = ServerState()
    state.num_waiting = 3  # nothing loaded yet: all three wait
    assert state.num_queued == 3
    state.engine = SimpleNamespace(num_waiting=5, num_running=1)
    state.num_waiting = 6  # 5 queued in the engine and 1 running its prompt
    assert state.num_queued == 5
    state.engine = SimpleNamespace(num_waiting=0, num_running=0)
    state.num_waiting = 2  # submitted, not yet taken by the engine's step
    assert state.num_queued == 2
