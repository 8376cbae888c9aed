"""A tiny llama GGUF file written in-process with the `gguf` package: a byte-level BPE tokenizer trained here,
random weights (float32, the token embedding in Q8_0 blocks) and a chat template, small enough to load in a
second. For the tests of what reads GGUF files (`models info`, the loader, a cut file)."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 32, 2, 4, 2, 64, 256


def write_tiny_gguf(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Write the file at `path` (its folder made) and return it."""
    import gguf
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(bpe.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def weight(*shape: int):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    kv = HIDDEN // HEADS * KV_HEADS
    embedding = weight(len(tokens), HIDDEN)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (kv, HIDDEN)), ("attn_v", (kv, HIDDEN)),
                            ("attn_output", (HIDDEN, HIDDEN)), ("ffn_gate", (FFN, HIDDEN)),
                            ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
