"""GET /health: 200 once the model is loaded, 503 while loading or draining (load balancers read the code)."""

from __future__ import annotations

from aiohttp import web

from tfserve.server.errors import ApiError
from tfserve.server.state import STATE


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        state.check_available()
    except ApiError as error:
        return web.json_response({"status": state.status, **error.body()}, status=error.status)
    return web.json_response({"status": "ok", "model": state.model_name,
                              "num_running": state.engine.num_running, "num_waiting": state.engine.num_waiting})
