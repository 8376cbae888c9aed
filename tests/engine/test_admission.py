"""One admission: `Engine.sampling_params` fills the defaults, `Engine.make_requests` validates and fans out `n`
once, and the manager and async engine run the built requests as they are. Also the shared chat renderer."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from tfserve import SamplingParams
from tfserve.engine import admission
from tfserve.engine.async_engine import AsyncEngine
from tfserve.protocol.chat_template import ChatTemplateError, render_chat
from tfserve.engine.manager import BatchingManager
from tfserve.errors import ContextLengthError

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 23]


def test_a_prompt_that_leaves_no_room_names_the_prompt(make_engine):
    engine = make_engine(num_blocks=8)  # 8 blocks of 4: 32 tokens per sequence
    with pytest.raises(ContextLengthError, match="the prompt is 32 tokens, which leaves no room") as info:
        engine.sampling_params(32, max_tokens=1)
    assert info.value.param == "prompt" and isinstance(info.value, ValueError)
    assert engine.sampling_params(31).max_tokens == 1


@pytest.mark.parametrize("limit", [{"max_model_len": 40}, {"num_blocks": 10}])
def test_every_context_error_gives_the_one_limit_that_applies(make_engine, limit):
    """`max_model_len` (--max-model-len) or a KV cache smaller than the model's context: max_tokens past the
    limit is told the same limit a long prompt is (it said 2048, the model's own, beside a 40-token cache)."""
    engine = make_engine(**limit)
    with pytest.raises(ContextLengthError, match="maximum context length is 40 tokens. However, you requested 111"):
        engine.make_requests(PROMPT, SamplingParams(max_tokens=100))
    with pytest.raises(ContextLengthError, match="maximum context length is 40 tokens .* the prompt is 45 tokens"):
        engine.make_requests(PROMPT * 4 + PROMPT[:1], SamplingParams(max_tokens=1))
    assert engine.make_requests(PROMPT, SamplingParams(max_tokens=29))[0].params.max_tokens == 29


def test_n_children_get_seed_plus_i(make_engine):
    engine = make_engine()
    requests = engine.make_requests(PROMPT, SamplingParams(n=3, seed=5, max_tokens=2), request_id="r")
    assert [r.request_id for r in requests] == ["r-0", "r-1", "r-2"]
    assert [(r.params.n, r.params.seed) for r in requests] == [(1, 5), (1, 6), (1, 7)]


def test_n_children_are_the_parents_checked_params_not_checked_again(monkeypatch):
    """The parent's SamplingParams were checked once; its children (n=1, seed+i) are copies of them."""
    parent = SamplingParams(n=3, seed=2**63 - 3, max_tokens=2, stop=["x"], logit_bias={5: 1.0})
    checked = []
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: checked.append(self))
    children = admission.fan_out("r", parent)
    assert not checked
    assert [(child_id, p.n, p.seed) for child_id, p in children] == [
        ("r-0", 1, 2**63 - 3), ("r-1", 1, 2**63 - 2), ("r-2", 1, 2**63 - 1)]
    assert all((p.max_tokens, p.stop, p.logit_bias) == (2, ["x"], {5: 1.0}) for _, p in children)
    assert parent.n == 3 and parent.seed == 2**63 - 3


def test_the_manager_runs_built_requests_without_validating_them_again(make_engine, monkeypatch):
    engine = make_engine()
    params = SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=6)
    expected = [out.generated_tokens for out in engine.generate_batch([PROMPT], params).values()]
    requests = engine.make_requests(PROMPT, params)

    def validate_again(*args):
        raise AssertionError("a built request was validated again")

    monkeypatch.setattr(engine, "make_requests", validate_again)
    monkeypatch.setattr(engine, "_validate", validate_again)
    with BatchingManager(engine) as manager:
        ids = manager.add_requests(requests)
        outputs = [manager.get_result(request_id, timeout=60) for request_id in ids]
    assert [out.generated_tokens for out in outputs] == expected
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_add_requests_refuses_an_id_in_use(make_engine):
    engine = make_engine()
    manager = BatchingManager(engine)  # not started: what is added stays pending
    requests = engine.make_requests(PROMPT, SamplingParams(max_tokens=2), request_id="x")
    assert manager.add_requests(requests) == ["x"]
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        manager.add_requests(requests)


def test_an_id_whose_result_is_unread_is_still_in_use(make_engine):
    """A finished request keeps its id until its result is read: taking it again lost that result."""
    engine = make_engine()
    with BatchingManager(engine) as manager:
        manager.add_request(PROMPT, request_id="x", params=SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 30
        while "x" in manager._sinks and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ValueError, match="request_id 'x' is already in use"):
            manager.add_request(PROMPT, request_id="x", params=SamplingParams(max_tokens=3))
        assert len(manager.get_result("x", timeout=30).generated_tokens) == 2
        manager.add_request(PROMPT, request_id="x", params=SamplingParams(max_tokens=3))  # read: free again
        assert len(manager.get_result("x", timeout=30).generated_tokens) == 3


def test_a_result_is_among_the_unread_before_a_reader_can_take_it(make_engine):
    """A reader that takes a final output from its queue marks it read; it must be unread by then, or a late
    mark left a read id among the unread and get_result() without an id raised KeyError."""
    engine = make_engine()
    manager = BatchingManager(engine)
    (request,) = engine.make_requests(PROMPT, SamplingParams(max_tokens=1))
    manager.add_requests([request])
    seen = []
    real_put = manager._queues[request.request_id].put
    manager._sinks[request.request_id] = (lambda out: (seen.append(request.request_id in manager._unread),
                                                       real_put(out)), False, True)
    while manager._has_work():  # the engine's steps, on this thread (the manager is not started)
        manager._step()
    assert seen == [True]
    assert manager.get_result(timeout=1).request_id == request.request_id
    assert manager.get_result(timeout=0.01) is None


def test_leaving_a_stream_early_aborts_its_request(make_engine):
    engine = make_engine()
    async_engine = AsyncEngine(engine).start()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    (request,) = engine.make_requests(PROMPT, params)

    async def first_output(stream):
        async with aclosing(stream) as outputs:
            async for output in outputs:
                return output

    def wait_until_idle():
        deadline = time.monotonic() + 10
        while engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks

    try:
        assert asyncio.run(first_output(async_engine.generate_request(request))).delta_tokens
        wait_until_idle()
        assert asyncio.run(first_output(async_engine.generate(PROMPT, params))).delta_tokens
        wait_until_idle()
        with pytest.raises(ValueError, match="n must be 1"):
            asyncio.run(first_output(async_engine.generate(PROMPT, params.replace(n=2))))
    finally:
        async_engine.stop()


class _Tokenizer:
    """Records what the renderer asks of `apply_chat_template`."""

    chat_template = "{{ messages }}"

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.kwargs = fail, None

    def apply_chat_template(self, messages, **kwargs):
        if self.fail is not None:
            raise self.fail
        self.kwargs = kwargs
        return {"input_ids": [1, 2, 3]}


def test_render_chat_keeps_its_own_arguments():
    tokenizer = _Tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages, None, {"enable_thinking": False, "tokenize": False}) == [1, 2, 3]
    assert tokenizer.kwargs["enable_thinking"] is False
    assert tokenizer.kwargs["tokenize"] and tokenizer.kwargs["add_generation_prompt"]


def test_render_chat_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="rejected the messages: bad role"):
        render_chat(_Tokenizer(fail=ValueError("bad role")), [])
    no_template = _Tokenizer()
    no_template.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(no_template, [])
