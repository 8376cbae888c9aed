"""Operators' endpoints that change the running server. GET /admin/replicas: the engine replicas
(`--data-parallel-size`) and what each is doing; POST /admin/replicas {"num_replicas": N}: start or retire
replicas until N run (answered once they do). Guarded by their own key, --admin-key (the API key does not open
them), and off without it (app.py's _auth)."""

from __future__ import annotations

from aiohttp import web

from tfserve.server.protocol import read_json
from tfserve.server.errors import ApiError
from tfserve.server.requests.admin import ReplicasRequest
from tfserve.server.runtime.state import STATE
from tfserve.serving.replicas import ReplicatedEngine


def _replicated(request: web.Request) -> ReplicatedEngine:
    async_engine = request.app[STATE].async_engine
    if not isinstance(async_engine, ReplicatedEngine):
        raise ApiError(400, "this server runs one engine: start it with --data-parallel-size 2 or more to have "
                            "replicas to scale", code="not_replicated")
    return async_engine


async def get_replicas(request: web.Request) -> web.Response:
    """GET /admin/replicas: each replica's state and load, and the autoscaling policy."""
    return web.json_response(_replicated(request).describe())


async def set_replicas(request: web.Request) -> web.Response:
    """POST /admin/replicas {"num_replicas": N}: start or retire replicas until N run."""
    count = ReplicasRequest.parse(await read_json(request)).num_replicas
    engine = _replicated(request)
    try:
        return web.json_response(await engine.scale(count))
    except RuntimeError as exc:  # a new replica that failed to start: the ones running go on
        raise ApiError(500, f"scaling to {count} replicas failed: {exc}", code="replica_start_failed") from None
