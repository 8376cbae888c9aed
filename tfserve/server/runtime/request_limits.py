"""Per-request budgets, decided before any work is done for a request: how many messages a chat holds, how
many sequences one prompt makes (`n`), how often a request may swap the resident model, and how many bytes
the conversation and response stores keep. Every refusal is a 400 (429 for a swap) naming its field and the
flag that sets the budget.

Elsewhere: the decoded pixels of a request's images (media.py, `--max-request-pixels`), its decoded audio
seconds (audio/decode.py, `--max-audio-seconds`), a grammar's compile time (response_format.MAX_COMPILE_S) and
one token's mask time (engine/structured.MAX_MASK_S).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfserve.server.errors import ApiError, bad_request

DEFAULT_MAX_MESSAGES = 2048  # OpenAI's limit on a chat's messages
DEFAULT_MAX_SEQS_PER_REQUEST = 16  # `n` (or best_of): one request's share of the running batch
DEFAULT_MODEL_SWAP_INTERVAL_S = 30.0  # a load takes seconds to a minute: alternating names must not keep it busy
DEFAULT_STORE_BYTES = 256 * 2**20  # conversations, and stored responses, each
DEFAULT_STORED_ITEM_BYTES = 32 * 2**20  # one conversation, or one stored response


@dataclass(slots=True)
class RequestLimits:
    """The server's per-request budgets (`tfserve serve`'s Limits flags)."""

    max_messages: int = DEFAULT_MAX_MESSAGES  # chat messages (or Responses input items) in one request
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST  # sequences one prompt makes (`n`, `best_of`)
    # an on-demand swap of the resident model waits this long after the previous one ended (0: no limit)
    model_swap_interval_s: float = 0.0
    max_store_bytes: int = DEFAULT_STORE_BYTES  # each of the conversation and response stores, oldest dropped
    max_stored_item_bytes: int = DEFAULT_STORED_ITEM_BYTES  # one conversation or stored response, at most

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_seqs_per_request", "max_store_bytes", "max_stored_item_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.model_swap_interval_s < 0:
            raise ValueError(f"model_swap_interval_s must be >= 0 (got {self.model_swap_interval_s})")
        if self.max_stored_item_bytes > self.max_store_bytes:
            raise ValueError(f"max_stored_item_bytes ({self.max_stored_item_bytes}) must be at most "
                             f"max_store_bytes ({self.max_store_bytes})")


def check_messages(limits: RequestLimits, messages: Any, param: str = "messages") -> None:
    """A 400 for a request of more messages than --max-messages, before any of them is read: a chat of 400,000
    tiny messages cost 35 s of a core and 1 GB to be told it was too long."""
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise bad_request(f"{param} holds {len(messages)} items; a request may hold at most {limits.max_messages} "
                          "(--max-messages)", param)


def check_num_sequences(limits: RequestLimits, n: Any, param: str = "n") -> None:
    """A 400 for an `n` past --max-seqs-per-request: each sequence takes a slot of the running batch, and one
    request of n=128 held other clients' chats back by 30 s."""
    if type(n) is int and n > limits.max_seqs_per_request:
        raise bad_request(f"{param} is {n}; this server makes at most {limits.max_seqs_per_request} sequences per "
                          "prompt (--max-seqs-per-request)", param)


def swap_too_soon(name: str, interval_s: float, wait_s: float) -> ApiError:
    """The 429 for a request that would swap the resident model sooner than --model-swap-interval allows."""
    retry = max(1, int(wait_s + 0.999))
    return ApiError(429, f"loading model {name!r} would evict the resident model, which loaded less than "
                         f"{interval_s:g} s ago (--model-swap-interval); retry in {retry} s, or use the resident "
                         "model", param="model", code="model_swap_rate_limited", headers={"Retry-After": str(retry)})
