"""GET /v1/models and GET /v1/models/{id}: the model this server serves."""

from __future__ import annotations

from aiohttp import web

from tfserve.server.errors import ApiError
from tfserve.server.state import STATE


def _model_object(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tfserve"}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [_model_object(state, state.model_name)] if state.model_name else []
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    if state.model_name is None or model_id not in state.model_aliases:
        raise ApiError(404, f"The model {model_id!r} does not exist or is not served here", param="model",
                       code="model_not_found")
    return web.json_response(_model_object(state, state.model_name))
