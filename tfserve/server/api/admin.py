"""Operators' endpoints that change the running server. GET /admin/replicas: the engine replicas
(`--data-parallel-size`) and what each is doing; POST /admin/replicas {"num_replicas": N}: start or retire
replicas until N run (answered once they do). Guarded by their own key, --admin-key (the API key does not open
them), and off without it (app.py's _auth)."""

from __future__ import annotations

from aiohttp import web

from tfserve.server.body import read_json
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.runtime.state import STATE
from tfserve.serving.autoscale import MAX_REPLICAS
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
    body = await read_json(request)
    count = body.get("num_replicas")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_REPLICAS:
        raise bad_request(f"num_replicas must be an integer from 1 to {MAX_REPLICAS}", param="num_replicas")
    unknown = sorted(set(body) - {"num_replicas"})
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}: only num_replicas", param=unknown[0])
    engine = _replicated(request)
    try:
        return web.json_response(await engine.scale(count))
    except RuntimeError as exc:  # a new replica that failed to start: the ones running go on
        raise ApiError(500, f"scaling to {count} replicas failed: {exc}", code="replica_start_failed") from None
