"""Paged attention over the block cache, registered with `transformers.AttentionInterface`.

The runner packs every scheduled sequence's new tokens into one row (`[1, num_tokens]`, no padding),
sets an `AttentionMetadata` for the step and calls the model. Each attention layer then:
1. writes the step's new keys and values into their cache slots (`slot_mapping`), then
2. attends, per group. There are at most two groups: decodes (one query each) and prefills (several
   queries each). With the CPU kernels each group is one kernel call that reads keys in place through the
   block tables: decodes through the decode kernel, prompt rows through tiles that share each key's loads
   among a sequence's rows and compute every row in the decode kernel's arithmetic (a prompt's rows each the
   same bits as the decode at that position), so no row depends on the rest of the step, its chunk or a
   cached prefix. Without them (or for Gemma 3's image
   tokens, which attend both ways) each group is one batched `scaled_dot_product_attention` over keys
   gathered from the cache, prefills padded to the longest. No Python loop over sequences.
Grouped-query attention folds the query heads sharing a KV head into the query-length axis, so keys and
values are never repeated.

A model loaded with `attn_implementation="flash_attention_2"` attends through flash-attn instead (CUDA,
float16/bfloat16): the same cache writes, then one `flash_attn_varlen_func` call per layer over each
sequence's keys gathered from the cache (`FlashLayout`, built once per step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "tfserve_paged"
FLASH_ATTN_IMPLEMENTATION = "flash_attention_2"  # a model loaded with it attends through flash-attn


@dataclass(slots=True)
class AttentionGroup:
    """Sequences of one step that attend the same way: either all decodes or all prefills."""

    start: int  # first packed token of the group
    end: int  # one past its last
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with block 0
    query_positions: torch.Tensor  # [num_seqs, max_q] int64 absolute positions, padded rows repeat the last
    key_lens: torch.Tensor  # [num_seqs] tokens each sequence attends to (its context after this step)
    pad_index: torch.Tensor | None  # [num_seqs, max_q] -> packed token (within the group); None for decodes
    unpad_index: torch.Tensor | None  # [group tokens] -> row of the flattened [num_seqs * max_q]
    masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)  # by (window, repeat)
    # per sequence, runs [start, end) of image tokens that attend to each other both ways (Gemma 3), or None
    image_runs: list[list[tuple[int, int]]] | None = None
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # see query_rows
    lens: torch.Tensor | None = None  # see query_lens

    def query_rows(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(table_rows, key_lens), one per packed query: the block table each query reads (None: its own row,
        as decodes do) and how many keys it attends to (causal: its position + 1)."""
        if self.pad_index is None:
            return None, self.key_lens
        if self.rows is None:
            self.rows = (torch.div(self.unpad_index, self.max_q, rounding_mode="floor"),
                         self.query_positions.reshape(-1).index_select(0, self.unpad_index) + 1)
        return self.rows

    def query_lens(self) -> torch.Tensor:
        """[num_seqs] int64: each sequence's new tokens (queries) this step."""
        if self.lens is None:
            self.lens = self.key_lens - self.query_positions[:, 0]
        return self.lens

    @classmethod
    def prefills(cls, chunks: list[tuple[int, int]], tables: list[list[int]], token_start: int = 0, device=None,
                 image_runs: list[list[tuple[int, int]]] | None = None) -> AttentionGroup:
        """The group of prefill `chunks`, (first position, new tokens) each, over their sequences' block ids
        `tables`, whose tokens start at packed index `token_start` (after the decode rows)."""
        max_q, max_blocks = max(n for _, n in chunks), max(map(len, tables))
        positions, pad_index, unpad_index, offset = [], [], [], 0
        for row, (start, n) in enumerate(chunks):
            positions.append([start + min(i, n - 1) for i in range(max_q)])
            pad_index.append([offset + min(i, n - 1) for i in range(max_q)])
            unpad_index.extend(range(row * max_q, row * max_q + n))
            offset += n
        return cls(
            image_runs=image_runs, start=token_start, end=token_start + offset,
            block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long,
                                      device=device),
            query_positions=torch.tensor(positions, dtype=torch.long, device=device),
            key_lens=torch.tensor([start + n for start, n in chunks], dtype=torch.long, device=device),
            pad_index=torch.tensor(pad_index, dtype=torch.long, device=device),
            unpad_index=torch.tensor(unpad_index, dtype=torch.long, device=device),
        )

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_q(self) -> int:
        return self.query_positions.shape[1]

    def mask(self, sliding_window: int | None, block_size: int, dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
        """[num_seqs, 1, repeat * max_q, num_keys] additive mask (0 or -inf): causal, within the sequence,
        within the window. Built once per step and shared by every layer (SDPA would convert a bool mask
        in every call)."""
        mask = self.masks.get((sliding_window, repeat))
        if mask is None:
            num_keys = self.block_tables.shape[1] * block_size
            key_pos = torch.arange(num_keys, device=self.key_lens.device)
            q_pos = self.query_positions[:, :, None]  # [num_seqs, max_q, 1]
            mask = key_pos <= q_pos
            if sliding_window is not None:
                mask &= key_pos > q_pos - sliding_window
            for row, runs in enumerate(self.image_runs or ()):
                for start, end in runs:  # an image's tokens see each other, whatever their order
                    mask[row] |= ((q_pos[row] >= start) & (q_pos[row] < end)) & ((key_pos >= start) & (key_pos < end))
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))[:, None]
            if repeat > 1:
                mask = mask.repeat(1, 1, repeat, 1)
            self.masks[(sliding_window, repeat)] = mask
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    groups: list[AttentionGroup]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]
    block_size: int
    cpu_ops: object = None  # the compiled CPU kernels (see kernels.py), or None
    flash: bool = False  # attend with flash-attn (see FlashLayout) instead of SDPA per group
    flash_layout: FlashLayout | None = None  # made by the first layer of the step, shared by the others
    num_decode_tokens: int = 0  # the step's first tokens that are decodes (proposals checked included)
    # prompt rows through the CPU's bfloat16 dot products (the kernels' `dot`: bfloat16 q, k, v and probabilities,
    # float32 sums): the backend's choice for bfloat16 weights, whose layers already take bfloat16 inputs
    prompt_dot: bool = False


