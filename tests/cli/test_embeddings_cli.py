"""`tfserve serve --embedding-model` and `--model` of an encoder (which one a command line means, decided before
anything loads), and `tfserve bench embeddings` in-process on a tiny BERT beside sentence-transformers."""

from __future__ import annotations

import json

import pytest
from test_cli import assert_one_line_error, invoke
from tiny_encoder import build_encoder_dir

from tfserve.cli.serve_embeddings import plan
from tfserve.errors import TfserveError, UsageError
from tfserve.models import catalog


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_encoder_dir(tmp_path_factory.mktemp("models") / "tiny-bert")


def test_which_model_serves_embeddings(encoder_dir, make_fake_model, tmp_path):
    assert plan(catalog.DEFAULT_MODEL, None) == (False, None)
    assert plan(catalog.DEFAULT_MODEL, str(encoder_dir)) == (False, str(encoder_dir))
    assert plan("all-minilm-l6-v2", None) == (True, "all-minilm-l6-v2")  # a catalog encoder: pulled when loaded
    assert plan(str(encoder_dir), str(encoder_dir)) == (True, str(encoder_dir))
    with pytest.raises(UsageError, match="would be a second one"):
        plan("all-minilm-l6-v2", str(encoder_dir))
    with pytest.raises(TfserveError, match="not a sentence-embedding model.*all-minilm-l6-v2"):
        plan(catalog.DEFAULT_MODEL, str(make_fake_model(tmp_path / "llama")))


def test_serve_refuses_a_chat_model_as_embedding_model(make_fake_model, tmp_path):
    chat = make_fake_model(tmp_path / "llama")
    assert_one_line_error(invoke("serve", "--embedding-model", str(chat), "--port", "1"),
                          "not a sentence-embedding model")


def test_serve_help_names_the_flag():
    result = invoke("serve", "--help")
    assert result.exit_code == 0 and "--embedding-model" in result.output


def test_bench_embeddings_in_process(encoder_dir, tmp_path):
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "bench.json"
    result = invoke("bench", "embeddings", "--model", str(encoder_dir), "--batch", "1,4", "-n", "8", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "tfserve" in result.output and "vs ST" in result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["backend"], r["batch"]) for r in runs] == [("tfserve", 1), ("sentence-transformers", 1),
                                                          ("tfserve", 4), ("sentence-transformers", 4)]
    assert all(r["num_failed"] == 0 and r["num_inputs"] == 8 and r["tokens_per_s"] > 0 for r in runs)
