"""The model's own forward: any transformers causal LM, its attention routed to the engine's paged attention."""

from __future__ import annotations

import torch


class HFForward:
    """`forward(input_ids, positions, logits_index) -> logits` through `model(...)`: every token of the step
    in one row (`[1, num_tokens]`, no padding), logits only where a sequence samples."""

    name = "hf"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                 inputs_embeds: torch.Tensor | None = None, mrope_positions: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_index: [num_samples] -> logits [num_samples, vocab].
        A vision-language model's step may bring `inputs_embeds` [num_tokens, hidden] (the token embeddings with
        its images in place) and `mrope_positions` [3, num_tokens] (Qwen2-VL's 3-D rotary positions)."""
        tokens = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        position_ids = positions[None] if mrope_positions is None else mrope_positions[:, None]
        return self.model(**tokens, position_ids=position_ids, logits_to_keep=logits_index, use_cache=False).logits[0]
