"""Speculative decoding with a draft model: a small model of the same tokenizer proposes each greedy decode's
next tokens, and the step checks them all in one forward of the served model (engine/spec_decode.py keeps
what it agrees with), so the output is the served model's own greedy tokens, several per step where the draft
guesses well.

The draft keeps its own KV cache, laid out like the served model's and indexed by the same block tables: a
request's slots hold the draft's keys and values beside the model's, and no second allocator is needed. The
scheduler reserves a greedy decode's room for proposals (placeholders); before the step runs, the draft
catches up on the request's tokens it has not seen (the whole prompt the first time, then what the last step
accepted) and guesses one token, then guesses the rest one forward each, every request in one batch. Its
cache is right up to `min(num_draft_computed, num_computed_tokens)`: past that it saw proposals the model
rejected, and writes them over. A wrong draft cache only costs acceptance, never a different output."""

from __future__ import annotations

import dataclasses

import torch

from tfserve.config import EngineConfig
from tfserve.engine.request import Request
from tfserve.engine.runner import ModelRunner


class DraftModel:
    """The proposer of an engine's greedy decodes: `propose(requests)` fills each request's placeholder
    `spec_token_ids` with the draft's greedy continuation."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, num_blocks: int, vocab_size: int,
                 gguf_file: str | None = None) -> None:
        """`num_blocks`: the served model's (the same block ids index both caches); `vocab_size`: the served
        model's (a draft with a padded, larger vocabulary never proposes past it); `gguf_file`: the GGUF file the
        draft was loaded from, whose blocks the lean forward runs as they are."""
        weights = "gguf" if gguf_file else "auto" if config.weights == "gguf" else config.weights
        draft_config = dataclasses.replace(config, num_blocks=num_blocks, speculative=None, speculative_model=None,
                                           gguf_file=gguf_file, weights=weights)
        self.runner = ModelRunner(model, draft_config)  # (warmed up: compiled where config.compile asks)
        self.vocab_size = min(vocab_size, model.config.get_text_config().vocab_size)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def propose(self, requests: list[Request]) -> None:
        """Replace each request's placeholders (as many as it has room for) with the draft's tokens."""
        if not requests:
            return
        rooms = [len(r.spec_token_ids) for r in requests]
        chunks = []
        for request in requests:  # the tokens the draft has not computed, the last one included
            start = min(request.num_draft_computed, request.num_computed_tokens)
            chunks.append((request, request.token_ids[start:], start))
        proposals = [[token] for token in self.runner.greedy_next(chunks, self.vocab_size)]
        for j in range(1, max(rooms)):  # each further guess: the previous one fed back, one forward for all
            active = [i for i, room in enumerate(rooms) if room > j]
            chunks = [(requests[i], proposals[i][-1:], requests[i].num_tokens - 1 + j) for i in active]
            for i, token in zip(active, self.runner.greedy_next(chunks, self.vocab_size)):
                proposals[i].append(token)
        for request, tokens in zip(requests, proposals):
            request.spec_token_ids = tokens
            request.num_draft_computed = request.num_tokens - 1 + len(tokens)  # the last guess is not fed
