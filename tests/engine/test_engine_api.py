"""The Engine's public behaviour on a tiny llama with an in-process tokenizer: outputs, stop conditions,
abort, a failing request, and no leaked blocks afterwards."""

from __future__ import annotations

import pytest

from tfserve import SamplingParams
from tfserve.engine.request import RequestOutput

TEXTS = ["hello world", "the quick brown fox jumps", "Once upon a time there was", "stop here."]
NUM_NEW = 20


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", NUM_NEW)
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, **kwargs)


def drain(engine, outputs: dict | None = None) -> dict[str, RequestOutput]:
    """Step until nothing is left; returns the final output of every request that finished meanwhile."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
    return outputs


def assert_no_leak(engine) -> None:
    pool = engine.block_pool
    assert not engine.has_unfinished
    assert engine.requests == {}
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.ref_counts == [0] * pool.num_blocks


@pytest.fixture
def reference(make_engine, tokenizer):
    """Greedy outputs for TEXTS, ignoring EOS."""
    engine = make_engine()
    outs = engine.generate_batch(TEXTS, greedy())
    return list(outs.values())


def test_generate_batch_outputs_in_input_order(make_engine, tokenizer):
    engine = make_engine()
    inputs = [TEXTS[2], tokenizer.encode(TEXTS[0]), TEXTS[1]]
    outs = engine.generate_batch(inputs, greedy(max_tokens=8))
    assert list(outs) == ["0", "1", "2"]
    for (request_id, out), prompt in zip(outs.items(), inputs):
        assert isinstance(out, RequestOutput)
        assert out.request_id == request_id
        expected_prompt = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert out.prompt_token_ids == expected_prompt
        assert len(out.generated_tokens) == 8
        assert out.finish_reason in {"stop", "length"}
        assert out.finish_reason == "length"
        assert out.finished
        assert out.text == tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
        assert out.metrics is not None
        assert 0 <= out.metrics.ttft <= out.metrics.e2e
        assert out.error is None
    assert_no_leak(engine)


def test_request_ids_keep_counting_across_batches(make_engine):
    engine = make_engine()
    first = engine.generate_batch(TEXTS[:2], greedy(max_tokens=2))
    second = engine.generate_batch(TEXTS[:2], greedy(max_tokens=2))
    assert not set(first) & set(second)
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in second.values()]


def test_streamed_deltas_add_up_to_the_final_output(make_engine):
    engine = make_engine()
    (request_id,) = engine.add_request(TEXTS[1], greedy())
    text, tokens, final = "", [], None
    while engine.has_unfinished:
        for output in engine.step():
            assert output.request_id == request_id
            text += output.delta_text
            tokens += output.delta_tokens
            if output.finished:
                final = output
    assert final is not None
    assert tokens == final.generated_tokens
    assert text == final.text


def _boundary_stop(tokenizer, tokens: list[int], text: str) -> tuple[str, int]:
    """A two-character stop string made of the last character of tokens[:k] and the first of token k;
    returns (stop, k)."""
    for k in range(2, len(tokens) - 1):
        prefix = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        longer = tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
        if not prefix or not text.startswith(longer) or len(longer) <= len(prefix) or not longer.startswith(prefix):
            continue
        stop = text[len(prefix) - 1 : len(prefix) + 1]
        if "\ufffd" in stop or text.find(stop) != len(prefix) - 1:
            continue
        return stop, k
    pytest.skip("no usable token boundary in this greedy output")


def test_stop_string_across_tokens_is_cut_from_text(make_engine, tokenizer, reference):
    full = reference[0]
    stop, k = _boundary_stop(tokenizer, full.generated_tokens, full.text)
    engine = make_engine()
    out = engine.generate_batch([TEXTS[0]], greedy(stop=[stop, "never-there"]))["0"]
    cut = full.text.find(stop)
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.generated_tokens == full.generated_tokens[: k + 1]  # stopped at the token completing it

    out = engine.generate_batch([TEXTS[0]], greedy(stop=[stop], include_stop_str_in_output=True))
    assert next(iter(out.values())).text == full.text[: cut + len(stop)]

    # logprobs: the tokens of the text returned, not those of the stop string (as OpenAI's)
    (out,) = engine.generate_batch([TEXTS[0]], greedy(stop=[stop], logprobs=0)).values()
    ids = [entry["token_id"] for entry in out.logprobs]
    assert ids == full.generated_tokens[: len(ids)] and len(ids) <= k
    assert tokenizer.decode(ids).startswith(out.text) and len(tokenizer.decode(ids[:-1])) < len(out.text)
    (out,) = engine.generate_batch([TEXTS[0]], greedy(stop=[stop], logprobs=0,
                                                       include_stop_str_in_output=True)).values()
    assert len(out.logprobs) == k + 1

    # streamed: each token's logprob goes out with its text, so the stop string's never do
    request_id = engine.add_request(TEXTS[0], greedy(stop=[stop], logprobs=0))[0]
    chunks = []
    while engine.has_unfinished:
        chunks += [o for o in engine.step() if o.request_id == request_id]
    streamed = [entry for o in chunks for entry in o.delta_logprobs or ()]
    assert streamed == chunks[-1].logprobs and len(streamed) == len(ids)
    text = ""
    for o in chunks:  # the tokens sent so far never run past the text sent so far (but for half a character)
        text += o.delta_text
        sent = [entry["token_id"] for c in chunks[: chunks.index(o) + 1] for entry in c.delta_logprobs or ()]
        assert text.startswith(tokenizer.decode(sent).rstrip("\ufffd"))
    assert_no_leak(engine)


def test_eos_honoured_unless_ignore_eos(make_engine, llama, tokenizer, reference, monkeypatch):
    tokens = reference[1].generated_tokens
    eos = tokens[3]
    first = tokens.index(eos)
    monkeypatch.setattr(llama.generation_config, "eos_token_id", eos)
    engine = make_engine()
    out = engine.generate_batch([TEXTS[1]], greedy(ignore_eos=False))["0"]
    assert out.generated_tokens == tokens[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == eos
    assert out.text == tokenizer.decode(tokens[:first], skip_special_tokens=True)  # EOS itself not rendered

    out = engine.generate_batch([TEXTS[1]], greedy(ignore_eos=True))["1"]
    assert out.generated_tokens == tokens
    assert out.finish_reason == "length"
    assert_no_leak(engine)


def test_tokenizer_eos_used_when_the_model_has_none(make_engine, tokenizer):
    engine = make_engine()
    assert engine.eos_token_ids == frozenset({tokenizer.eos_token_id})


def test_stop_token_ids(make_engine, reference):
    tokens = reference[2].generated_tokens
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    engine = make_engine()
    out = engine.generate_batch([TEXTS[2]], greedy(stop_token_ids=[stop_id]))["0"]  # even with ignore_eos
    assert out.generated_tokens == tokens[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    assert_no_leak(engine)


def test_abort_leaves_the_others_identical_and_frees_everything(make_engine, reference):
    engine = make_engine(max_num_seqs=3)  # the fourth request waits at first
    ids = [engine.add_request(text, greedy())[0] for text in TEXTS]
    outputs: dict[str, RequestOutput] = {}
    for _ in range(3):
        for output in engine.step():
            assert not output.finished
    assert engine.num_running == 3 and engine.num_waiting == 1

    aborted = engine.abort(ids[1])  # running
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.generated_tokens) < NUM_NEW
    assert aborted.metrics is not None
    assert engine.abort(ids[1]) is None  # already gone
    assert engine.abort("no-such-request") is None

    drain(engine, outputs)
    assert set(outputs) == {ids[0], ids[2], ids[3]}
    for i in (0, 2, 3):
        assert outputs[ids[i]].generated_tokens == reference[i].generated_tokens
        assert outputs[ids[i]].text == reference[i].text
    assert_no_leak(engine)


def test_abort_waiting_and_preempted_requests(make_engine, reference):
    engine = make_engine(max_num_seqs=2)
    ids = [engine.add_request(text, greedy())[0] for text in TEXTS]
    engine.step()
    assert engine.abort(ids[3]).finish_reason == "abort"  # never scheduled
    outputs = drain(engine)
    assert set(outputs) == set(ids[:3])
    assert_no_leak(engine)

    engine = make_engine(num_blocks=10)
    ids = [engine.add_request(text, greedy())[0] for text in TEXTS]
    while not engine.scheduler.num_preemptions:
        engine.step()
    (victim,) = [r.request_id for r in engine.scheduler.waiting if r.num_preemptions]
    assert engine.abort(victim).finish_reason == "abort"
    outputs = drain(engine)
    assert set(outputs) == set(ids) - {victim}
    for i, request_id in enumerate(ids):
        if request_id in outputs:
            assert outputs[request_id].generated_tokens == reference[i].generated_tokens
    assert_no_leak(engine)


def test_failing_request_finishes_alone_with_an_error(make_engine, reference):
    engine = make_engine()
    sampler = engine.runner.sampler

    def failing_sampler(logits, requests):
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("boom")
        return sampler(logits, requests)

    engine.runner.sampler = failing_sampler
    ids = [engine.add_request(TEXTS[0], greedy())[0], engine.add_request(TEXTS[3], greedy(), request_id="bad")[0],
           engine.add_request(TEXTS[2], greedy())[0]]
    outputs = {}
    first_step = engine.step()
    for output in first_step:
        if output.finished:
            outputs[output.request_id] = output
    assert "bad" in outputs  # failed in the very step it first sampled
    bad = outputs["bad"]
    assert bad.finish_reason == "error"
    assert "boom" in bad.error
    assert bad.generated_tokens == []
    assert engine.num_running == 2

    drain(engine, outputs)
    assert set(outputs) == set(ids)
    assert outputs[ids[0]].generated_tokens == reference[0].generated_tokens
    assert outputs[ids[2]].generated_tokens == reference[2].generated_tokens
    assert outputs[ids[0]].finish_reason == outputs[ids[2]].finish_reason == "length"
    assert_no_leak(engine)


def test_request_failing_mid_decode(make_engine, reference):
    engine = make_engine()
    sampler = engine.runner.sampler

    def failing_sampler(logits, requests):
        for r in requests:
            if r.request_id == "bad" and r.num_output_tokens == 4:
                raise RuntimeError("boom at 4")
        return sampler(logits, requests)

    engine.runner.sampler = failing_sampler
    engine.add_request(TEXTS[3], greedy(), request_id="bad")
    engine.add_request(TEXTS[1], greedy(), request_id="good")
    outputs = drain(engine)
    assert outputs["bad"].finish_reason == "error"
    assert outputs["bad"].generated_tokens == reference[3].generated_tokens[:4]
    assert outputs["good"].generated_tokens == reference[1].generated_tokens
    assert_no_leak(engine)


def test_request_failing_before_its_forward_leaves_no_stale_cache(make_engine, tokenizer):
    prompt = tokenizer.encode(TEXTS[2] + " and then")
    assert len(prompt) >= 9
    expected = make_engine().generate_batch([prompt], greedy())["0"].generated_tokens

    engine = make_engine()
    execute = engine.runner.execute

    def failing_execute(plan):
        if any(r.request_id == "bad" for r in plan.requests):
            raise RuntimeError("forward failed")
        return execute(plan)

    engine.runner.execute = failing_execute
    engine.add_request(prompt, greedy(), request_id="bad")
    outputs = drain(engine)
    assert outputs["bad"].finish_reason == "error"
    assert_no_leak(engine)

    engine.runner.execute = execute
    out = engine.generate_batch([prompt], greedy())
    assert next(iter(out.values())).generated_tokens == expected


def test_prefix_cache_metrics(make_engine):
    engine = make_engine()
    shared = "Once upon a time there was a tiny model that served many requests"
    engine.generate_batch([shared + " at once."], greedy(max_tokens=2))
    assert engine.prefix_cache_hit_rate == 0.0
    out = engine.generate_batch([shared + " today"], greedy(max_tokens=2))
    out = next(iter(out.values()))
    assert out.metrics.num_cached_tokens > 0
    assert 0 < engine.prefix_cache_hit_rate <= 1


def test_seeded_request_unaffected_by_a_neighbour_failing_in_the_sampler(make_engine, monkeypatch):
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)
    expected = make_engine().generate_batch([TEXTS[0]], params)["0"].generated_tokens

    from tfserve.engine.sampler import Sampler

    logprobs = Sampler._logprobs

    def failing_logprobs(self, logits, token_ids, params_list):
        if any(p.logprobs == 7 for p in params_list):  # only the "bad" request asks for 7
            raise RuntimeError("logprobs failed")
        return logprobs(self, logits, token_ids, params_list)

    monkeypatch.setattr(Sampler, "_logprobs", failing_logprobs)
    engine = make_engine()
    engine.add_request(TEXTS[0], params, request_id="seeded")
    engine.add_request(TEXTS[1], greedy(logprobs=7), request_id="bad")
    outputs = drain(engine)
    assert outputs["bad"].finish_reason == "error"
    assert outputs["seeded"].generated_tokens == expected


def test_generate_batch_validates_every_prompt_before_queueing_any(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.generate_batch([[5, 6, 7], []], greedy(max_tokens=2))
    assert engine.num_waiting == 0 and not engine.requests  # the first was not left to run unseen later


def test_params_changed_after_they_were_built_are_checked_again(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=4, temperature=0.7)
    params.temperature = "hot"
    with pytest.raises(ValueError, match="^temperature"):
        engine.generate_batch([[5, 6, 7]], params)
    params = SamplingParams(max_tokens=4)
    params.max_tokens = 0
    with pytest.raises(ValueError, match="^max_tokens"):
        engine.generate_batch([[5, 6, 7]], params)
    assert not engine.requests


def test_a_generate_batch_that_raises_leaves_no_request_behind(make_engine, monkeypatch):
    """A step that raises (or Ctrl-C) ends the call's requests: the next call runs alone, as it would have."""
    engine = make_engine()
    (expected,) = engine.generate_batch([[5, 6, 7]], greedy(max_tokens=4)).values()
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate_batch([[9, 8, 7], [5, 6]], greedy(max_tokens=4))
    assert not engine.requests and not engine.has_unfinished
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    (again,) = engine.generate_batch([[5, 6, 7]], greedy(max_tokens=4)).values()
    assert again.generated_tokens == expected.generated_tokens


