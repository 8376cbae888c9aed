"""The operators' endpoints. GET /health: 200 once the model is loaded (and while another is loaded on
demand), 503 while the first loads, while draining, or when no model is loaded (load balancers read the
code). GET /metrics: Prometheus text."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tfserve.server.errors import ApiError
from tfserve.server.runtime.state import STATE


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        state.check_available()
    except ApiError as error:
        return web.json_response({"status": state.status, **error.body()}, status=error.status,
                                 headers=error.headers)
    engine, loading = state.engine, state.models.loading
    dead = engine.dead_ranks(wait_s=0) if engine is not None else []  # one gone fails the next step: say it now
    if dead:
        error = ApiError(503, f"tensor-parallel {', '.join(dead)} exited: the engine cannot step",
                         code="engine_failed")
        return web.json_response({"status": "failed", **error.body()}, status=503)
    if engine is None and loading is None and state.models.asleep is None and not state.embeddings.alone:
        # asleep: the next request loads it; alone: embedding models serve without a chat model
        error = ApiError(503, "no model is loaded; a request naming one loads it", code="model_not_loaded")
        return web.json_response({"status": "no_model", **error.body()}, status=503)
    # a model being swapped in keeps the server healthy: requests for it wait, they do not fail
    model = state.model_name or next(iter(state.embeddings.loaded), None)
    body = {"status": "ok", "model": model, "loading": loading,
            "num_running": engine.num_running if engine else 0, "num_waiting": engine.num_waiting if engine else 0}
    states = getattr(state.async_engine, "states", None)  # engine replicas (-dp): how many serve
    if callable(states):
        states = states()
        body["replicas"] = {kind: states.count(kind) for kind in ("ready", "retiring", "dead")}
        if "dead" in states:  # the others serve on (200); a replica that died is said here and in the log
            body["status"] = "degraded"
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: the server's Prometheus registry in the text format."""
    registry = request.app[STATE].metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