@dataclass(slots=True)
class FlashLayout:
    """One step's sequences in flash-attn's varlen layout: queries as packed, keys gathered from the cache."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: where each sequence's queries start
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: where each sequence's keys start
    max_seqlen_q: int
    max_seqlen_k: int
    key_slots: torch.Tensor  # [total_keys] int64: the cache slot of each gathered key, sequence by sequence

    @classmethod
    def for_groups(cls, groups: list[AttentionGroup], block_size: int) -> FlashLayout:
        q_lens, k_lens, slots = [], [], []
        for group in groups:
            key_lens = group.key_lens
            q_lens.append(key_lens - group.query_positions[:, 0])  # new tokens: context after - before
            k_lens.append(key_lens)
            offsets = torch.arange(block_size, device=key_lens.device)
            group_slots = (group.block_tables[:, :, None] * block_size + offsets).flatten(1)  # [num_seqs, num_keys]
            keep = torch.arange(group_slots.shape[1], device=key_lens.device) < key_lens[:, None]
            slots.append(group_slots[keep])  # row-major: each sequence's keys in order
        q_len, k_len = torch.cat(q_lens), torch.cat(k_lens)
        zero = q_len.new_zeros(1)
        return cls(cu_seqlens_q=torch.cat([zero, q_len.cumsum(0)]).to(torch.int32),
                   cu_seqlens_k=torch.cat([zero, k_len.cumsum(0)]).to(torch.int32),
                   max_seqlen_q=int(q_len.max()), max_seqlen_k=int(k_len.max()), key_slots=torch.cat(slots))


_metadata: AttentionMetadata | None = None


def set_metadata(metadata: AttentionMetadata | None) -> None:
    global _metadata
    _metadata = metadata


def get_metadata() -> AttentionMetadata | None:
    return _metadata


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if torch.compiler.is_compiling():  # one opaque op in the compiled graph; it reads the step's metadata when run
        return torch.ops.tfserve.paged_attention(query, key, value, module.layer_idx, scaling or 0.0,
                                                 sliding_window or 0, softcap or 0.0), None
    meta = _metadata
    if meta is None:  # the model used outside an engine step (e.g. `model.generate`): plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if softcap is not None:
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

            return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, softcap=softcap, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    return _paged_attention(meta, module.layer_idx, query, key, value, scaling, sliding_window, softcap), None


@torch.library.custom_op("tfserve::paged_attention", mutates_args=())
def _compiled_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                              scaling: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """`paged_attention_forward` as torch.compile sees it (0 stands for None): the step's metadata and the
    layer's cache are read when it runs, so one compiled graph serves every step. (It writes the cache, which is
    not an argument: the graph keeps it because its output is used, in layer order because each layer's query
    depends on the one before.)"""
    return _paged_attention(_metadata, layer_idx, query, key, value, scaling or None, sliding_window or None,
                            softcap or None)


@_compiled_paged_attention.register_fake
def _(query, key, value, layer_idx, scaling, sliding_window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _paged_attention(meta: AttentionMetadata, layer_idx: int, query, key, value, scaling, sliding_window,
                     softcap) -> torch.Tensor:
    """Write the step's keys and values into layer `layer_idx`'s cache, then attend: [1, num_tokens, num_heads,
    head_dim]."""
    k_cache, v_cache = meta.kv_caches[layer_idx]
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [num_tokens, num_kv_heads, head_dim]
    if meta.cpu_ops is not None:
        meta.cpu_ops.write_kv_(new_keys.contiguous(), new_values.contiguous(), k_cache, v_cache, meta.slot_mapping)
    else:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_keys.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, new_values.to(v_cache.dtype))

    if meta.flash:
        return _flash_attention(query, k_cache, v_cache, meta, scaling, sliding_window, softcap)
    group_size = num_heads // num_kv_heads
    outs = []
    for group in meta.groups:  # at most two: decodes, prefills
        q = query[0, :, group.start : group.end]  # [num_heads, group_tokens, head_dim]
        if meta.cpu_ops is not None and (group.pad_index is None or _rows_apply(meta.cpu_ops, query, k_cache, group)):
            scale = head_dim**-0.5 if scaling is None else scaling
            if group.pad_index is not None and not sliding_window and not softcap:  # prompt rows: the tiles
                outs.append(meta.cpu_ops.paged_prompt_attention(q.transpose(0, 1).contiguous(), k_cache, v_cache,
                                                                group.block_tables, group.key_lens,
                                                                group.query_lens(), scale, dot=meta.prompt_dot))
            else:
                outs.append(_row_attention(meta.cpu_ops, q.transpose(0, 1).contiguous(), k_cache, v_cache, group,
                                           scale, sliding_window or -1, softcap or 0.0))
        else:
            outs.append(_group_attention(q, k_cache, v_cache, group, group_size, scaling, sliding_window,
                                         meta.block_size, softcap))
    if len(outs) == 1 and outs[0].shape[0] == num_tokens:  # one group: its rows are the step's
        return outs[0].unsqueeze(0)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    for group, rows in zip(meta.groups, outs):
        out[group.start : group.end] = rows
    return out.unsqueeze(0)


def _rows_apply(ops, query: torch.Tensor, k_cache: torch.Tensor, group: AttentionGroup) -> bool:
    """Prompt rows go through the kernels where the decode kernel's vector path runs (float32 queries over a
    float32 or bfloat16 cache, a head of 1, 2, 4, 8 or 16 vectors): the prompt tiles, or the decode kernel row by
    row in layers with a sliding window or a cap on the scores (which the tiles do not take); elsewhere (16-bit
    models, other head sizes, Gemma 3's image tokens that attend both ways) through SDPA."""
    return (group.image_runs is None and query.dtype == torch.float32
            and k_cache.dtype in (torch.float32, torch.bfloat16) and vector_head(ops, query.shape[-1]))


def vector_head(ops, head_dim: int) -> bool:
    """A head the kernels' vector paths take: 1, 2, 4, 8 or 16 vectors of `ops.vec_width` floats."""
    vectors, rest = divmod(head_dim, ops.vec_width)
    return not rest and vectors in (1, 2, 4, 8, 16)


# Bytes of partial results (softmax sums and weighted values per partition of 128 keys and query head) one
# kernel call may hold: a long prompt's rows go in several calls.
ROW_ATTENTION_BYTES = 32 << 20


def _row_attention(ops, q: torch.Tensor, k_cache, v_cache, group: AttentionGroup, scale: float, window: int,
                   softcap: float) -> torch.Tensor:
    """q [group_tokens, num_heads, head_dim] through the decode kernel, every query on its own over its keys:
    a row's result depends on its own query and keys alone, not on the other rows of the step, its prompt's
    length, the chunk it came in or a cached prefix (SDPA's CPU kernel tiles by the padded shapes, so its rows
    differ in the last bits with them). Decodes, and prompt rows in layers the prompt tiles do not take."""
    table_rows, key_lens = group.query_rows()
    if table_rows is None:  # decodes: one row per sequence, partials bounded by the batch
        return ops.paged_decode_attention(q, k_cache, v_cache, group.block_tables, key_lens, scale, window, softcap)
    num_heads, head_dim = q.shape[1], q.shape[2]
    max_parts = max(1, ROW_ATTENTION_BYTES // (4 * num_heads * (head_dim + 2)))
    parts = torch.div(key_lens - 1, 128, rounding_mode="floor") + 1  # the kernel's partitions per row, at most
    if int(parts.sum()) <= max_parts:
        return ops.paged_decode_attention(q, k_cache, v_cache, group.block_tables, key_lens, scale, window,
                                          softcap, table_rows=table_rows)
    out = torch.empty_like(q)
    ends = torch.searchsorted(parts.cumsum(0), torch.arange(max_parts, int(parts.sum()), max_parts), right=True)
    bounds = [0, *sorted({max(1, int(e)) for e in ends.tolist()}), q.shape[0]]
    for a, b in zip(bounds, bounds[1:]):
        if a < b:
            out[a:b] = ops.paged_decode_attention(q[a:b], k_cache, v_cache, group.block_tables, key_lens[a:b],
                                                  scale, window, softcap, table_rows=table_rows[a:b])
    return out


def _flash_attention(query, k_cache, v_cache, meta: AttentionMetadata, scaling, sliding_window,
                     softcap) -> torch.Tensor:
    """[1, num_tokens, num_heads, head_dim]: every sequence of the step in one flash-attn varlen call."""
    if meta.flash_layout is None:
        meta.flash_layout = FlashLayout.for_groups(meta.groups, meta.block_size)
    layout = meta.flash_layout
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, layout.key_slots)  # [total_keys, kv_heads, dim]
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, layout.key_slots)
    # causal is aligned to the end of each sequence's keys; a window of w keys is (w - 1) before the query
    out = flash_attn_varlen_func()(
        query[0].transpose(0, 1).contiguous(), k, v, layout.cu_seqlens_q, layout.cu_seqlens_k,
        layout.max_seqlen_q, layout.max_seqlen_k, softmax_scale=scaling, causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1), softcap=softcap or 0.0)
    return out.unsqueeze(0)


