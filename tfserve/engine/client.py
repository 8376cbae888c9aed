"""What the layers above the engine (server, chat, serving) see of it: `EngineClient`, the engine that admits
requests and describes the model; `AsyncEngineClient`, what streams them (one engine, or replicas behind a
router); and `EngineStats`, one reading of the counters that /metrics, telemetry and /health show.

The server holds an `EngineClient` (`ServerState.engine`: the `Engine`, replica 0's where there are replicas,
which validates every request) and an `AsyncEngineClient` (`ServerState.async_engine`: an `AsyncEngine`, or a
`ReplicatedEngine` that routes each built request to a replica). Nothing above the engine reaches past these
into its block pool, scheduler, runner or grammar compiler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tfserve.engine.request import Request, RequestOutput
from tfserve.sampling_params import Grammar, SamplingParams


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters at one moment (`Engine.stats()`); zero for what it does not have."""

    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences queued, not yet scheduled
    kv_cache_blocks_used: int = 0
    kv_cache_blocks_total: int = 0
    prefix_cache_hit_rate: float = 0.0  # share of queried prompt tokens found in the prefix cache
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0  # running sequences preempted (KV cache full), recomputed later
    num_draft_tokens: int = 0  # speculative decoding: proposals checked
    num_accepted_tokens: int = 0  # ... and accepted
    cuda_graphs_captured: int = 0  # decode graphs captured, one per bucket used
    cuda_graph_replays: int = 0  # decode steps run as a graph replay
    num_steps: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Speculative decoding: the share of proposed tokens the model agreed with (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def replica_counters(self) -> dict[str, float]:
        """The counters a replica reports to its front-end (`tfserve_replica_*` in /metrics)."""
        return {"num_running": self.num_running, "num_waiting": self.num_waiting,
                "kv_cache_blocks_used": self.kv_cache_blocks_used, "kv_cache_blocks_total": self.kv_cache_blocks_total,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "prefix_cache_queried_tokens": self.prefix_cache_queried_tokens,
                "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens, "num_preemptions": self.num_preemptions}


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server and the in-process chat use it: requests built and checked (`make_requests`,
    `sampling_params`), grammars compiled off the step loop, the model described, its counters read."""

    model_name: str
    model_path: str | None
    tokenizer: Any  # the model's transformers tokenizer (chat templates, tool formats, token texts)
    vocab_size: int
    max_model_len: int
    dtype: Any
    device: str
    quantization: str
    matmul_units: dict[str, str]  # weight format -> the instructions that multiply it
    kernel_paths: dict[str, str]  # CPU kernel path -> the instructions it runs on here (engine/kernel_paths.py)

    @property
    def input_modalities(self) -> list[str]: ...

    @property
    def model_type(self) -> str: ...

    @property
    def num_parameters(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def sampling_params(self, num_prompt_tokens: int, **kwargs: Any) -> SamplingParams: ...

    def make_requests(self, prompt: list[int] | str, params: SamplingParams | Any | None = None,
                      request_id: str | None = None, mm: Any = None) -> list[Request]: ...

    def render_multimodal(self, messages: list[dict], images: list[Any], tools: list | None = None,
                          template_kwargs: dict[str, Any] | None = None, **options: Any) -> tuple[list[int], Any]: ...

    def grammar_compiled(self, grammar: Grammar) -> bool: ...

    @property
    def grammars_ready(self) -> bool: ...

    def prepare_grammars(self) -> None: ...

    def compile_grammar(self, grammar: Grammar) -> None: ...

    def stats(self) -> EngineStats: ...

    def dead_ranks(self, wait_s: float = 1.0) -> list[str]: ...


@runtime_checkable
class AsyncEngineClient(Protocol):
    """What streams built requests for the server: one engine's `AsyncEngine`, or replicas behind a router
    (`tfserve.serving.replicas.ReplicatedEngine`, which adds `states`, `scale`, `replica_stats`)."""

    engine: EngineClient  # the engine that admits (replica 0's)
    manager: Any  # its BatchingManager (`on_failure`: told once when the engine fails for good)

    def generate_request(self, request: Request) -> AsyncIterator[RequestOutput]: ...

    def stop(self) -> None: ...
