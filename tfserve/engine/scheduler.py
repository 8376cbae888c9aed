"""The scheduler: which requests compute how many tokens in the next step. No torch here. It alone moves a
request's `num_computed_tokens` (a prefix hit, a step run, a preemption).

Each step has a token budget (`max_batch_tokens`) and a cap on running sequences (`max_num_seqs`).
Running requests go first (decodes, and prefills already under way), then waiting ones in arrival order;
a prompt longer than the budget left is chunked. When the pool runs out of blocks, the latest-arrived
running request is preempted: its blocks are freed and it is recomputed later (its prefix may still be
cached). With speculative decoding a greedy decode also computes its proposals (`spec_token_ids`: n-gram
guesses, or a draft model's places that the runner fills), and `advance` takes back the ones the step
rejected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tfserve.engine.kv_cache import BlockPool
from tfserve.engine.request import Request, RequestStatus
from tfserve.engine.spec_decode import propose_ngram


def _is_decode(request: Request, start: int, num_new: int) -> bool:
    """Whether `num_new` tokens from position `start` are a decode: one sampled token. A prompt's last token
    alone (the rest found in the prefix cache, or computed in earlier chunks) is a prefill like any prompt token,
    so a request's results do not depend on the cache or on how its prompt was chunked (block-quantized weights
    multiply prompt tokens in float32, sampled ones with int8 activations)."""
    return num_new == 1 and start >= request.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, handed to the runner."""

    requests: list[Request] = field(default_factory=list)  # decodes (one new token) first, then decodes with
    # proposals (their new tokens: the last token, then `spec_token_ids`), then prefills
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each request computes this step
    num_decodes: int = 0  # the first `num_decodes` requests compute exactly one token
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step
    num_batched_tokens: int = 0  # sum(num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """FCFS continuous batching over a token budget, with chunked prefill and preemption by recompute."""

    def __init__(self, block_pool: BlockPool, max_batch_tokens: int, max_num_seqs: int,
                 num_speculative_tokens: int = 0, long_prefill_token_threshold: int | None = None,
                 propose: Callable[[Request, int], list[int]] | None = None) -> None:
        """`propose(request, k)`: up to k proposals for a greedy decode (default: n-gram prompt lookup)."""
        self.block_pool = block_pool
        self.long_prefill_token_threshold = long_prefill_token_threshold  # a prefill's tokens per step at most
        self.num_speculative_tokens = num_speculative_tokens  # proposals per greedy decode at most; 0: off
        self.propose = propose or (lambda request, k: propose_ngram(request.token_ids, k))
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_batch_tokens
        decodes: list[tuple[Request, int]] = []
        verifies: list[tuple[Request, int]] = []  # decodes with proposals
        prefills: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, request.num_computed_tokens,
                                  min(request.num_tokens - request.num_computed_tokens, budget))
            decode = _is_decode(request, request.num_computed_tokens, num_new)
            request.spec_token_ids = self._proposals(request, budget) if decode else []
            num_new += len(request.spec_token_ids)
            while not self.block_pool.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                (decodes if decode else verifies if request.spec_token_ids else prefills).append((request, num_new))
                budget -= num_new
                i += 1

        # Nothing new starts in a step that had to preempt: the pool is short already.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = self.block_pool.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            start = len(cached) * self.block_pool.block_size
            num_new = self._chunk(request, start, min(request.num_tokens - start, budget))
            if not self.block_pool.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens += len(cached) * self.block_pool.block_size  # a prefix hit is computed
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = len(cached) * self.block_pool.block_size
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            (decodes if _is_decode(request, start, num_new) else prefills).append((request, num_new))
            budget -= num_new

        scheduled = decodes + verifies + prefills
        return SchedulerOutput(
            requests=[r for r, _ in scheduled],
            num_new_tokens=[n for _, n in scheduled],
            num_decodes=len(decodes),
            preempted=preempted,
            num_batched_tokens=self.max_batch_tokens - budget,
        )

    def advance(self, plan: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """The step ran: every scheduled request has computed its new tokens, less the proposals it rejected
        (`num_rejected` by request id: their KV is overwritten later)."""
        for request, num_new in zip(plan.requests, plan.num_new_tokens):
            request.num_computed_tokens += num_new - (num_rejected or {}).get(request.request_id, 0)
            request.spec_token_ids = []

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        """A prefill chunk's size: at most `long_prefill_token_threshold`; a model whose image tokens attend both
        ways takes the rest of an image whole (the budget may run over by part of one image)."""
        if start >= request.num_tokens - 1:  # a decode
            return num_new
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        if request.mm is None or start >= request.num_prompt_tokens:
            return num_new
        return request.mm.chunk_size(start, num_new)

    def _proposals(self, request: Request, budget: int) -> list[int]:
        """Proposals for a greedy decode (none past its max_tokens or the step's budget). None for a request held
        to a grammar: checked under its grammar, proposals changed such replies (a draft model's broke JSON
        output, n-gram ones changed a forced tool call's tokens: an outside audit), so those decode one token a
        step, as without speculation."""
        params = request.params
        if (not self.num_speculative_tokens or not params.greedy or params.logprobs is not None or params.shapes_logits
                or params.grammar is not None):
            return []
        room = min(self.num_speculative_tokens, budget - 1, params.max_tokens - request.num_output_tokens - 1)
        return self.propose(request, room) if room > 0 else []

    def requeue(self, request: Request) -> None:
        """Send a running request back to the front of the queue to be recomputed from scratch."""
        self.running.remove(request)
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        request.num_draft_computed = 0  # its blocks go: so do the draft's keys and values in them
        self.block_pool.free_request(request)
        request.num_computed_tokens = 0  # recomputed from scratch (a cached prefix may still be hit)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished, aborted or failed) and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.is_finished:
            self.waiting.remove(request)
        request.status = status
        self.block_pool.free_request(request)
        request.num_computed_tokens = 0
