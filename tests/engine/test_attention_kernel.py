"""The compiled CPU decode kernel agrees with the pure-torch paged attention path."""

import pytest
from kernel_builds import kernel_build

torch = pytest.importorskip("torch")

from tfserve.engine.attention import AttentionGroup, _group_attention  # noqa: E402


@pytest.fixture(scope="module", params=["native", pytest.param("x86-64", marks=pytest.mark.slow),
                                        pytest.param("x86-64-v3", marks=pytest.mark.slow)])
def ops(request):
    """This CPU's build (its widest vector path), and on x86 the plain C++ one that CPUs without a vector
    path run (built for baseline x86-64) and, on an AVX-512 CPU, the AVX2 one."""
    return kernel_build(request.param)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (64, 16), (24, 4)])
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (5, None), (None, 30.0)])
def test_decode_kernel_matches_torch_path(ops, num_heads, num_kv_heads, head_dim, block_size, sliding_window,
                                         softcap):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_seqs = 40, 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    context_lens = [1, 3, 4, 9, 17] if block_size == 4 else [1, 16, 17, 40, 150]
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].tolist() for n in context_lens]
    max_blocks = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    group = AttentionGroup(
        start=0, end=num_seqs, block_tables=block_tables,
        query_positions=torch.tensor([[n - 1] for n in context_lens]),
        key_lens=torch.tensor(context_lens), pad_index=None, unpad_index=None,
    )
    q = torch.randn(num_heads, num_seqs, head_dim, generator=gen)  # [num_heads, tokens, head_dim] as in the model
    scale = head_dim**-0.5
    expected = _group_attention(q, k_cache, v_cache, group, num_heads // num_kv_heads, scale, sliding_window,
                                block_size, softcap)
    got = ops.paged_decode_attention(q.transpose(0, 1).contiguous(), k_cache, v_cache, block_tables,
                                     group.key_lens, scale, sliding_window or -1, softcap or 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 200])
def test_a_sequence_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count(ops, num_heads, num_kv_heads,
                                                                                 sliding_window):
    """The work is cut into (partition of a context, KV head) items shared among the threads, and a long
    context's partitions are merged at the end: the result is the torch path's, and bit for bit what the same
    sequence gets alone, in a batch, on one thread or two."""
    gen = torch.Generator().manual_seed(1)
    head_dim, block_size, num_blocks = 64, 16, 128
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    lens = [300, 5, 77, 160, 1000, 128, 129]  # 1000: 8 partitions; 128/129: one, and one more by one token
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].tolist() for n in lens]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    window = sliding_window or -1
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = ops.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(lens), scale, window, 0.0)
        for i, n in enumerate(lens):  # alone: fewer sequences than threads
            alone = ops.paged_decode_attention(q[i:i + 1].contiguous(), k_cache, v_cache, block_tables[i:i + 1],
                                               torch.tensor([n]), scale, window, 0.0)
            assert torch.equal(alone[0], batch[i]), n
        torch.set_num_threads(1)
        one_thread = ops.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(lens), scale,
                                                window, 0.0)
        assert torch.equal(one_thread, batch)
    finally:
        torch.set_num_threads(previous)
    group = AttentionGroup(start=0, end=len(lens), block_tables=block_tables,
                           query_positions=torch.tensor([[n - 1] for n in lens]), key_lens=torch.tensor(lens),
                           pad_index=None, unpad_index=None)
    expected = _group_attention(q.transpose(0, 1).contiguous(), k_cache, v_cache, group, num_heads // num_kv_heads,
                                scale, sliding_window, block_size, None)
    torch.testing.assert_close(batch, expected, rtol=1e-5, atol=1e-5)


def _assert_rows_are_decodes(ops, got, rows, k_cache, v_cache, chunks, tables, scale, window=-1):
    """Every packed prompt row of `got` is bit for bit what the decode kernel gives that position alone."""
    token = 0
    for row, (start, n) in enumerate(chunks):
        for i in range(n):
            alone = ops.paged_decode_attention(rows[token:token + 1], k_cache, v_cache, torch.tensor([tables[row]]),
                                               torch.tensor([start + i + 1]), scale, window, 0.0)
            assert torch.equal(got[token], alone[0]), (row, i)
            token += 1


