"""Batched Whisper forward over a fixed set of slots, for the transcriber.

Each slot holds one 30-second window being decoded: the cross-attention keys and values of its encoder output
(computed once, at `encode`) and the self-attention keys and values of the tokens decoded so far. Active
windows are kept dense in slots 0..n-1 (`move` fills a freed slot with the last one), so a step reads every
cache as a view, with no gather. The decoder is written over the weights of transformers'
`WhisperForConditionalGeneration` (its encoder is called as is): HF's own generate runs one batch to its end,
while here windows join and leave the batch at every step. A decoder step is bound by reading weights (the
51,864-row output projection above all), so with the engine's CPU kernels (`ops`) every decoder linear reads a
packed copy through them, as the chat engine's do: the same results, 3-4x faster than torch's GEMM at these
shapes, and in 16 bits where the checkpoint was (the store's Whisper models come from float16 files), which
halves the bytes a step reads and changes no result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tfserve.engine.attention import sdpa_backends
from tfserve.engine.backends.cuda_graphs import CudaGraph, batch_buckets
from tfserve.engine.cpu_linear import EngineLinear, can_pack

logger = logging.getLogger("tfserve.audio")

KEY_BUCKET = 64  # on a GPU, SDPA reads the self-attention's keys in multiples of this (masked past each row's own)


class WhisperSlots:
    """The encoder and a slot-batched decoder of one Whisper model, with the caches of `num_slots` windows."""

    def __init__(self, model, num_slots: int, ops=None, cuda_graphs: bool = True) -> None:
        config = model.config
        self.model = model
        self.decoder = model.model.decoder
        self.num_slots = num_slots
        self.num_heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.num_heads
        self.max_len = config.max_target_positions  # decoder positions: prompt + sampled tokens, 448
        self.num_frames = config.max_source_positions  # encoder positions of one window, 1500
        num_layers = len(self.decoder.layers)
        dtype, self.device = model.dtype, model.device
        # [layer, slot, head, position, head_dim]: every (slot, head) of a layer is one block of the engine's paged
        # layout [num_blocks, block_size, 1, head_dim], so its decode attention kernel reads a head's keys in a row
        self.self_k = torch.zeros(num_layers, num_slots, self.num_heads, self.max_len, self.head_dim, dtype=dtype,
                                  device=self.device)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(num_layers, num_slots, self.num_heads, self.num_frames, self.head_dim, dtype=dtype,
                                   device=self.device)
        self.cross_v = torch.zeros_like(self.cross_k)
        # every decoder linear, by the module it multiplies for: the kernels' packed copy, or F.linear without them
        # not the self-attention's q/k/v (self._qkv multiplies them) nor the cross-attention's k/v (run as modules,
        # once a window, by `encode`)
        elsewhere = {id(p) for layer in self.decoder.layers
                     for p in _projections(layer.self_attn) + (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)}
        linears = [model.proj_out] + [module for layer in self.decoder.layers for module in layer.modules()
                                      if isinstance(module, torch.nn.Linear) and id(module) not in elsewhere]
        # float32 on a CPU with the kernels, and small enough for a second copy of its linears (as the chat engine)
        self.kernels = can_pack(model, ops)
        packed = ops if self.kernels else None
        self._linears = {id(m): EngineLinear(m, packed, "float32") for m in linears}
        # each layer's q, k and v projections stacked: one multiply reads them (k has no bias: zeros there)
        self._qkv = [EngineLinear(_stacked(*_projections(layer.self_attn)), packed, "float32")
                     for layer in self.decoder.layers]
        # the encoder's linears through the kernels too (where they are: 2.2x torch's GEMM at its shapes), with
        # its attention (2.2x torch's CPU flash attention at 1500 frames; not in a build without a vector path,
        # where torch's is far faster), and each window's cross-attention keys and values stacked in one multiply;
        # else transformers' encoder as it is
        self._encoder_linears = self._cross_kv = self._encoder_attention = None
        if self.kernels:
            encoder = model.model.encoder
            self._encoder_linears = [
                (EngineLinear(_stacked(*_projections(layer.self_attn)), ops, "float32"),
                 *(EngineLinear(m, ops, "float32") for m in (layer.self_attn.out_proj, layer.fc1, layer.fc2)))
                for layer in encoder.layers]
            self._cross_kv = [EngineLinear(_stacked(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj), ops,
                                           "float32") for layer in self.decoder.layers]
            if ops.isa != "scalar":
                self._encoder_attention = ops.full_attention
        # the engine's paged decode attention over the caches (float32 only: its vector path), SDPA without it
        self._attention_ops = packed
        # SDPA reads keys in multiples of this: on a GPU a few shapes, not a new one each step (its attention plans
        # per shape); on a CPU exactly as many as the longest row reads (its time follows the keys read)
        self.key_bucket = 1 if self.device.type == "cpu" else KEY_BUCKET
        # on a GPU, steps of one new token per window replay CUDA graphs (`DecodeGraphs`), unless turned off
        self.graphs = None
        if self.device.type == "cuda" and cuda_graphs:
            self.graphs = DecodeGraphs(self).capture()
        if self.device.type == "cuda":  # the encoder once per batch size: the first pass of each picks its kernels
            with torch.inference_mode():  # (31 ms for a first batch of 8 windows on an H200, 4.7 ms after)
                for batch in range(1, num_slots + 1):
                    self._encoder(torch.zeros(batch, config.num_mel_bins, 2 * self.num_frames, dtype=dtype,
                                              device=self.device))

    def _linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`module(x)` through its engine copy, x: [..., in_features]."""
        out = self._linears[id(module)](x.reshape(-1, x.shape[-1]).contiguous())
        return out.view(*x.shape[:-1], out.shape[-1])

    def _tensor(self, data) -> torch.Tensor:
        """`data` (a list) as a tensor on the model's device."""
        return torch.tensor(data).to(self.device, non_blocking=True)

    @staticmethod
    def cache_bytes(config, num_slots: int, element_size: int = 4) -> int:
        """Bytes the caches of `num_slots` windows take for a model of `config`."""
        positions = config.max_target_positions + config.max_source_positions
        return 2 * config.decoder_layers * num_slots * positions * config.d_model * element_size

    @torch.inference_mode()
    def encode(self, slots: list[int], features: torch.Tensor) -> None:
        """Run the encoder on `features` [num_windows, num_mel_bins, 3000] and keep each window's cross-attention
        keys and values in its slot. On a CPU the windows go through one at a time: the encoder is compute-bound
        there, and a batch only adds activations that outgrow the caches (8 windows at once took 10-15% longer
        than one after another)."""
        group = 1 if self.device.type == "cpu" else len(slots)
        for first in range(0, len(slots), group):
            batch = features[first:first + group].to(self.device, self.model.dtype)
            hidden = self._encoder(batch)  # [group, 1500, d_model]
            index = self._tensor(slots[first:first + group])
            for i, layer in enumerate(self.decoder.layers):
                if self._cross_kv is None:
                    k, v = layer.encoder_attn.k_proj(hidden), layer.encoder_attn.v_proj(hidden)
                else:
                    k, v = self._cross_kv[i](hidden.view(-1, hidden.shape[-1])).chunk(2, dim=-1)
                self.cross_k[i, index] = self._heads(k, len(index))
                self.cross_v[i, index] = self._heads(v, len(index))

    def copy_encoding(self, src: int, dst: int) -> None:
        """Give slot `dst` slot `src`'s encoder output (another decode of the same window)."""
        for cache in (self.cross_k, self.cross_v):
            cache[:, dst] = cache[:, src]

    def _encoder(self, features: torch.Tensor) -> torch.Tensor:
        """The encoder over features [windows, num_mel_bins, 3000] -> [windows, 1500, d_model]. With the kernels,
        transformers' `WhisperEncoder` step for step (q scaled before the attention, as it does), its linear
        layers through packed copies: 1500 x 384 x 1536 in 4.0 ms against torch's 9.0 on the AVX-512 EPYC."""
        encoder = self.model.model.encoder
        if self._encoder_linears is None:
            with sdpa_backends(self.device):
                return encoder(features).last_hidden_state
        x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features)))).permute(0, 2, 1)
        x = x + encoder.embed_positions.weight[:x.shape[1]]
        windows, frames, width = x.shape
        hidden = x.reshape(windows * frames, width)
        for layer, (qkv, out_proj, fc1, fc2) in zip(encoder.layers, self._encoder_linears):
            attn = layer.self_attn
            q, k, v = qkv(layer.self_attn_layer_norm(hidden)).chunk(3, dim=-1)
            if self._encoder_attention is not None:  # q scaled inside, as below
                out = self._encoder_attention(q, k, v, frames, attn.num_heads, attn.scaling)
            else:
                heads = [t.reshape(windows, frames, attn.num_heads, -1).transpose(1, 2)
                         for t in (q * attn.scaling, k, v)]
                out = F.scaled_dot_product_attention(*heads, scale=1.0)
                out = out.transpose(1, 2).reshape(windows * frames, width)
            hidden = hidden + out_proj(out)
            hidden = hidden + fc2(layer.activation_fn(fc1(layer.final_layer_norm(hidden))))
        return encoder.layer_norm(hidden).view(windows, frames, width)

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src`'s caches into slot `dst` (keeping the active slots dense)."""
        for cache in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def decode(self, tokens: list[list[int]], starts: list[int],
               extra_positions: list[int] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One decoder step for slots 0..len(tokens)-1: slot b appends `tokens[b]` (one or more) at positions
        `starts[b]`... Returns the float32 logits after each slot's last new token [B, vocab], and, with
        `extra_positions`, the logits at that index of slot b's new tokens by b (-1: none), from the same multiply
        by the LM head (its one read of the head's weights). The logits are on the CPU, whatever the model's
        device."""
        batch, num_new = len(tokens), max(len(t) for t in tokens)
        if self.graphs is not None and num_new == 1:  # a row's one token may be the one whose logits are asked
            logits = self.graphs.run([row[0] for row in tokens], starts)
            if logits is not None:
                return logits, {b: logits[b].clone() for b, p in enumerate(extra_positions or []) if p >= 0}
        ids = self._tensor([t for row in tokens for t in row + [0] * (num_new - len(row))])  # [B*T]
        # padding tokens past a row's own write future positions, overwritten before anything attends to them
        positions = [[min(start + t, self.max_len - 1) for t in range(num_new)] for start in starts]
        flat = self._tensor(positions).view(-1)  # [B*T]
        # causal: the token at position p is written there and reads positions 0..p
        reads = self._reads(list(range(batch)), [[p + 1 for p in row] for row in positions], new_keys=True)
        cross = self._reads(list(range(batch)), [[self.num_frames] * num_new] * batch)
        hidden = self._layers(ids, flat, reads, cross).view(batch, num_new, -1)

        extra = [(b, p) for b, p in enumerate(extra_positions or []) if p >= 0]
        rows = list(range(batch)) + [b for b, _ in extra]
        at = [len(t) - 1 for t in tokens] + [p for _, p in extra]
        logits = self._linear(self.model.proj_out, hidden[self._tensor(rows), self._tensor(at)]).float().cpu()
        return logits[:batch], {b: logits[batch + i] for i, (b, _) in enumerate(extra)}

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, reads: _Reads, cross: _Reads) -> torch.Tensor:
        """The decoder over tokens `ids` at `positions` (each [rows]), writing their keys and values as `reads`
        says -> the final norm's output [rows, d_model]."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(ids) + decoder.embed_positions.weight[positions]  # [rows, d_model]
        for i, layer in enumerate(decoder.layers):
            q, k, v = self._qkv[i](layer.self_attn_layer_norm(hidden)).chunk(3, dim=-1)
            out = self._attend(q, self.self_k[i], self.self_v[i], reads, layer.self_attn.scaling, k, v)
            hidden = hidden + self._linear(layer.self_attn.out_proj, out)
            hidden = self._cross_and_mlp(i, layer, hidden, cross)
        return decoder.layer_norm(hidden)

    @torch.inference_mode()
    def alignment(self, slot: int, tokens: list[int], heads: list[tuple[int, int]]) -> torch.Tensor:
        """Cross-attention scores (scaled, before the softmax) of the (layer, head) pairs `heads` for the tokens
        `tokens` read in one pass over slot `slot`'s window: [len(heads), len(tokens), num_frames]. The slot's
        self-attention cache is left as it is."""
        decoder, num_tokens = self.decoder, len(tokens)
        hidden = decoder.embed_tokens(self._tensor(tokens)) + decoder.embed_positions.weight[:num_tokens]
        cross = self._reads([slot], [[self.num_frames] * num_tokens])
        scores = {}
        for i, layer in enumerate(decoder.layers):
            q, k, v = (self._heads(x, 1) for x in self._qkv[i](layer.self_attn_layer_norm(hidden)).chunk(3, dim=-1))
            with sdpa_backends(self.device):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.self_attn.scaling)
            hidden = hidden + self._linear(layer.self_attn.out_proj, self._merge(out))
            wanted = [head for (layer_index, head) in heads if layer_index == i]
            if wanted:
                attn = layer.encoder_attn
                q = self._heads(self._linear(attn.q_proj, layer.encoder_attn_layer_norm(hidden)), 1)
                qk = (q[0, wanted] @ self.cross_k[i, slot, wanted].transpose(-1, -2)) * attn.scaling  # [h, T, frames]
                scores.update({(i, h): qk[n] for n, h in enumerate(wanted)})
            hidden = self._cross_and_mlp(i, layer, hidden, cross)
        return torch.stack([scores[pair] for pair in heads]).float().cpu()

    def _cross_and_mlp(self, i: int, layer, hidden: torch.Tensor, cross: _Reads) -> torch.Tensor:
        """The cross-attention and feed-forward halves of decoder layer `i` over hidden [rows, d_model]."""
        attn = layer.encoder_attn
        q = self._linear(attn.q_proj, layer.encoder_attn_layer_norm(hidden))
        hidden = hidden + self._linear(attn.out_proj, self._attend(q, self.cross_k[i], self.cross_v[i], cross,
                                                                   attn.scaling))
        x = layer.final_layer_norm(hidden)
        return hidden + self._linear(layer.fc2, layer.activation_fn(self._linear(layer.fc1, x)))

    def _reads(self, slots: list[int], key_lens: list[list[int]], new_keys: bool = False) -> _Reads:
        """What rows (b, t) read: slot `slots[b]`'s first `key_lens[b][t]` positions of a layer's cache, the
        self-attention's with `new_keys` (written first at position key_lens[b][t] - 1), else the cross-attention's."""
        num_positions, heads = self.max_len if new_keys else self.num_frames, self.num_heads
        if self._attention_ops is None:  # SDPA over the slots' caches, masked where a row reads fewer keys
            lens = self._tensor(key_lens)  # [B, T]
            write = None
            if new_keys:
                block = self._tensor(slots)[:, None, None] * heads + torch.arange(heads, device=self.device)
                write = (block * num_positions + (lens - 1)[:, :, None]).view(-1)  # [(b, t, h)]
            # how many keys the step reads, decided here from the lists: no device sync in the layers
            fewest, most = min(min(row) for row in key_lens), max(max(row) for row in key_lens)
            most = min(-(-most // self.key_bucket) * self.key_bucket, num_positions)
            return _Reads(slots[0], len(slots), lens, write, None, most, fewest < most)
        # the kernel: every (row, token, head) a sequence of one head, whose one block is its slot's keys of that
        # head, in the (b, t, h) order of the rows of a [B*T, d_model] activation viewed as [B*T*H, head_dim]
        blocks = [slot * heads + head for slot, row in zip(slots, key_lens) for _ in row for head in range(heads)]
        lens = [length for row in key_lens for length in row for _ in range(heads)]
        write = self._tensor([b * num_positions + n - 1 for b, n in zip(blocks, lens)]) if new_keys else None
        return _Reads(slots[0], len(slots), self._tensor(lens), write, self._tensor(blocks)[:, None], 0, False)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, reads: _Reads, scale: float,
                k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [rows, d_model] over one layer's cache [slots, heads, positions, head_dim] as `reads`
        says, after writing the new keys and values k, v [rows, d_model] where given -> [rows, d_model]."""
        num_positions, head_dim = k_cache.shape[2], self.head_dim
        if self._attention_ops is not None:
            new = {}
            if k is not None:
                new = {"new_k": k.reshape(-1, 1, head_dim).contiguous(),
                       "new_v": v.reshape(-1, 1, head_dim).contiguous(), "slots": reads.write}
            out = self._attention_ops.paged_decode_attention(
                q.reshape(-1, 1, head_dim).contiguous(), k_cache.view(-1, num_positions, 1, head_dim),
                v_cache.view(-1, num_positions, 1, head_dim), reads.blocks, reads.key_lens, scale, -1, 0.0, **new)
            return out.view(q.shape)
        if k is not None:
            k_cache.view(-1, head_dim).index_copy_(0, reads.write, k.reshape(-1, head_dim))
            v_cache.view(-1, head_dim).index_copy_(0, reads.write, v.reshape(-1, head_dim))
        batch, num_keys, first = reads.num_slots, reads.num_keys, reads.first_slot
        keys, values = (cache[first:first + batch, :, :num_keys] for cache in (k_cache, v_cache))
        mask = None
        if reads.masked:  # [B, 1, T, K]
            mask = (torch.arange(num_keys, device=q.device)[None, None, :] < reads.key_lens[:, :, None])[:, None]
        with sdpa_backends(q.device):
            out = F.scaled_dot_product_attention(self._heads(q, batch), keys, values, attn_mask=mask, scale=scale)
        return self._merge(out)

    def _heads(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """[B*T, d_model] -> [B, heads, T, head_dim]"""
        return x.view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)

    @staticmethod
    def _merge(x: torch.Tensor) -> torch.Tensor:
        """[B, heads, T, head_dim] -> [B*T, d_model]"""
        return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], -1)


def _projections(attn) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]:
    return attn.q_proj, attn.k_proj, attn.v_proj


def _stacked(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One linear over the rows of `linears` (a missing bias, as Whisper's k projections have: zeros)."""
    weight = torch.cat([p.weight.detach() for p in linears])
    stacked = torch.nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    stacked.weight.data.copy_(weight)
    stacked.bias.data.copy_(torch.cat([p.bias.detach() if p.bias is not None else torch.zeros_like(p.weight[:, 0])
                                       for p in linears]))
    return stacked


class DecodeGraphs:
    """The decoder steps of one new token per window, captured as CUDA graphs: such a step of tiny.en issues ~110
    kernel launches from Python, 3.3 ms of host time (measured on an H200) for 0.4 ms of GPU work, so the windows'
    steps were bound by the host. One graph per bucket (windows B in 1, 2, 4, 8, ... up to the slots; keys K in
    multiples of KEY_BUCKET up to the decoder's positions), all captured with the slots (a few hundred ms at load)
    into one shared memory pool. A step of n windows reading at most k keys replays the smallest bucket with B >= n
    and K >= k: its inputs (each row's token and position) go to the graph's buffer in one copy; the B - n spare
    rows decode token 0 at the last position of the free slots n..B-1 (a window writes a position before it reads
    it) and their logits are dropped. A window's first step is one token too where its prompt is <|startoftranscript|>
    alone (an English-only model without previous text); longer prompts run eagerly."""

    def __init__(self, slots: WhisperSlots, graph=CudaGraph) -> None:
        self.slots = slots
        self.graph = graph  # tests on a CPU pass one that replays by running the step
        n = slots.num_slots
        self.batches = [b for b in batch_buckets(n) if b < n] + [n]
        self.key_buckets = [*range(KEY_BUCKET, slots.max_len, KEY_BUCKET), slots.max_len]
        self.inputs = torch.zeros(2 * n, dtype=torch.long, device=slots.device)  # tokens [n], then positions [n]
        self.staged = torch.zeros(2 * n, dtype=torch.long, pin_memory=slots.device.type == "cuda")
        self.logits = torch.empty(n, slots.model.proj_out.out_features, dtype=torch.float32, device=slots.device)
        self.graphs: dict[tuple[int, int], object] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> DecodeGraphs | None:
        """Capture every bucket; None (with one line saying why) if one cannot be: every step then runs eagerly."""
        try:
            pool = self.graph.pool()
            for batch in self.batches:
                for keys in self.key_buckets:
                    self.graphs[batch, keys] = self.graph(self._step(batch, keys), pool)
        except Exception as e:  # an op that cannot be captured: eager steps
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            logger.warning("Whisper decoder steps run eagerly: capturing a CUDA graph failed: %s", reason[:300])
            return None
        return self

    def _step(self, batch: int, keys: int):
        slots, n = self.slots, self.slots.num_slots
        tokens, positions = self.inputs[:batch], self.inputs[n:n + batch]
        self.inputs[:n], self.inputs[n:] = 0, slots.max_len - 1  # the warm-up and the capture: spare rows

        def step() -> None:
            heads = slots.num_heads
            key_lens = (positions + 1)[:, None]  # [B, 1]: row b reads through its own position
            block = torch.arange(batch, device=positions.device)[:, None] * heads + torch.arange(
                heads, device=positions.device)
            write = (block * slots.max_len + positions[:, None]).view(-1)  # [(b, h)]
            reads = _Reads(0, batch, key_lens, write, None, keys, True)
            cross = _Reads(0, batch, None, None, None, slots.num_frames, False)
            hidden = slots._layers(tokens, positions, reads, cross)
            self.logits[:batch].copy_(slots._linear(slots.model.proj_out, hidden))

        return step

    def run(self, tokens: list[int], positions: list[int]) -> torch.Tensor | None:
        """The float32 logits [n, vocab] on the CPU of windows 0..n-1 appending `tokens` at `positions`, or None
        where no bucket takes the step."""
        batch, keys = len(tokens), max(positions) + 1
        bucket = next((b for b in self.batches if b >= batch), None), next(
            (k for k in self.key_buckets if k >= keys), None)
        graph = self.graphs.get(bucket)
        if graph is None:
            return None
        n, host = self.slots.num_slots, self.staged.numpy()
        host[:n], host[n:] = 0, self.slots.max_len - 1  # spare rows: token 0 at the last position
        host[:batch], host[n:n + batch] = tokens, positions
        self.inputs.copy_(self.staged, non_blocking=True)
        graph.replay()
        self.num_replays += 1
        return self.logits[:batch].to("cpu", copy=True)  # waits for the replay: `staged` is free again


@dataclass(slots=True)
class _Reads:
    """What the rows of one step read in the caches of a layer (`WhisperSlots._reads`)."""

    first_slot: int  # row b reads slot first_slot + b (SDPA)
    num_slots: int
    key_lens: torch.Tensor | None  # keys each (b, t) reads: [B, T] (SDPA), or each (b, t, h) [B*T*H] (the kernel)
    write: torch.Tensor | None  # cache rows (of a [slots*heads*positions, head_dim] view) of the new keys, (b, t, h)
    blocks: torch.Tensor | None  # the kernel's block table: (b, t, h) -> slot * heads + h, [B*T*H, 1]
    num_keys: int  # keys read per row (SDPA): the most any row reads, rounded up to the slots' key_bucket (kernel: 0)
    masked: bool  # some row reads fewer than num_keys (SDPA; kernel: False)

