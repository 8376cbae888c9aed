"""OpenTelemetry (the `otel` extra), on with `--otel` or the standard `OTEL_*` variables: each /v1 request is
a trace (a root span with endpoint, model and status; a `queue`, `prefill` and `decode` span per sequence
with token counts, preemptions and prefix-cache hits), and the engine's gauges are OTel metrics, all
exported over OTLP.

Spans are made when a request ends, from the timings the engine already keeps (`RequestOutput.metrics`,
perf_counter seconds): nothing runs per token. OpenTelemetry is imported only when telemetry is on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from tfserve.errors import TfserveError

if TYPE_CHECKING:
    from aiohttp import web

    from tfserve.engine.client import EngineClient

logger = logging.getLogger("tfserve.server")

INSTALL_HINT = "--otel needs OpenTelemetry, which is not installed: pip install 'tfserve[otel]'"
_ENV_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME")
_NS = 1_000_000_000


class TelemetrySource(Protocol):
    """What the gauges read (`ServerState`, passed in by the CLI: this module never imports it), when exported."""

    engine: EngineClient | None  # the served engine, None while none is loaded

    @property
    def num_queued(self) -> int: ...


class RequestUsage(Protocol):
    """What a finished request's trace reads of its usage (`generation.Usage`, which the handlers above this
    module make: it is read through this, never imported)."""

    outputs: list[Any]  # each sequence's final RequestOutput
    prompt_tokens: int
    completion_tokens: int
    num_cached_tokens: int


def is_installed() -> bool:
    """Whether the `otel` extra (API, SDK and OTLP exporter) is importable."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp"))
    except ModuleNotFoundError:
        return False


def from_options(state: TelemetrySource, otel: bool) -> Telemetry | None:
    """Telemetry exported over OTLP when `--otel` is given or an `OTEL_*` endpoint/service variable is set.
    `--otel` without the extra raises a TfserveError naming the install command; the variables alone only
    log a warning (they may be meant for another program)."""
    from_env = any(os.environ.get(name) for name in _ENV_VARS)
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not (otel or from_env):
        return None
    if not is_installed():
        if otel:
            raise TfserveError(INSTALL_HINT)
        logger.warning("OTEL_* variables are set but OpenTelemetry is not installed: pip install 'tfserve[otel]'")
        return None
    return otlp_telemetry(state)


def otlp_telemetry(state: TelemetrySource) -> Telemetry:
    """Spans through a BatchSpanProcessor and metrics through a PeriodicExportingMetricReader, both to the
    OTLP exporter `OTEL_EXPORTER_OTLP_PROTOCOL` names (http/protobuf by default, or grpc)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over our default name
    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "tfserve"})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    meter_provider = MeterProvider(resource=resource,
                                   metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    return Telemetry(state, tracer_provider, meter_provider)


class Telemetry:
    """Turns finished requests into spans and exposes the engine's gauges, over the given SDK providers."""

    def __init__(self, state: TelemetrySource, tracer_provider: Any, meter_provider: Any) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.metrics import Observation

        self._trace, self._propagate = trace, propagate
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        self.tracer = tracer_provider.get_tracer("tfserve.server")
        meter = meter_provider.get_meter("tfserve.server")

        def gauge(name: str, description: str, unit: str, read) -> None:
            def callback(options):
                engine = state.engine  # its counters (EngineStats), once a model is loaded
                return [Observation(read(engine.stats()) if engine is not None else 0)]
            meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)

        gauge("tfserve.requests.running", "Sequences in the running batch", "{sequence}",
              lambda stats: stats.num_running)
        gauge("tfserve.requests.waiting", "Sequences queued for the engine", "{sequence}",
              lambda stats: state.num_queued)
        gauge("tfserve.kv_cache.blocks_used", "KV cache blocks in use", "{block}",
              lambda stats: stats.kv_cache_blocks_used)
        gauge("tfserve.kv_cache.blocks_total", "KV cache blocks", "{block}",
              lambda stats: stats.kv_cache_blocks_total)
        gauge("tfserve.prefix_cache.hit_rate", "Share of prompt blocks found in the prefix cache", "1",
              lambda stats: stats.prefix_cache_hit_rate)

    def record_request(self, request: web.Request, endpoint: str, status: int, start_ns: int, start_perf: float,
                       usage: RequestUsage | None, model: str | None) -> None:
        """One trace for a finished HTTP request that began at wall time `start_ns` = perf time `start_perf`."""
        trace = self._trace
        end_ns = time.time_ns()
        attributes: dict[str, Any] = {"http.request.method": request.method, "http.route": endpoint,
                                      "http.response.status_code": status}
        if model is not None:
            attributes["gen_ai.request.model"] = model
        outputs = usage.outputs if usage is not None else []
        if usage is not None:
            attributes.update({
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "tfserve.num_cached_tokens": usage.num_cached_tokens,
                "tfserve.num_preemptions": sum(o.metrics.num_preemptions for o in outputs if o.metrics),
                "tfserve.num_sequences": len(outputs),
            })
        root = self.tracer.start_span(f"{request.method} {endpoint}", context=self._propagate.extract(request.headers),
                                      kind=trace.SpanKind.SERVER, start_time=start_ns, attributes=attributes)
        if status >= 500:
            root.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {status}"))
        context = trace.set_span_in_context(root)

        def to_ns(t: float) -> int:  # a perf_counter time -> wall-clock ns, inside the root span
            return min(max(start_ns + int((t - start_perf) * _NS), start_ns), end_ns)

        for index, output in enumerate(outputs):
            for name, start, end, phase_attributes in _phases(output):
                span = self.tracer.start_span(name, context=context, start_time=to_ns(start),
                                              attributes={"tfserve.sequence_index": index, **phase_attributes})
                span.end(end_time=to_ns(end))
        root.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporters."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _phases(output: Any) -> list[tuple[str, float, float, dict]]:
    """(name, start, end, attributes) of a finished sequence's queue, prefill and decode, in perf seconds;
    a phase the sequence never reached (aborted while queued) is left out."""
    metrics = output.metrics
    if metrics is None:
        return []
    arrival = metrics.arrival_time
    scheduled = None if metrics.queue_s is None else arrival + metrics.queue_s
    first_token = None if metrics.ttft_s is None else arrival + metrics.ttft_s
    finished = None if metrics.e2e_s is None else arrival + metrics.e2e_s
    phases = [
        ("queue", arrival, scheduled, {"tfserve.num_preemptions": metrics.num_preemptions}),
        ("prefill", scheduled, first_token, {"gen_ai.usage.input_tokens": len(output.prompt_token_ids),
                                             "tfserve.num_cached_tokens": metrics.num_cached_tokens}),
        ("decode", first_token, finished, {"gen_ai.usage.output_tokens": len(output.generated_tokens),
                                           "tfserve.num_preemptions": metrics.num_preemptions}),
    ]
    return [phase for phase in phases if phase[1] is not None and phase[2] is not None]
