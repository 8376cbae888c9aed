"""`compile=True` (`--compile`): the model's own forward through torch.compile gives HF `generate`'s greedy tokens,
from one graph compiled at load time for every batch shape; a compile that fails leaves it eager, saying so once;
a model the lean forward runs is not compiled."""

from __future__ import annotations

import logging

import pytest
from test_golden import GREEDY, PROMPTS, _build, _check, _engine, _hf_greedy
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)

from tfserve.engine.backends import compiled

pytestmark = pytest.mark.slow  # inductor compiles C++ (about 10 s a tiny model on 2 cores)


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2 (learned positions, fused qkv, biases: the lean forward does not run it) and its references."""
    model = _build("gpt2").eval()
    model.generation_config.eos_token_id = None
    return model, {tuple(p): _hf_greedy(model, p) for p in PROMPTS}


def test_one_graph_compiled_at_load_serves_every_batch_shape(gpt2):
    from torch._dynamo.utils import counters

    model, references = gpt2
    before = counters["stats"]["unique_graphs"]
    engine = _engine(model, compile=True)
    assert engine.runner.forward.name == "compiled" and not engine.runner.forward.eager
    assert counters["stats"]["unique_graphs"] == before + 1  # compiled by the warm-up, before any request
    outs = engine.generate_batch(PROMPTS, GREEDY)  # a 4-sequence prefill, then 4, 3, 2 and 1 decodes a step
    _check(engine, PROMPTS, outs.values(), references)
    for prompt in PROMPTS[:2]:  # one sequence: a lone prefill, then one token a step
        _check(engine, [prompt], engine.generate_batch([prompt], GREEDY).values(), references)
    engine = _engine(model, compile=True, max_batch_tokens=8)  # chunked prefill beside decodes
    _check(engine, PROMPTS, engine.generate_batch(PROMPTS, GREEDY).values(), references)
    assert counters["stats"]["unique_graphs"] == before + 1  # no shape compiled again (nor the same model)


def test_a_compile_that_fails_runs_eagerly_and_says_so(gpt2, monkeypatch, caplog):
    model, references = gpt2

    def broken(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no C++ compiler found\nmore detail")
        return run

    monkeypatch.setattr(compiled.torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="tfserve.engine.backends.compiled"):
        engine = _engine(model, compile=True)
    assert engine.runner.forward.eager
    assert [r.getMessage() for r in caplog.records] == [
        "compile failed, the model's forward runs eagerly: no C++ compiler found"]
    _check(engine, PROMPTS, engine.generate_batch(PROMPTS, GREEDY).values(), references)


def test_a_model_the_lean_forward_runs_is_not_compiled(caplog):
    model = _build("llama").eval()
    model.generation_config.eos_token_id = None
    references = {tuple(PROMPTS[0]): _hf_greedy(model, PROMPTS[0])}
    with caplog.at_level(logging.INFO, logger="tfserve.engine.backends"):
        engine = _engine(model, compile=True)
    assert engine.runner.forward.name == "lean"
    assert any("nothing is compiled" in r.getMessage() for r in caplog.records)
    _check(engine, PROMPTS[:1], engine.generate_batch(PROMPTS[:1], GREEDY).values(), references)
