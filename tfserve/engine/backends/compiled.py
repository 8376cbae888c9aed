"""The model's own forward through torch.compile (`--compile`), for models the lean forward does not run.

One graph serves every step: the packed token axis and the sampled rows are marked unbacked (no specialisation
on 0 or 1 tokens, so a lone decode and a 500-token prefill take the same code), and paged attention is one opaque
op (`tfserve::paged_attention`) that reads the step's metadata when it runs. On CPU, inductor freezes the weights
(constants folded, linear weights prepacked for oneDNN), which is where most of its gain comes from: a step's
time is mostly small-row matmuls. The engine compiles at load time with one warm-up step, so no request waits
for it; a compile that fails leaves the model's forward eager, with one line saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tfserve.engine.backends.hf import HFForward

logger = logging.getLogger(__name__)


class CompiledForward(HFForward):
    """`HFForward` with the model's forward compiled; `warm_up` compiles it (or falls back to eager)."""

    name = "compiled"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        # inductor reads `freezing` outside what torch.compile's options reach: set around every call that may compile
        self._freezing = next(model.parameters()).device.type == "cpu"
        self._compiled = torch.compile(model.forward, dynamic=True)
        self.eager = False  # the compile failed: the model's own forward runs as is

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                 inputs_embeds: torch.Tensor | None = None, mrope_positions: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.eager:
            return super().__call__(input_ids, positions, logits_index, inputs_embeds, mrope_positions)
        if inputs_embeds is None:  # looked up here, so that steps with an image and without share the graph
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        inputs_embeds = inputs_embeds[None]
        position_ids = positions[None] if mrope_positions is None else mrope_positions[:, None]
        torch._dynamo.decorators.mark_unbacked(inputs_embeds, 1)
        torch._dynamo.decorators.mark_unbacked(position_ids, position_ids.dim() - 1)
        torch._dynamo.decorators.mark_unbacked(logits_index, 0)
        with torch._inductor.config.patch(freezing=self._freezing):
            return self._compiled(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                  logits_to_keep=logits_index, use_cache=False).logits[0]

    def warm_up(self, step: Callable[[], object]) -> None:
        """Compile by running `step` (one engine forward); if compiling fails, say so once and run eagerly."""
        try:
            step()
        except Exception as e:  # inductor's failures have many types (no C++ compiler, an op it cannot lower)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            logger.warning("compile failed, the model's forward runs eagerly: %s", reason[:300])
            self.eager = True