def test_generate_batch_takes_one_prompt_and_array_ids(make_engine):
    import numpy as np
    import torch

    engine = make_engine()
    (text,) = engine.generate_batch("hello world", greedy(max_tokens=2)).values()  # one prompt, not 11
    (ids,) = engine.generate_batch([5, 6, 7], greedy(max_tokens=2)).values()
    arrays = engine.generate_batch([np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), 6, 7]],
                                   greedy(max_tokens=2))
    assert len(text.generated_tokens) == 2
    assert [o.generated_tokens for o in arrays.values()] == [ids.generated_tokens] * 3
    for one in (np.array([5, 6, 7]), torch.tensor([5, 6, 7])):  # one prompt, as a list of ids is
        assert [o.generated_tokens for o in engine.generate_batch(one, greedy(max_tokens=2)).values()] == \
            [ids.generated_tokens]
    with pytest.raises(ValueError, match="prompt must be"):
        engine.generate_batch([[True, 5]], greedy())
    with pytest.raises(ValueError, match="inputs must be a list of prompts"):
        engine.generate_batch({"hello": 1}, greedy())


def test_no_params_take_the_models_recommended_sampling(make_engine):
    engine = make_engine()
    engine.sampling_defaults = {"max_tokens": 3, "temperature": 0.0}  # as a generation_config gives them
    (output,) = engine.generate_batch([[5, 6, 7]]).values()
    assert len(output.generated_tokens) == 3  # not SamplingParams()'s 16


def test_a_prompt_that_fills_the_context_names_the_prompt(make_engine):
    from tfserve.errors import ContextLengthError

    engine = make_engine()
    with pytest.raises(ContextLengthError) as error:
        engine.add_request([5] * engine.max_model_len, greedy(max_tokens=1))
    assert error.value.param == "prompt"


@pytest.mark.parametrize("fields,name", [
    ({"seed": True}, "seed"), ({"logprobs": True}, "logprobs"), ({"n": True}, "n"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": True}, "top_k"), ({"stop_token_ids": [True]}, "stop_token_ids"), ({"temperature": 1e39}, "temperature"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"logit_bias": [1, 2]}, "logit_bias"), ({"stop": 5}, "stop"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),
    ({"skip_special_tokens": None}, "skip_special_tokens"), ({"ignore_eos": 1}, "ignore_eos"), ({"n": 129}, "n"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_bad_sampling_values_name_their_field(fields, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        SamplingParams(**fields)
