"""vLLM's prompt logprobs: each prompt token's logprob given the tokens before it, its rank, and the top k at
its position.

The logits at position `p` predict token `p + 1`, so a prompt of n tokens is scored by the logits of its
positions 0 .. n-2 (the last position's logits pick the first output token, as always). The runner asks its
forward for those rows, in every chunk of a chunked prefill, and `score` turns them into entries that the
request keeps (`Request.prompt_logprobs`, the first token's entry None). A request counts what it has
gathered, so a recompute after preemption scores no position twice.
"""

from __future__ import annotations

import torch

from tfserve.engine.request import Request


def positions_to_score(request: Request, start: int, end: int) -> range:
    """The positions in `[start, end)` (this step's) whose logits score a prompt token not scored yet."""
    if request.prompt_logprobs is None:
        return range(0)
    return range(max(start, len(request.prompt_logprobs) - 1), min(end, request.num_prompt_tokens - 1))


def score(logits: torch.Tensor, rows: list[tuple[Request, range]]) -> list[list[dict]]:
    """`logits` [num_rows, vocab], one row per position of `rows` (each request and the positions it scores,
    in order) -> for each request its entries: {"token_id", "logprob", "rank", "top": [(token_id, logprob)]}."""
    logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab]
    targets = [request.token_ids[p + 1] for request, positions in rows for p in positions]
    target_ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, target_ids[:, None])  # [num_rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # 1 = the likeliest; a tie counts against it, as vLLM
    chosen = chosen[:, 0].tolist()
    max_top = max(request.params.prompt_logprobs for request, _ in rows)
    top_values = top_ids = None
    if max_top:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(max_top, dim=-1))
    result, row = [], 0
    for request, positions in rows:
        k = request.params.prompt_logprobs
        entries = []
        for _ in positions:
            top = list(zip(top_ids[row][:k], top_values[row][:k])) if k else []
            entries.append({"token_id": targets[row], "logprob": chosen[row], "rank": ranks[row], "top": top})
            row += 1
        result.append(entries)
    return result
