"""OpenTelemetry through the SDK's in-memory exporters: a request's trace (root + queue/prefill/decode),
the engine's gauges, W3C trace-context propagation, and `--otel` without the extra."""

from __future__ import annotations

import pytest

from tiny import MODEL_NAME, make_state

pytest.importorskip("opentelemetry.sdk")

MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture
def traced(async_engine, start_server):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tfserve.server.runtime.telemetry import Telemetry

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    state = make_state(async_engine)
    state.telemetry = Telemetry(state, tracer_provider, MeterProvider(metric_readers=[reader]))
    yield start_server(state=state), spans, reader
    state.telemetry.shutdown()


def test_a_chat_request_is_a_trace_with_queue_prefill_and_decode(traced):
    live, spans, _ = traced
    reply = live.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                                  extra_body={"ignore_eos": True})
    (root,) = [s for s in spans.get_finished_spans() if s.parent is None]
    assert root.name == "POST /v1/chat/completions"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == MODEL_NAME
    assert root.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["tfserve.num_preemptions"] == 0 and "tfserve.num_cached_tokens" in root.attributes
    children = {s.name: s for s in spans.get_finished_spans() if s.parent is not None}
    assert set(children) == {"queue", "prefill", "decode"}
    assert all(s.parent.span_id == root.context.span_id for s in children.values())
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert root.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time <= root.end_time
    assert prefill.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert "tfserve.num_cached_tokens" in prefill.attributes
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert decode.attributes["tfserve.num_preemptions"] == 0


def test_errors_and_incoming_trace_context(traced):
    live, spans, _ = traced
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    status, _, _ = live.request("POST", "/v1/chat/completions", {"model": "nope", "messages": MESSAGES},
                                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert status == 404
    (root,) = spans.get_finished_spans()
    assert root.attributes["http.response.status_code"] == 404
    assert format(root.context.trace_id, "032x") == trace_id
    live.request("GET", "/health")
    assert len(spans.get_finished_spans()) == 1  # only /v1 requests are traced


def test_engine_gauges_are_otel_metrics(traced):
    _, _, reader = traced
    data = reader.get_metrics_data()
    gauges = {metric.name: metric.data.data_points[0].value
              for resource in data.resource_metrics for scope in resource.scope_metrics for metric in scope.metrics}
    assert set(gauges) == {"tfserve.requests.running", "tfserve.requests.waiting", "tfserve.kv_cache.blocks_used",
                           "tfserve.kv_cache.blocks_total", "tfserve.prefix_cache.hit_rate"}
    assert gauges["tfserve.kv_cache.blocks_total"] == 1024


def test_otel_without_the_extra_names_the_install(monkeypatch, async_engine):
    from tfserve.errors import TfserveError
    from tfserve.server.runtime import telemetry

    monkeypatch.setattr(telemetry, "is_installed", lambda: False)
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    state = make_state(async_engine)
    assert telemetry.from_options(state, otel=False) is None
    with pytest.raises(TfserveError, match=r"pip install 'tfserve\[otel\]'"):
        telemetry.from_options(state, otel=True)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")  # the variables alone only warn
    assert telemetry.from_options(state, otel=False) is None


def test_otel_variables_turn_on_otlp_export(monkeypatch, async_engine):
    from tfserve.server.runtime import telemetry

    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-tfserve")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: never flushed
    state = make_state(async_engine)
    enabled = telemetry.from_options(state, otel=False)
    try:
        assert enabled is not None
        assert enabled.tracer_provider.resource.attributes["service.name"] == "my-tfserve"
    finally:
        enabled.meter_provider.shutdown(timeout_millis=100)
