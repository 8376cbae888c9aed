"""The model's generation_config as the default of every sampling field a request leaves out."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tfserve.config import EngineConfig
from tfserve.models.catalog import get_known, recommend_sampling


@pytest.fixture
def recommended(llama, monkeypatch):
    config = llama.generation_config
    for name, value in {"do_sample": True, "temperature": 0.3, "top_p": 0.8, "max_new_tokens": 7}.items():
        monkeypatch.setattr(config, name, value)
    return config


def test_defaults_come_from_the_generation_config(recommended, make_engine):
    engine = make_engine()
    assert engine.sampling_defaults == {"temperature": 0.3, "top_p": 0.8, "max_tokens": 7}
    params = engine.sampling_params(5)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.8, 7)
    params = engine.sampling_params(5, temperature=0.0, top_p=None, max_tokens=2)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.8, 2)


def test_generation_config_none_keeps_our_defaults(recommended, make_engine):
    engine = make_engine(generation_config="none")
    assert engine.sampling_defaults == {}
    params = engine.sampling_params(5)
    capacity = min(engine.max_model_len, engine.block_pool.num_blocks * engine.block_pool.block_size)
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 1.0, capacity - 5)


def test_a_broken_generation_config_is_ignored(llama, make_engine, monkeypatch, caplog):
    monkeypatch.setattr(llama.generation_config, "temperature", -1.0)
    assert make_engine().sampling_defaults == {}
    assert "ignoring the model's generation_config" in caplog.text


def test_bad_generation_config_switch():
    with pytest.raises(ValueError, match="generation_config must be auto or none"):
        EngineConfig(generation_config="sometimes")


def test_recommended_sampling_fills_only_a_silent_config():
    sampling = get_known("smollm2-135m-instruct").sampling
    assert sampling == {"temperature": 0.2, "top_p": 0.9}
    silent = GenerationConfig(bos_token_id=1, eos_token_id=2)
    assert recommend_sampling(silent, sampling)
    assert (silent.do_sample, silent.temperature, silent.top_p) == (True, 0.2, 0.9)
    own = GenerationConfig(do_sample=True, temperature=0.7)
    assert not recommend_sampling(own, sampling)
    assert own.temperature == 0.7 and own.top_p in (None, 1.0)
