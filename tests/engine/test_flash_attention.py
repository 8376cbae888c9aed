"""The flash-attn path (a model loaded with attn_implementation="flash_attention_2") packs a step the way
flash-attn's varlen kernel wants it. flash-attn needs CUDA, so here a torch reference of that kernel stands in
for it: the path must agree with the paged SDPA path, token for token through the engine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tfserve.engine import attention  # noqa: E402
from tfserve.engine.attention import AttentionGroup, AttentionMetadata, paged_attention_forward  # noqa: E402


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0):
    """flash_attn_varlen_func's semantics in torch: causal aligned to the end of the keys, a left window of
    window_size[0] keys before the query, GQA by repeating KV heads."""
    assert causal and window_size[1] in (-1, 0)
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    for i in range(len(cu_seqlens_q) - 1):
        q_start, q_end, k_start, k_end = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i],
                                                           cu_seqlens_k[i + 1]))
        assert q_end - q_start <= max_seqlen_q and k_end - k_start <= max_seqlen_k
        qi = q[q_start:q_end].transpose(0, 1)  # [heads, q, dim]
        ki = k[k_start:k_end].repeat_interleave(repeat, dim=1).transpose(0, 1)
        vi = v[k_start:k_end].repeat_interleave(repeat, dim=1).transpose(0, 1)
        q_pos = torch.arange(q_end - q_start) + (k_end - k_start) - (q_end - q_start)
        k_pos = torch.arange(k_end - k_start)
        allowed = k_pos[None] <= q_pos[:, None]
        if window_size[0] >= 0:
            allowed &= k_pos[None] >= q_pos[:, None] - window_size[0]
        scores = qi @ ki.transpose(-1, -2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[q_start:q_end] = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vi).transpose(0, 1)
    return out


@pytest.fixture
def fake_flash(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_varlen_func", lambda: reference_varlen)


def _step(block_size: int, gen):
    """Two decodes and two prefill chunks over a shuffled block pool: (metadata pieces, num_tokens)."""
    decode_lens, prefill = [5, 12], [(0, 7), (9, 4)]  # decode: context after the step; prefill: (start, new)
    tables, num_blocks = [], 32
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for total in [*decode_lens, *(s + n for s, n in prefill)]:
        count = -(-total // block_size)
        tables.append(order[:count])
        order = order[count:]

    def padded(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])

    decodes = AttentionGroup(start=0, end=2, block_tables=padded(tables[:2]),
                             query_positions=torch.tensor([[n - 1] for n in decode_lens]),
                             key_lens=torch.tensor(decode_lens), pad_index=None, unpad_index=None)
    prefills = AttentionGroup.prefills(prefill, tables[2:], token_start=2)
    offset = prefills.end - 2
    slots = []
    for table, lens in zip(tables, [(n - 1, n) for n in decode_lens] + [(s, s + n) for s, n in prefill]):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(*lens)]
    return [decodes, prefills], torch.tensor(slots), num_blocks, 2 + offset


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (3, None), (None, 20.0)])
def test_flash_path_matches_paged_sdpa(fake_flash, sliding_window, softcap):
    gen = torch.Generator().manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    groups, slots, num_blocks, num_tokens = _step(block_size, gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(1, num_heads, num_tokens, head_dim, generator=gen)
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)
    value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen)
    module = torch.nn.Module()
    module.layer_idx = 0
    outputs = []
    for flash in (False, True):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        attention.set_metadata(AttentionMetadata(slot_mapping=slots, groups=groups, kv_caches=[(k_cache, v_cache)],
                                                 block_size=block_size, flash=flash))
        try:
            out, _ = paged_attention_forward(module, query, key, value, None, scaling=0.3,
                                             sliding_window=sliding_window, softcap=softcap)
        finally:
            attention.set_metadata(None)
        outputs.append(out)
    assert outputs[1].shape == outputs[0].shape == (1, num_tokens, num_heads, head_dim)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_a_model_loaded_for_flash_attention_runs_the_flash_path(fake_flash, make_engine, llama, tokenizer,
                                                                monkeypatch):
    from tfserve import SamplingParams

    # the model's own forward: the lean forward's fused CPU decode would bypass attention here
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello world", "the quick brown fox jumps over the lazy dog"]
    expected = [o.generated_tokens for o in make_engine(forward_backend="hf").generate_batch(prompts, params).values()]
    monkeypatch.setattr(llama.config, "_attn_implementation", "flash_attention_2")
    engine = make_engine(forward_backend="hf")
    assert engine.runner.flash_attention
    assert [o.generated_tokens for o in engine.generate_batch(prompts, params).values()] == expected
