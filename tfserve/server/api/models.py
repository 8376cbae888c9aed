"""GET /v1/models and GET /v1/models/{id}: the served model first, then the store's other models, which a
request may name to have them loaded on demand."""

from __future__ import annotations

from aiohttp import web

from tfserve.models import store
from tfserve.server.errors import ApiError
from tfserve.server.runtime.model_names import OPENAI_NAMES
from tfserve.server.runtime.state import STATE


def _model_object(state, name: str) -> dict:
    model = {"id": name, "object": "model", "created": state.created, "owned_by": "tfserve"}
    if state.engine is not None and name == state.model_name:  # the loaded model's, as its engine takes them
        model["input_modalities"] = list(getattr(state.engine, "input_modalities", ["text"]))
    elif name in state.speech.loaded or name in OPENAI_NAMES:
        model["input_modalities"] = ["audio"]
    elif (modalities := store.input_modalities(name)) is not None:  # read from a store model's config
        model["input_modalities"] = modalities
    return model


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = [state.model_name] if state.model_name else []
    names += [name for name in state.models.other_models() if name not in names]
    names += [name for name in state.speech.loaded if name not in names]  # speech models load beside the chat model
    names += [name for name in state.embeddings.loaded if name not in names]
    return web.json_response({"object": "list", "data": [_model_object(state, name) for name in names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    if state.model_name is not None and model_id in state.model_aliases:
        return web.json_response(_model_object(state, state.model_name))
    if model_id in state.speech.loaded or model_id in OPENAI_NAMES or state.embeddings.serves(model_id):
        return web.json_response(_model_object(state, model_id))
    if not state.models.on_demand:
        raise ApiError(404, f"The model {model_id!r} does not exist or is not served here", param="model",
                       code="model_not_found")
    state.models.check_loadable(model_id)  # 404 model_not_found unless the store or HF cache has it
    return web.json_response(_model_object(state, model_id))
