"""Speculative decoding by n-gram prompt lookup (no draft model): the tokens that followed the last time the
sequence's latest n tokens appeared in it are proposed as the next ones. A step then computes the request's
last token and its proposals in one forward, and keeps the proposals its own greedy choices agree with, plus
one more token: up to 1 + k tokens per step, the same tokens as one at a time. No torch here."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, max_n: int = 3, min_n: int = 2) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens (longest n
    from `max_n` down to `min_n` that occurs); [] when none does. A single repeated token is a poor guess
    (on SmolLM2 it halves the acceptance rate), hence `min_n` 2."""
    size = len(token_ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = token_ids[size - n:]
        for start in range(size - n - 1, -1, -1):  # the latest occurrence before the tail itself
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


def accepted(proposals: list[int], choices: list[int]) -> list[int]:
    """The tokens a step yields: `choices[i]` is the model's greedy token after the last token and the first i
    proposals; the proposals it agrees with, in order, then its own next choice."""
    n = 0
    while n < len(proposals) and choices[n] == proposals[n]:
        n += 1
    return choices[: n + 1]