def flash_attn_varlen_func():
    """flash-attn's varlen kernel (imported when first used; tests put a torch reference in its place)."""
    from flash_attn import flash_attn_varlen_func as kernel

    return kernel


def _group_attention(q, k_cache, v_cache, group: AttentionGroup, group_size: int, scaling, sliding_window,
                     block_size: int, softcap: float | None = None) -> torch.Tensor:
    num_heads, _, head_dim = q.shape
    num_kv_heads = num_heads // group_size
    num_seqs, max_q = group.num_seqs, group.max_q
    flat_tables = group.block_tables.reshape(-1)
    # [num_seqs, num_kv_heads, num_keys, head_dim]
    # (a bfloat16 cache under float32 queries: its values widened, exactly)
    k = k_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    v = v_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)

    if group.pad_index is None:  # decodes: one query each
        # [num_seqs, num_kv_heads, group_size, head_dim]: query heads of a KV head act as its queries
        q = q.transpose(0, 1).reshape(num_seqs, num_kv_heads, group_size, head_dim)
        mask = group.mask(sliding_window, block_size, q.dtype)  # [num_seqs, 1, 1, num_keys], broadcast over heads
        o = _attend(q, k, v, mask, scaling, softcap)
        return o.reshape(num_seqs, num_heads, head_dim)

    q = q[:, group.pad_index]  # [num_heads, num_seqs, max_q, head_dim]
    q = q.transpose(0, 1).reshape(num_seqs, num_kv_heads, group_size * max_q, head_dim)
    mask = group.mask(sliding_window, block_size, q.dtype, group_size)  # [num_seqs, 1, group_size * max_q, num_keys]
    o = _attend(q, k, v, mask, scaling, softcap)
    # [num_seqs, num_kv_heads, group_size, max_q, head_dim] -> [num_seqs * max_q, num_heads, head_dim]
    o = o.reshape(num_seqs, num_heads, max_q, head_dim).transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return o.index_select(0, group.unpad_index)


def sdpa_backends(device: torch.device):
    """SDPA without cuDNN's attention on a GPU: cuDNN builds a plan for every new shape (6-80 ms each, measured
    on an H100), and a server's steps read a new number of keys every few tokens; flash and memory-efficient
    attention just run. Elsewhere, as it is."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _attend(q, k, v, mask, scaling, softcap):
    if softcap is None:
        with sdpa_backends(q.device):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    # Logit soft-capping (Gemma 2) has no SDPA kernel: scores, cap, mask, softmax by hand.
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def register() -> None:
    """Make `tfserve_paged` a valid `attn_implementation` for every transformers model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
