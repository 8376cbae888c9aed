"""A tiny random-weight BERT sentence-embedding model written to a folder, with a WordPiece tokenizer and the
sentence-transformers files (modules.json, 1_Pooling/config.json, ...) that say how it pools: what the encoder
tests load, and sentence-transformers too, for reference vectors."""

from __future__ import annotations

import json
from pathlib import Path

SENTENCES = ["hello world", "the quick brown fox jumps over the lazy dog", "a tiny model embeds many requests",
             "héllo wörld 日本語", "x", "what is the weather in paris today?"]
MAX_SEQ_LENGTH = 24


def build_encoder_dir(path: Path, modes: tuple[str, ...] = ("mean",), normalize: bool = True,
                      matryoshka: tuple[int, ...] = (), seed: int = 0) -> Path:
    """Write the model folder at `path` and return it: 2 layers, 32 wide, sdpa-ready, inputs up to
    MAX_SEQ_LENGTH tokens (sentence_bert_config.json)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for s in SENTENCES for w in s.lower().split()})
    chars = sorted({c for s in SENTENCES for c in s.lower() if not c.isspace()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *chars, *[f"##{c}" for c in chars]]
    vocab = list(dict.fromkeys(vocab))
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, model_max_length=64)
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    BertModel(config).eval().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 32, **{f"pooling_mode_{m}_token{'s' if m != 'cls' else ''}": m in modes
                                                  for m in ("cls", "mean", "max", "mean_sqrt_len")}}
    pooling["pooling_mode_lasttoken"] = "lasttoken" in modes
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                                "do_lower_case": False}))
    st_config = {"matryoshka_dimensions": list(matryoshka)} if matryoshka else {}
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return path
