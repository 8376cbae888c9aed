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

import torch
import torch.nn.functional as F

from tfserve.engine.cpu_linear import EngineLinear


class WhisperSlots:
    """The encoder and a slot-batched decoder of one Whisper model, with the caches of `num_slots` windows."""

    def __init__(self, model, num_slots: int, ops=None) -> None:
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
        linears = [model.proj_out] + [module for layer in self.decoder.layers for module in layer.modules()
                                      if isinstance(module, torch.nn.Linear)]
        weights = "float32" if ops is not None and dtype == torch.float32 and self.device.type == "cpu" else "torch"
        self._linears = {id(m): EngineLinear(m, ops if weights != "torch" else None, "float32") for m in linears}
        self.kernels = weights != "torch"
        # the engine's paged decode attention over the caches (float32 only: its vector path), SDPA without it
        self._attention_ops = ops if self.kernels else None

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
            hidden = self.model.model.encoder(batch).last_hidden_state  # [group, 1500, d_model]
            index = self._tensor(slots[first:first + group])
            for i, layer in enumerate(self.decoder.layers):
                attn = layer.encoder_attn
                self.cross_k[i, index] = self._heads(attn.k_proj(hidden), len(index))
                self.cross_v[i, index] = self._heads(attn.v_proj(hidden), len(index))

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src`'s caches into slot `dst` (keeping the active slots dense)."""
        for cache in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def decode(self, tokens: list[list[int]], starts: list[int],
               extra_positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder step for slots 0..len(tokens)-1: slot b appends `tokens[b]` (one or more) at positions
        `starts[b]`... Returns the float32 logits after each slot's last new token [B, vocab], and, with
        `extra_positions`, the logits at that index of each slot's new tokens (-1: none) [B, vocab]. The logits are
        on the CPU, whatever the model's device."""
        batch, num_new = len(tokens), max(len(t) for t in tokens)
        ids = self._tensor([row + [0] * (num_new - len(row)) for row in tokens])  # [B, T]
        lengths = self._tensor([len(t) for t in tokens])
        # padding tokens past a row's own write future positions, overwritten before anything attends to them
        positions = self._tensor([[min(start + t, self.max_len - 1) for t in range(num_new)] for start in starts])
        slots = torch.arange(batch, device=self.device)[:, None]

        decoder = self.decoder
        hidden = decoder.embed_tokens(ids) + decoder.embed_positions.weight[positions]  # [B, T, d_model]
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(hidden)
            q = self._heads(self._linear(attn.q_proj, x), batch)  # [B, H, T, head_dim]
            self.self_k[i][slots, :, positions] = self._heads(self._linear(attn.k_proj, x), batch).transpose(1, 2)
            self.self_v[i][slots, :, positions] = self._heads(self._linear(attn.v_proj, x), batch).transpose(1, 2)
            # causal: the token at position p reads positions 0..p
            out = self._attend(q, self.self_k[i], self.self_v[i], 0, positions + 1, attn.scaling)
            hidden = hidden + self._linear(attn.out_proj, self._merge(out, batch))
            hidden = self._cross_and_mlp(i, layer, hidden, 0)
        hidden = decoder.layer_norm(hidden)

        rows = slots[:, 0]
        logits = self._linear(self.model.proj_out, hidden[rows, lengths - 1]).float().cpu()
        extra = None
        if extra_positions is not None:
            at = self._tensor(extra_positions)
            extra = self._linear(self.model.proj_out, hidden[rows, at.clamp(min=0)]).float().cpu()
        return logits, extra

    @torch.inference_mode()
    def alignment(self, slot: int, tokens: list[int], heads: list[tuple[int, int]]) -> torch.Tensor:
        """Cross-attention scores (scaled, before the softmax) of the (layer, head) pairs `heads` for the tokens
        `tokens` read in one pass over slot `slot`'s window: [len(heads), len(tokens), num_frames]. The slot's
        self-attention cache is left as it is."""
        decoder, num_tokens = self.decoder, len(tokens)
        hidden = decoder.embed_tokens(self._tensor([tokens])) + decoder.embed_positions.weight[:num_tokens]
        scores = {}
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(hidden)
            q, k, v = (self._heads(self._linear(proj, x), 1) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
            hidden = hidden + self._linear(attn.out_proj, self._merge(out, 1))
            wanted = [head for (layer_index, head) in heads if layer_index == i]
            if wanted:
                attn = layer.encoder_attn
                q = self._heads(self._linear(attn.q_proj, layer.encoder_attn_layer_norm(hidden)), 1)
                qk = (q[0, wanted] @ self.cross_k[i, slot, wanted].transpose(-1, -2)) * attn.scaling  # [h, T, frames]
                scores.update({(i, h): qk[n] for n, h in enumerate(wanted)})
            hidden = self._cross_and_mlp(i, layer, hidden, slot)
        return torch.stack([scores[pair] for pair in heads]).float().cpu()

    def _cross_and_mlp(self, i: int, layer, hidden: torch.Tensor, first_slot: int) -> torch.Tensor:
        """The cross-attention and feed-forward halves of decoder layer `i`; row b reads slot first_slot + b."""
        attn, batch = layer.encoder_attn, hidden.shape[0]
        q = self._heads(self._linear(attn.q_proj, layer.encoder_attn_layer_norm(hidden)), batch)
        out = self._attend(q, self.cross_k[i], self.cross_v[i], first_slot, None, attn.scaling)
        hidden = hidden + self._linear(attn.out_proj, self._merge(out, batch))
        x = layer.final_layer_norm(hidden)
        return hidden + self._linear(layer.fc2, layer.activation_fn(self._linear(layer.fc1, x)))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, first_slot: int,
                key_lens: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of q [B, H, T, head_dim], row b over slot first_slot + b of one layer's cache [slots, H,
        positions, head_dim]: query (b, t) reads the first `key_lens[b, t]` positions (None: all)
        -> [B, H, T, head_dim]."""
        batch, _, num_new, _ = q.shape
        _, num_heads, num_positions, head_dim = k_cache.shape
        if key_lens is None:
            key_lens = torch.full((batch, num_new), num_positions, dtype=torch.long, device=q.device)
        if self._attention_ops is not None:
            # every (row, head, token) a sequence of one head, whose one block is its slot's keys of that head
            blocks = torch.arange(first_slot * num_heads, (first_slot + batch) * num_heads).repeat_interleave(num_new)
            out = self._attention_ops.paged_decode_attention(
                q.reshape(-1, 1, head_dim).contiguous(), k_cache.view(-1, num_positions, 1, head_dim),
                v_cache.view(-1, num_positions, 1, head_dim), blocks[:, None],
                key_lens[:, None].expand(batch, num_heads, num_new).reshape(-1), scale, -1, 0.0)
            return out.view(batch, num_heads, num_new, head_dim)
        num_keys = int(key_lens.max())
        keys, values = (cache[first_slot:first_slot + batch, :, :num_keys] for cache in (k_cache, v_cache))
        mask = None
        if bool((key_lens < num_keys).any()):
            mask = (torch.arange(num_keys, device=q.device)[None, None, :] < key_lens[:, :, None])[:, None]  # [B,1,T,K]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    def _heads(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        return x.view(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)

    @staticmethod
    def _merge(x: torch.Tensor, batch: int) -> torch.Tensor:
        return x.transpose(1, 2).reshape(batch, x.shape[2], -1)
