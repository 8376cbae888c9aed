"""Prometheus metrics, one registry per app (never the global one, so tests and apps do not collide);
health.py serves it at `GET /metrics`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tfserve.engine.client import AsyncEngineClient, EngineClient, EngineStats

if TYPE_CHECKING:
    from tfserve.engine.request import RequestOutput
    from tfserve.server.runtime.speech import SpeechModels
    from tfserve.server.runtime.stores import ConversationStore, ResponseStore

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MetricsSource(Protocol):
    """What the gauges read when scraped (`ServerState`, which passes itself in: this module never imports it).
    Read at scrape time, so what is made after the metrics (the engine, speech models, stores) is seen."""

    engine: EngineClient | None  # the served engine, None while none is loaded
    async_engine: AsyncEngineClient | None  # what streams its requests (`replica_stats()` where there are replicas)
    speech: SpeechModels
    responses: ResponseStore
    conversations: ConversationStore

    @property
    def num_queued(self) -> int: ...


class ServerMetrics:
    """Counters and histograms the handlers feed, gauges read from the engine when scraped."""

    def __init__(self, state: MetricsSource) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tfserve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("tfserve_prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("tfserve_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("tfserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("tfserve_inter_token_latency_seconds", "Time between two tokens of a stream",
                                     buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("tfserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        # the engine appears once the model is loaded: its counters, or zeros before
        stats = lambda: state.engine.stats() if state.engine is not None else EngineStats()  # noqa: E731
        _gauge(registry, "tfserve_num_requests_running", "Sequences in the running batch",
               lambda: stats().num_running)
        _gauge(registry, "tfserve_num_requests_waiting", "Sequences queued for the engine",
               lambda: state.num_queued)
        _gauge(registry, "tfserve_kv_cache_blocks_used", "KV cache blocks in use",
               lambda: stats().kv_cache_blocks_used)
        _gauge(registry, "tfserve_kv_cache_blocks_total", "KV cache blocks",
               lambda: stats().kv_cache_blocks_total)
        _gauge(registry, "tfserve_num_preemptions", "Running sequences preempted (KV cache full) and recomputed later",
               lambda: stats().num_preemptions)
        _gauge(registry, "tfserve_prefix_cache_hit_rate", "Share of prompt blocks found in the prefix cache",
               lambda: stats().prefix_cache_hit_rate)
        _gauge(registry, "tfserve_spec_decode_draft_tokens", "Speculative decoding: tokens proposed and checked",
               lambda: stats().num_draft_tokens)
        _gauge(registry, "tfserve_spec_decode_accepted_tokens", "Speculative decoding: proposals accepted",
               lambda: stats().num_accepted_tokens)
        _gauge(registry, "tfserve_spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed",
               lambda: stats().spec_acceptance_rate)

        _gauge(registry, "tfserve_cuda_graphs_captured", "Decode steps: CUDA graphs captured (one per bucket used)",
               lambda: stats().cuda_graphs_captured)
        _gauge(registry, "tfserve_cuda_graph_replays", "Decode steps run as a CUDA graph replay",
               lambda: stats().cuda_graph_replays)

        speech = lambda: state.speech  # noqa: E731 - made after the metrics
        _gauge(registry, "tfserve_audio_windows_running", "Speech: 30-second windows being decoded",
               lambda: speech().num_running)
        _gauge(registry, "tfserve_audio_requests_waiting", "Speech: transcriptions waiting for a window slot",
               lambda: speech().num_waiting)
        _gauge(registry, "tfserve_audio_seconds_transcribed", "Speech: seconds of audio of finished transcriptions "
               "(by the loaded speech models)", lambda: speech().total("audio_seconds"))
        _gauge(registry, "tfserve_audio_windows_encoded", "Speech: encoder passes, one per window",
               lambda: speech().total("num_windows"))
        _gauge(registry, "tfserve_audio_decode_steps", "Speech: batched decoder steps",
               lambda: speech().total("num_steps"))
        _gauge(registry, "tfserve_audio_tokens_decoded", "Speech: tokens sampled",
               lambda: speech().total("num_tokens"))
        _gauge(registry, "tfserve_audio_decodes_cut", "Speech: hotter decodes of a failed window stopped early, "
               "once they could no longer change its transcript", lambda: speech().total("num_cut"))

        # made after the metrics, like speech; their byte budgets are --max-store-mib
        _gauge(registry, "tfserve_stored_responses", "Stored responses held (previous_response_id)",
               lambda: len(state.responses))
        _gauge(registry, "tfserve_stored_responses_bytes", "Bytes (as JSON) of the stored responses held",
               lambda: state.responses.num_bytes)
        _gauge(registry, "tfserve_conversations", "Conversations held (/v1/conversations)",
               lambda: len(state.conversations))
        _gauge(registry, "tfserve_conversations_bytes", "Bytes (as JSON) of the conversations held",
               lambda: state.conversations.num_bytes)

        registry.register(_ReplicaCollector(state))
        registry.register(_MatmulCollector(state))

    def observe_finished(self, output: RequestOutput) -> None:
        """Count one finished sequence's tokens and timings."""
        self.generation_tokens.inc(len(output.generated_tokens))
        metrics = output.metrics
        if metrics is not None:
            if metrics.ttft_s is not None:
                self.ttft.observe(metrics.ttft_s)
            if metrics.e2e_s is not None:
                self.e2e.observe(metrics.e2e_s)


