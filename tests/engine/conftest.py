"""A tiny random-weight llama and a byte-level BPE tokenizer trained in-process, for engine tests.

Imports torch and transformers lazily so that the model-free tests in this folder stay instant.
"""

from __future__ import annotations

import pytest
from tiny import one_torch_thread as _one_torch_thread  # noqa: F401  (an autouse fixture)

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that served many requests at once.",
    "héllo wörld 日本語 🎉 and more text, stop here. The end!",
] * 5


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_llama(vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # tests opt into EOS explicitly
    return model


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def _shared_llama(tokenizer):
    return build_llama(len(tokenizer))


@pytest.fixture
def llama(_shared_llama, monkeypatch):
    """The shared tiny llama; changes a test makes to its generation config are undone after it."""
    monkeypatch.setattr(_shared_llama.generation_config, "eos_token_id", None)
    return _shared_llama


@pytest.fixture
def make_engine(llama, tokenizer):
    """Build an Engine over the tiny llama with small defaults (a small explicit KV pool)."""
    from tfserve import Engine

    def make(*, with_tokenizer: bool = True, **kwargs):
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("num_blocks", 128)
        kwargs.setdefault("max_num_seqs", 8)
        return Engine(llama, tokenizer if with_tokenizer else None, **kwargs)

    return make
