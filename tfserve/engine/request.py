"""A request's state as it moves through the engine, and what the engine hands back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from tfserve.errors import GrammarFailed
from tfserve.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence: its tokens, how many of them have KV in the cache, and its blocks.

    `num_computed_tokens` makes prefill, chunked prefill and decode one thing: each step computes
    `token_ids[num_computed_tokens : num_computed_tokens + n]`.
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "params", "arrival_time", "status",
        "num_computed_tokens", "block_ids", "block_hashes", "num_cached_tokens", "num_preemptions",
        "first_token_time", "finish_time", "logprobs", "error", "detokenizer", "stop_reason",
        "generator", "eos_token_ids", "scheduled_time", "_prompt_token_ids", "spec_token_ids", "matcher",
        "prompt_logprobs", "mm", "num_draft_computed", "num_logprobs_sent",
        "__weakref__",  # the server's admitted-not-yet-submitted set holds requests weakly
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None,
                 mm: Any = None) -> None:
        self.request_id = request_id
        self.mm = mm  # engine.multimodal.MultiModalInput: the prompt's images, or None
        self._prompt_token_ids = list(prompt_token_ids)  # shared by every output, never copied per token
        self.token_ids: list[int] = list(prompt_token_ids)
        self.spec_token_ids: list[int] = []  # this step's proposals (speculative decoding), not yet tokens
        self.num_draft_computed = 0  # positions in a draft model's KV cache (engine/draft.py)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks, computed once
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache on first schedule
        self.num_preemptions = 0
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.logprobs: list[dict[str, Any]] | None = [] if params.logprobs is not None else None
        # logprobs streamed so far: a token's goes out with its text (held back while its text is: a stop string
        # may yet cut it)
        self.num_logprobs_sent = 0
        # vLLM's prompt logprobs, one entry per prompt token gathered so far; the first token's is None (nothing
        # comes before it to predict it)
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.error: str | GrammarFailed | None = None  # GrammarFailed: the output grammar failed
        self.stop_reason: str | int | None = None
        self.detokenizer = None
        self.generator = None
        self.matcher = None  # the grammar's state when params.grammar constrains the output (engine.structured)

    def __getstate__(self) -> dict[str, Any]:
        """What crosses to another process (an engine replica): all but the grammar's matcher and the
        detokenizer, which hold the grammar engine's and the tokenizer's objects (a matcher cannot be pickled, a
        tokenizer is megabytes); the engine that takes the request makes its own (`Engine.attach`)."""
        state = {name: getattr(self, name) for name in self.__slots__ if name != "__weakref__" and hasattr(self, name)}
        state["matcher"] = state["detokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all gathered: the prompt's logits must be computed, so its prefix
        is not read from the cache (a hit skips the forward that gives them)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, in seconds."""

    arrival_time: float
    queue_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token
    e2e_s: float | None = None  # arrival -> finish
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return self.ttft_s

    @property
    def e2e(self) -> float | None:
        return self.e2e_s


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for a request: a stream delta while it runs, the whole result at the end."""

    request_id: str
    prompt_token_ids: list[int]
    generated_tokens: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    logprobs: list[dict[str, Any]] | None = None
    metrics: RequestMetrics | None = None
    delta_text: str = ""  # text new since the previous output of this request (streaming)
    delta_tokens: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[str, Any]] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    stop_token_shown: bool = False  # that token's text (and logprob) is part of the output: include_stop_str_in_output
    error: str | GrammarFailed | None = None
    # vLLM's prompt logprobs: per prompt token {"token_id", "logprob", "rank", "top": [(token_id, logprob), ...]},
    # None for the first; on every output from the end of the prefill on (a request ended before has none)
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