def _gauge(registry: CollectorRegistry, name: str, documentation: str, read) -> None:
    Gauge(name, documentation, registry=registry).set_function(read)


class _ReplicaCollector:
    """The engine's counters labelled by replica (`--data-parallel-size`; one replica, "0", otherwise)."""

    _GAUGES = {"num_running": "Sequences in the replica's running batch",
               "num_waiting": "Sequences queued for the replica's engine",
               "kv_cache_blocks_used": "The replica's KV cache blocks in use",
               "kv_cache_blocks_total": "The replica's KV cache blocks",
               "prefix_cache_hit_rate": "Share of the replica's prompt tokens found in its prefix cache",
               "prefix_cache_hit_tokens": "Prompt tokens the replica found in its prefix cache",
               "num_preemptions": "The replica's running sequences preempted (KV cache full)",
               "num_routed": "Requests routed to the replica",
               "num_in_flight": "Requests routed to the replica and not finished"}

    def __init__(self, state: MetricsSource) -> None:
        self.state = state

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        async_engine = self.state.async_engine
        if async_engine is None:
            return
        if hasattr(async_engine, "replica_stats"):
            stats = async_engine.replica_stats()
        else:
            stats = [async_engine.engine.stats().replica_counters()]
        for name, documentation in self._GAUGES.items():
            family = GaugeMetricFamily(f"tfserve_replica_{name}", documentation, labels=["replica"])
            for index, entry in enumerate(stats):
                if name in entry:
                    family.add_metric([str(index)], float(entry[name]))
            yield family


class _MatmulCollector:
    """`tfserve_matmul_unit_info{format, unit}`: which instructions multiply each weight format (1 each), and
    `tfserve_kernel_path_info{path, isa}`: which each path of the CPU kernels runs on (engine/kernel_paths.py)."""

    def __init__(self, state: MetricsSource) -> None:
        self.state = state

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("tfserve_matmul_unit_info", "The instructions that multiply each weight format "
                                   "(CPU kernels)", labels=["format", "unit"])
        for fmt, unit in getattr(self.state.engine, "matmul_units", {}).items():
            family.add_metric([fmt, unit], 1.0)
        yield family
        paths = GaugeMetricFamily("tfserve_kernel_path_info", "The instructions each CPU kernel path runs on "
                                  "(chosen at run time by the CPU's features)", labels=["path", "isa"])
        for path, isa in getattr(self.state.engine, "kernel_paths", {}).items():
            paths.add_metric([path, isa], 1.0)
        yield paths
