"""The encoder and its batcher on tiny random BERTs built in-process: vectors equal sentence-transformers' `encode`
for every pooling its config can say, long inputs are refused or cut, token ids are taken as given, Matryoshka
sizes, and concurrent requests share forwards."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_encoder import MAX_SEQ_LENGTH, SENTENCES, build_encoder_dir

from tfserve.embeddings.batcher import EncoderBatcher
from tfserve.embeddings.encoder import EmbeddingInputError, Encoder
from tfserve.embeddings.pooling import PoolingConfig, is_embedding_dir, read_pooling_config

POOLINGS = [(("mean",), True), (("cls",), False), (("max",), True), (("mean_sqrt_len",), False),
            (("cls", "mean"), True), (("lasttoken",), True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_encoder_dir(tmp_path_factory.mktemp("encoder"))


@pytest.fixture(scope="module")
def encoder(model_dir):
    return Encoder.from_pretrained(model_dir)


def _reference(path, texts):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    return torch.tensor(model.encode(texts, batch_size=4))


@pytest.mark.parametrize("modes,normalize", POOLINGS, ids=["+".join(m) + ("-norm" if n else "") for m, n in POOLINGS])
def test_vectors_equal_sentence_transformers(tmp_path, modes, normalize):
    from tfserve.engine.cpu_linear import PackedLinear
    from tfserve.engine.kernels import cpu_ops

    path = build_encoder_dir(tmp_path, modes=modes, normalize=normalize)
    encoder = Encoder.from_pretrained(path)
    # where the kernels are built, every linear layer multiplies on their float32 panels (1.5-2x torch at batch 1)
    linears = [m for m in encoder.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) == (cpu_ops() is not None) for m in linears)
    assert read_pooling_config(path) == PoolingConfig(modes=modes, normalize=normalize, max_seq_length=MAX_SEQ_LENGTH)
    ours = encoder.encode(encoder.tokenize(SENTENCES))
    reference = _reference(path, SENTENCES)
    assert ours.shape == reference.shape == (len(SENTENCES), 32 * len(modes))
    cosine = torch.nn.functional.cosine_similarity(ours, reference)
    assert (1 - cosine).max() < 1e-5 and torch.allclose(ours, reference, atol=1e-5)


def test_buckets_and_order_do_not_change_vectors(encoder):
    texts = SENTENCES * 3
    one_by_one = torch.cat([encoder.encode(encoder.tokenize([text])) for text in texts])
    encoder.max_batch_tokens = 24  # many small buckets, some of equal lengths (run without a mask)
    try:
        bucketed = encoder.encode(encoder.tokenize(texts))
    finally:
        encoder.max_batch_tokens = 16384
    assert torch.allclose(one_by_one, bucketed, atol=1e-5)


def test_a_long_input_is_refused_unless_truncated(encoder, model_dir):
    long_text = " ".join(["hello world"] * 40)
    with pytest.raises(EmbeddingInputError, match="is 82 tokens, more than .* maximum of 24") as raised:
        encoder.tokenize(["x", long_text])
    assert raised.value.param == "input" and raised.value.code == "context_length_exceeded"
    assert "input[1]" in str(raised.value)
    ids = encoder.tokenize([long_text], truncate=True)
    assert len(ids[0]) == MAX_SEQ_LENGTH and ids[0][-1] == encoder.tokenizer.sep_token_id  # cut as ST cuts
    assert torch.allclose(encoder.encode(ids), _reference(model_dir, [long_text]), atol=1e-5)


def test_token_ids_are_taken_as_given(encoder):
    ids = encoder.tokenize(["hello world"])
    assert torch.equal(encoder.encode(encoder.check_ids(ids)), encoder.encode(ids))
    with pytest.raises(EmbeddingInputError, match="outside the vocabulary"):
        encoder.check_ids([[2, encoder.vocab_size]])
    with pytest.raises(EmbeddingInputError, match="empty"):
        encoder.check_ids([[]])
    assert len(encoder.check_ids([[5] * 30], truncate=True)[0]) == MAX_SEQ_LENGTH


def test_dimensions_only_where_the_model_was_trained_for_them(encoder, tmp_path):
    assert encoder.check_dimensions(None) == encoder.check_dimensions(32) == 32
    with pytest.raises(EmbeddingInputError, match="no Matryoshka model") as raised:
        encoder.check_dimensions(16)
    assert raised.value.param == "dimensions"
    matryoshka = Encoder.from_pretrained(build_encoder_dir(tmp_path, matryoshka=(32, 16, 8)))
    assert matryoshka.check_dimensions(16) == 16
    with pytest.raises(EmbeddingInputError, match="from 1 to 32"):
        matryoshka.check_dimensions(64)
    ids = matryoshka.tokenize(SENTENCES)
    full, short = matryoshka.encode(ids), matryoshka.encode(ids, 16)
    assert short.shape == (len(SENTENCES), 16)
    assert torch.allclose(short, torch.nn.functional.normalize(full[:, :16], dim=1), atol=1e-6)
    assert torch.allclose(short.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_what_counts_as_an_embedding_model(model_dir, tmp_path):
    assert is_embedding_dir(model_dir)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    assert not is_embedding_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    assert is_embedding_dir(tmp_path)
    (tmp_path / "modules.json").write_text('[{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]')
    with pytest.raises(ValueError, match="Dense are not supported"):
        read_pooling_config(tmp_path)


def test_concurrent_requests_share_forwards(encoder):
    batcher = EncoderBatcher(encoder, max_batch_inputs=64, batch_wait_ms=50).start()

    async def many():
        return await asyncio.gather(*(batcher.embed([text]) for text in SENTENCES * 4))

    try:
        results = asyncio.run(many())
    finally:
        batcher.stop()
    alone = encoder.encode(encoder.tokenize(SENTENCES * 4))
    assert torch.allclose(torch.cat([r.vectors for r in results]), alone, atol=1e-5)
    assert [r.num_tokens for r in results] == [len(ids) for ids in encoder.tokenize(SENTENCES * 4)]
    assert batcher.num_batches < len(results) / 2  # requests were batched, not run one by one


def test_the_batcher_checks_limits_before_the_forward(encoder):
    batcher = EncoderBatcher(encoder).start()
    try:
        with pytest.raises(EmbeddingInputError, match="more than the 5 one request may hold") as raised:
            asyncio.run(batcher.embed(["hello world", "hello world"], max_tokens=5))
        assert raised.value.code == "too_many_tokens" and batcher.num_batches == 0
        result = asyncio.run(batcher.embed([[2, 10, 27, 3]]))
        assert result.num_tokens == 4 and result.vectors.shape == (1, 32)
    finally:
        batcher.stop()