@pytest.mark.parametrize("sliding_window", [None, 37])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_prompt_rows_attend_as_decodes_of_each_row(ops, monkeypatch, sliding_window, head_dim):
    """A prefill group through the kernel (one query per row, `table_rows` naming its sequence's table; the
    kernel takes a prompt's rows several at a time through each partition of its keys): the torch path's result
    within rounding, and every row bit for bit what a decode of that row alone gives, also when a long group is
    cut into several kernel calls."""
    from tfserve.engine import attention

    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 4, 120
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    chunks = [(0, 7), (130, 170), (3, 1), (0, 290)]  # (first position, new tokens): a cached prefix, one token
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-(s + n) // block_size)].tolist() for s, n in chunks]
    offset = sum(n for _, n in chunks)

    def group():
        return AttentionGroup.prefills(chunks, tables)

    q = torch.randn(num_heads, offset, head_dim, generator=gen)
    rows = q.transpose(0, 1).contiguous()
    scale = head_dim**-0.5
    expected = _group_attention(q, k_cache, v_cache, group(), num_heads // num_kv_heads, scale, sliding_window,
                                block_size)
    got = attention._row_attention(ops, rows, k_cache, v_cache, group(), scale, sliding_window or -1, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_rows_are_decodes(ops, got, rows, k_cache, v_cache, chunks, tables, scale, sliding_window or -1)
    monkeypatch.setattr(attention, "ROW_ATTENTION_BYTES", 4 * num_heads * (head_dim + 2) * 50)  # ~50 partitions
    calls = []
    counted = type("Counted", (), {"paged_decode_attention": lambda self, *a, **k: calls.append(1)
                                   or ops.paged_decode_attention(*a, **k)})()
    assert torch.equal(attention._row_attention(counted, rows, k_cache, v_cache, group(), scale,
                                                sliding_window or -1, 0.0), got)
    assert len(calls) > 3


def _prompt_case(gen, num_heads, num_kv_heads, head_dim, block_size, chunks, num_blocks=160):
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-(s + n) // block_size)].tolist() for s, n in chunks]
    q = torch.randn(num_heads, sum(n for _, n in chunks), head_dim, generator=gen)
    return k_cache, v_cache, tables, q


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (6, 2, 64, 16), (9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 128, 16), (4, 2, 32, 32), (2, 1, 256, 16)])
def test_prompt_tiles_give_each_row_the_decode_kernels_bits(ops, num_heads, num_kv_heads, head_dim, block_size):
    """Prompt rows through the tiles (a sequence's rows sharing each key's loads): the torch path's result
    within rounding, and every row bit for bit what the decode kernel gives that position alone: so a prompt's
    bits do not depend on how it was chunked, on the other sequences of its step or on a cached prefix, and a
    reply's rows computed as decodes are the rows a later prompt containing it computes."""
    if head_dim // ops.vec_width not in (1, 2, 4, 8, 16):
        pytest.skip(f"a head of {head_dim} is not 1-16 vectors of {ops.vec_width}: neither kernel's vector path")
    gen = torch.Generator().manual_seed(2)
    # (first position, new tokens): a cached prefix, one token, partitions' edges (128), a short tile
    chunks = [(0, 7), (130, 170), (3, 1), (0, 290), (128, 128), (0, 129), (250, 13)]
    k_cache, v_cache, tables, q = _prompt_case(gen, num_heads, num_kv_heads, head_dim, block_size, chunks)
    group = AttentionGroup.prefills(chunks, tables)
    rows = q.transpose(0, 1).contiguous()
    scale = head_dim**-0.5
    got = ops.paged_prompt_attention(rows, k_cache, v_cache, group.block_tables, group.key_lens, group.query_lens(),
                                     scale)
    expected = _group_attention(q, k_cache, v_cache, AttentionGroup.prefills(chunks, tables),
                                num_heads // num_kv_heads, scale, None, block_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_rows_are_decodes(ops, got, rows, k_cache, v_cache, chunks, tables, scale)
    # the 290-token prompt again in three chunks, each alone: the same bits
    first = sum(n for _, n in chunks[:3])
    for a, b in ((0, 100), (100, 101), (101, 290)):
        part = ops.paged_prompt_attention(rows[first + a:first + b], k_cache, v_cache, torch.tensor([tables[3]]),
                                          torch.tensor([b]), torch.tensor([b - a]), scale)
        assert torch.equal(part, got[first + a:first + b])


def test_prompt_tiles_over_a_long_context(ops):
    """Rows at the end of a 33,000-key context (258 partitions, more than the merge keeps on the stack): each
    the decode kernel's bits, and the torch path's result within rounding."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size = 2, 1, ops.vec_width, 64
    chunks = [(33_000 - 3, 3)]
    k_cache, v_cache, tables, q = _prompt_case(gen, num_heads, num_kv_heads, head_dim, block_size, chunks,
                                               num_blocks=520)
    group = AttentionGroup.prefills(chunks, tables)
    rows = q.transpose(0, 1).contiguous()
    got = ops.paged_prompt_attention(rows, k_cache, v_cache, group.block_tables, group.key_lens, group.query_lens(),
                                     0.25)
    _assert_rows_are_decodes(ops, got, rows, k_cache, v_cache, chunks, tables, 0.25)
    expected = _group_attention(q, k_cache, v_cache, group, num_heads // num_kv_heads, 0.25, None, block_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prompt_tiles_refuse_what_they_cannot_read(ops):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, q = _prompt_case(gen, 4, 2, 64, 16, [(0, 20)], num_blocks=8)
    rows = q.transpose(0, 1).contiguous()
    args = dict(block_tables=torch.tensor(tables), key_lens=torch.tensor([20]), q_lens=torch.tensor([20]), scale=0.1)
    with pytest.raises(RuntimeError, match="sum of q_lens"):
        ops.paged_prompt_attention(rows[:19], k_cache, v_cache, **args)
    with pytest.raises(RuntimeError, match="rows, keys and tables"):
        ops.paged_prompt_attention(rows, k_cache, v_cache, **{**args, "key_lens": torch.tensor([19])})
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prompt_attention(rows, k_cache, v_cache, **{**args, "block_tables": torch.tensor([[0, 99]])})
    odd = torch.randn(20, 4, 3 * ops.vec_width)  # three vectors a head: not a width the kernels take
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_prompt_attention(odd, torch.zeros(8, 16, 2, 3 * ops.vec_width), torch.zeros(8, 16, 2, 3 * ops.vec_width),
                                   **args)


def _bf16(t):
    return t.to(torch.bfloat16).float()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (4, 2, 80)])
def test_a_bfloat16_cache_reads_as_the_float32_cache_of_its_values(ops, num_heads, num_kv_heads, head_dim):
    """A bfloat16 KV cache (bfloat16 weights on the CPU kernels) gives decodes and prompt tiles, float32 and on the
    bfloat16 dot products, the very bits a float32 cache holding the same values does: its keys and values are
    widened exactly, nothing else changes; write_kv_ rounds float32 keys and values to the nearest (even)."""
    vectors, rest = divmod(head_dim, ops.vec_width)
    if rest or vectors not in (1, 2, 4, 8, 16):
        pytest.skip(f"a head of {head_dim} is not 1-16 vectors of {ops.vec_width}: no kernel path")
    gen = torch.Generator().manual_seed(7)
    chunks = [(0, 7), (130, 40), (3, 1), (0, 150)]
    k32, v32, tables, q = _prompt_case(gen, num_heads, num_kv_heads, head_dim, 16, chunks, num_blocks=48)
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    k32, v32 = k16.float(), v16.float()
    group = AttentionGroup.prefills(chunks, tables)
    rows = q.transpose(0, 1).contiguous()
    args = dict(block_tables=group.block_tables, key_lens=group.key_lens,
                q_lens=torch.tensor([n for _, n in chunks]), scale=head_dim**-0.5)
    for dot in (False, True) if ops.bf16_dot else (False,):
        assert torch.equal(ops.paged_prompt_attention(rows, k16, v16, **args, dot=dot),
                           ops.paged_prompt_attention(rows, k32, v32, **args, dot=dot)), dot
    decodes = torch.randn(len(chunks), num_heads, head_dim, generator=gen)
    for window, cap in ((-1, 0.0), (20, 0.0), (-1, 30.0)):
        got = ops.paged_decode_attention(decodes, k16, v16, group.block_tables, group.key_lens, 0.125, window, cap)
        assert torch.equal(got, ops.paged_decode_attention(decodes, k32, v32, group.block_tables, group.key_lens,
                                                           0.125, window, cap))
    new_k, new_v = torch.randn(3, num_kv_heads, head_dim, generator=gen), torch.randn(3, num_kv_heads, head_dim)
    slots = torch.tensor([0, 17, 300])
    ops.write_kv_(new_k, new_v, k16, v16, slots)
    assert torch.equal(k16.view(-1, num_kv_heads, head_dim)[slots], new_k.bfloat16())
    assert torch.equal(v16.view(-1, num_kv_heads, head_dim)[slots], new_v.bfloat16())
    with pytest.raises(RuntimeError, match="caches of another type"):  # q of another type than float32: refused
        ops.paged_decode_attention(decodes.double(), k16, v16, group.block_tables, group.key_lens, 0.125, -1, 0.0)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (6, 2, 64, 16), (4, 4, 16, 4), (8, 1, 128, 16), (4, 2, 32, 32), (2, 1, 256, 16), (4, 2, 80, 16)])
def test_prompt_tiles_on_bf16_dot_products_match_torch_over_bf16_inputs(ops, num_heads, num_kv_heads, head_dim,
                                                                         block_size):
    """`dot=True` (an engine with bfloat16 weights): q, keys and values rounded to bfloat16, float32 sums, the
    probabilities rounded to bfloat16 before they weigh the values. Against the torch path over the same
    bfloat16-rounded q, k and v in float32: within 1e-2 (the probabilities' rounding, 2^-9 relative, over values
    of about 1: measured 3e-3 at most here); each row the same bits alone, in a batch or cut into chunks."""
    if not ops.bf16_dot:
        pytest.skip("this build has no bfloat16 dot products (AVX512-BF16)")
    gen = torch.Generator().manual_seed(2)
    chunks = [(0, 7), (130, 170), (3, 1), (0, 290), (128, 128), (0, 129), (250, 13)]
    k_cache, v_cache, tables, q = _prompt_case(gen, num_heads, num_kv_heads, head_dim, block_size, chunks)
    group = AttentionGroup.prefills(chunks, tables)
    rows = q.transpose(0, 1).contiguous()
    scale = head_dim**-0.5
    got = ops.paged_prompt_attention(rows, k_cache, v_cache, group.block_tables, group.key_lens, group.query_lens(),
                                     scale, dot=True)
    expected = _group_attention(_bf16(q), _bf16(k_cache), _bf16(v_cache), AttentionGroup.prefills(chunks, tables),
                                num_heads // num_kv_heads, scale, None, block_size)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    first = sum(n for _, n in chunks[:3])  # the 290-token prompt again in three chunks, each alone: the same bits
    for a, b in ((0, 100), (100, 101), (101, 290)):
        part = ops.paged_prompt_attention(rows[first + a:first + b], k_cache, v_cache, torch.tensor([tables[3]]),
                                          torch.tensor([b]), torch.tensor([b - a]), scale, dot=True)
        assert torch.equal(part, got[first + a:first + b])


def test_prompt_tiles_on_bf16_dot_products_where_the_build_has_none(ops):
    """Builds without AVX512-BF16 (the AVX2 and plain C++ ones) refuse `dot=True` with a reason, not a wrong answer."""
    if ops.bf16_dot:
        pytest.skip("this build has the bfloat16 dot products")
    k_cache, v_cache, tables, q = _prompt_case(torch.Generator().manual_seed(3), 4, 2, 64, 16, [(0, 20)], num_blocks=8)
    with pytest.raises(RuntimeError, match="bf16_dot"):
        ops.paged_prompt_attention(q.transpose(0, 1).contiguous(), k_cache, v_cache, torch.tensor(tables),
                                   torch.tensor([20]), torch.tensor([20]), 0.1, dot=True)


@pytest.mark.parametrize("sliding_window,softcap,tiles", [(None, None, True), (37, None, False), (None, 30.0, False)])
def test_a_prefill_group_goes_through_the_tiles_where_they_apply(ops, sliding_window, softcap, tiles):
    """The attention layer sends a prefill group through the prompt tiles, and through the decode kernel row by
    row in layers with a sliding window or capped scores (which the tiles do not take): the torch path's result
    either way."""
    from tfserve.engine import attention

    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    chunks = [(0, 40), (20, 30)]
    k_cache, v_cache, tables, q = _prompt_case(gen, num_heads, num_kv_heads, head_dim, block_size, chunks)
    group = AttentionGroup.prefills(chunks, tables)
    keys = torch.randn(1, num_kv_heads, 70, head_dim, generator=gen)
    values = torch.randn(1, num_kv_heads, 70, head_dim, generator=gen)
    slots = torch.cat([torch.tensor([tables[i][t // block_size] * block_size + t % block_size
                                     for t in range(s, s + n)]) for i, (s, n) in enumerate(chunks)])
    calls = []

    class Counted:
        vec_width = ops.vec_width

        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    meta = attention.AttentionMetadata(slot_mapping=slots, groups=[group], kv_caches=[(k_cache, v_cache)],
                                       block_size=block_size, cpu_ops=Counted())
    got = attention._paged_attention(meta, 0, q[None], keys, values, head_dim**-0.5, sliding_window, softcap)[0]
    assert ("paged_prompt_attention" in calls) is tiles and ("paged_decode_attention" in calls) is not tiles
    expected = _group_attention(q, k_cache, v_cache, AttentionGroup.prefills(chunks, tables),
                                num_heads // num_kv_heads, head_dim**-0.5, sliding_window, block_size, softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _sdpa_full(q, k, v, t_len, heads, scale):
    """torch's attention without a mask, per window of t_len rows, q scaled first (as Whisper's encoder)."""
    windows, width = q.shape[0] // t_len, q.shape[1]
    split = [t.reshape(windows, t_len, heads, width // heads).transpose(1, 2) for t in (q * scale, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*split, scale=1.0)
    return out.transpose(1, 2).reshape(windows * t_len, width)


@pytest.mark.parametrize("windows,t_len,heads,head_dim", [(1, 1, 1, 64), (2, 37, 3, 64), (1, 150, 6, 64),
                                                         (3, 5, 2, 16), (1, 100, 4, 80), (2, 33, 2, 24)])
def test_full_attention_matches_sdpa_over_strided_rows(ops, windows, t_len, heads, head_dim):
    """Whisper's encoder attention: q, k and v are column ranges of one stacked projection (strided rows),
    each window attends only within itself, and the output is [rows, heads * head_dim]."""
    gen = torch.Generator().manual_seed(2)
    width = heads * head_dim
    qkv = torch.randn(windows * t_len, 3 * width, generator=gen) * 2
    q, k, v = qkv.chunk(3, dim=-1)
    got = ops.full_attention(q, k, v, t_len, heads, head_dim**-0.5)
    assert got.shape == (windows * t_len, width) and got.is_contiguous()
    torch.testing.assert_close(got, _sdpa_full(q, k, v, t_len, heads, head_dim**-0.5), rtol=1e-5, atol=1e-5)
    # a window's rows are the same bits computed alone
    alone = ops.full_attention(q[-t_len:], k[-t_len:], v[-t_len:], t_len, heads, head_dim**-0.5)
    assert torch.equal(got[-t_len:], alone)


def test_full_attention_refuses_what_it_cannot_read(ops):
    x = torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="whole number of windows"):
        ops.full_attention(x, x, x, 3, 2, 1.0)
    with pytest.raises(RuntimeError, match="heads"):
        ops.full_attention(x, x, x, 5, 3, 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.full_attention(x.double(), x.double(), x.double(), 5, 2, 1.0)
    with pytest.raises(RuntimeError, match="consecutive"):
        ops.full_attention(x.t(), x.t(), x.t(), 4, 2, 1.0)
