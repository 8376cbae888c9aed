"""POST /v1/embeddings through the openai SDK and raw requests, on a tiny random BERT served beside the tiny chat
model (and alone): every input shape, float and base64, Matryoshka `dimensions`, usage, the limits a request meets,
model routing, and the chat endpoints' answer for an embedding model."""

from __future__ import annotations

import asyncio

import openai
import pytest
from tiny import MODEL_NAME, LiveServer, make_state
from tiny_encoder import SENTENCES, build_encoder_dir

from tfserve.server.runtime.embedding_models import EmbeddingOptions
from tfserve.server.runtime.state import READY, ServerState


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_encoder_dir(tmp_path_factory.mktemp("models") / "tiny-bert", matryoshka=(32, 16, 8))


@pytest.fixture
def embed_server(start_server, async_engine, encoder_dir):
    state = make_state(async_engine, embeddings=EmbeddingOptions(max_inputs=8, max_total_tokens=100))
    state.embeddings.load(str(encoder_dir))
    yield start_server(state)
    state.embeddings.stop()


def _error(server, body):
    status, _, data = server.request("POST", "/v1/embeddings", body)
    return status, data["error"]


def test_every_input_shape_through_the_sdk(embed_server):
    client = embed_server.client()
    one = client.embeddings.create(model="tiny-bert", input="hello world", encoding_format="float")
    assert one.model == "tiny-bert" and one.object == "list" and len(one.data) == 1
    assert len(one.data[0].embedding) == 32 and one.usage.prompt_tokens == one.usage.total_tokens == 4
    many = client.embeddings.create(model="tiny-bert", input=SENTENCES[:3], encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2] and many.data[0].embedding == pytest.approx(one.data[0].embedding)
    ids = client.embeddings.create(model="tiny-bert", input=[2, 10, 27, 3], encoding_format="float")
    assert ids.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6) and ids.usage.prompt_tokens == 4
    lists = client.embeddings.create(model="tiny-bert", input=[[2, 10, 27, 3], [2, 3]], encoding_format="float")
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == 6
    sdk_default = client.embeddings.create(model="tiny-bert", input=SENTENCES[:3])  # the SDK asks for base64
    for decoded, floats in zip(sdk_default.data, many.data, strict=True):
        assert decoded.embedding == pytest.approx(floats.embedding, abs=1e-7)


def test_base64_is_little_endian_float32(embed_server):
    import base64
    import struct

    _, _, data = embed_server.request("POST", "/v1/embeddings", {"input": "x", "encoding_format": "base64"})
    _, _, floats = embed_server.request("POST", "/v1/embeddings", {"input": "x"})
    raw = base64.b64decode(data["data"][0]["embedding"])
    assert list(struct.unpack("<32f", raw)) == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


def test_dimensions_where_the_model_allows(embed_server):
    client = embed_server.client()
    short = client.embeddings.create(model="tiny-bert", input="hello world", dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    assert sum(v * v for v in short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    status, error = _error(embed_server, {"input": "x", "dimensions": 64})
    assert status == 400 and error["param"] == "dimensions" and "from 1 to 32" in error["message"]


@pytest.mark.parametrize("body,param,needle", [
    ({"input": " ".join(["hello world"] * 20)}, "input", "more than tiny-bert's maximum of 24"),
    ({"input": ["x"] * 9}, "input", "more than the 8 one request may hold"),
    ({"input": ["hello world " * 6] * 8}, "input", "112 tokens, more than the 100"),
    ({"input": [[2, 3]] * 2 + [[2] * 99]}, "input", "103 tokens, more than the 100"),
    ({"input": []}, "input", "non-empty"),
    ({"input": ["x", [2, 3]]}, "input", "strings only, or lists of token ids only"),
    ({"input": ""}, "input", "empty string"),
    ({"input": [2, 10**6]}, "input", "outside the vocabulary"),
    ({}, "input", "input is required"),
    ({"input": "x", "encoding_format": "fp16"}, "encoding_format", "float, base64"),
    ({"input": "x", "pooling": "cls"}, "pooling", "unknown field 'pooling'"),
    ({"input": "x", "model": MODEL_NAME}, "model", "is a chat model, not an embedding model"),
], ids=["too-long", "too-many-inputs", "too-many-tokens", "too-many-ids", "empty-list", "mixed", "empty-string",
        "bad-id", "missing", "format", "unknown-field", "chat-model"])
def test_bad_requests_are_400s_naming_the_field(embed_server, body, param, needle):
    status, error = _error(embed_server, body)
    assert status == 400 and error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_truncate_cuts_what_would_be_refused(embed_server):
    client = embed_server.client()
    long_text = " ".join(["hello world"] * 20)
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="tiny-bert", input=long_text)
    assert raised.value.code == "context_length_exceeded"
    cut = client.embeddings.create(model="tiny-bert", input=long_text, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 24


def test_models_routing_and_the_chat_endpoints(embed_server):
    client = embed_server.client()
    assert {"tiny-bert", MODEL_NAME} <= {m.id for m in client.models.list()}
    assert client.models.retrieve("tiny-bert").id == "tiny-bert"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError, match="is an embedding model") as raised:
        client.chat.completions.create(model="tiny-bert", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.code == "model_not_supported"


def test_an_embedding_model_served_alone(encoder_dir):
    state = ServerState()
    state.embeddings.load(str(encoder_dir))
    state.embeddings.alone, state.status = True, READY
    server = LiveServer(state)
    try:
        client = server.client()
        assert len(client.embeddings.create(model="tiny-bert", input="hi", encoding_format="float").data) == 1
        with pytest.raises(openai.BadRequestError, match="'tiny-bert' is an embedding model"):
            client.chat.completions.create(model="tiny-bert", messages=[{"role": "user", "content": "hi"}])
        status, _, health = server.request("GET", "/health")
        assert status == 200 and health["model"] == "tiny-bert"
        status, _, data = server.request("POST", "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "is an embedding model" in data["error"]["message"]
    finally:
        server.close()
        state.embeddings.stop()


def test_concurrent_requests_are_batched(embed_server):
    batcher = embed_server.state.embeddings.get("tiny-bert")
    before = batcher.num_batches

    async def many():
        return await asyncio.gather(*(batcher.embed([text]) for text in SENTENCES * 5))

    results = embed_server.call(many())
    assert len(results) == 30 and batcher.num_batches - before < 30
