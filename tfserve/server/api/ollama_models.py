"""Ollama's model routes: GET /api/tags (the models a request may name), POST /api/show (one model's details,
template and capabilities), GET /api/ps (the loaded one), GET /api/version, and POST /api/embed (sentence
vectors from the served embedding model)."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from tfserve import __version__
from tfserve.embeddings.encoder import EmbeddingInputError
from tfserve.protocol.chat_template import has_chat_template, reads_tools
from tfserve.server import protocol
from tfserve.server.api.embeddings import parse_input
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.requests.ollama import OllamaEmbedRequest, OllamaShowRequest
from tfserve.server.runtime.state import STATE

# the Ollama API these routes follow (clients compare versions to decide what a server takes); ours beside it
OLLAMA_API_VERSION = "0.12.0"


def add_routes(app: web.Application) -> None:
    """Ollama's model routes on `app`."""
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/embed", embed)


async def use_model(request: web.Request, model: str, state: Any) -> str:
    """The model a typed request names (Ollama's `name:latest` is the name), leased as /v1's requests lease it."""
    return await protocol.use_model(request, model.removesuffix(":latest"), state)


async def version(request: web.Request) -> web.Response:
    """GET /api/version."""
    return web.json_response({"version": OLLAMA_API_VERSION, "tfserve": __version__})


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: the served model first, then those a request may load, then the embedding models."""
    state = request.app[STATE]
    names = [state.model_name] if state.model_name else []
    names += [name for name in state.models.other_models() if name not in names]
    names += [name for name in state.embeddings.loaded if name not in names]
    return web.json_response({"models": [_entry(state, name) for name in names]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded model."""
    state = request.app[STATE]
    if state.engine is None:
        return web.json_response({"models": []})
    entry = {**_entry(state, state.model_name), "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0,
             "context_length": state.engine.max_model_len}
    return web.json_response({"models": [entry]})


async def show(request: web.Request) -> web.Response:
    """POST /api/show: a model's details, template and capabilities; 404 for one not served."""
    state = request.app[STATE]
    name = OllamaShowRequest.parse(await protocol.read_json(request)).model_name
    if state.engine is None or name not in state.model_aliases:
        capability = "embedding" if state.embeddings.serves(name) else "completion"
        if capability == "embedding" or name in state.models.other_models():  # not loaded: what its name says
            entry = _entry(state, name)
            return web.json_response({"modelfile": "", "parameters": "", "template": "", "details": entry["details"],
                                      "modified_at": entry["modified_at"], "model_info": {},
                                      "capabilities": [capability]})
        raise ApiError(404, f"model '{name}' not found")
    engine = state.engine
    entry = _entry(state, state.model_name)
    family = entry["details"]["family"]
    tokenizer = engine.tokenizer
    capabilities = ["completion"]
    if has_chat_template(tokenizer) and reads_tools(tokenizer):
        capabilities.append("tools")
    if "image" in getattr(engine, "input_modalities", ()):
        capabilities.append("vision")
    return web.json_response({
        "modelfile": f"FROM {state.model_spec}\n", "parameters": "", "license": "",
        "template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else "",
        "details": entry["details"], "modified_at": entry["modified_at"], "capabilities": capabilities,
        "model_info": {"general.architecture": family, "general.parameter_count": engine.num_parameters,
                       f"{family}.context_length": engine.max_model_len}})


def _entry(state: Any, name: str) -> dict[str, Any]:
    """A model as /api/tags lists it; the details are the loaded model's own, else left empty."""
    loaded = state.engine is not None and name == state.model_name
    family = state.engine.model_type if loaded else ""
    num_parameters = state.engine.num_parameters if loaded else 0
    details = {"parent_model": "", "format": "gguf" if name.endswith(".gguf") else "safetensors", "family": family,
               "families": [family] if family else None,
               "parameter_size": _readable(num_parameters) if num_parameters else "",
               "quantization_level": str(getattr(state.engine, "dtype", "")).removeprefix("torch.") if loaded else ""}
    created = datetime.fromtimestamp(state.created, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"name": name, "model": name, "modified_at": created, "size": num_parameters * 2,
            "digest": hashlib.sha256(name.encode()).hexdigest(), "details": details}


def _readable(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


async def embed(request: web.Request) -> web.Response:
    """POST /api/embed: `input` (a string or a list of them), `truncate` (default true, as Ollama), `dimensions`
    -> `embeddings`, batched through the served embedding model as /v1/embeddings is."""
    state = request.app[STATE]
    typed = OllamaEmbedRequest.parse(await protocol.read_json(request))
    name = typed.model_name
    batcher = state.embeddings.get(name)  # 404 for a model not served to embed
    inputs = parse_input(typed.input, state.embeddings.options.max_inputs)
    started = time.perf_counter_ns()
    try:
        result = await batcher.embed(inputs, truncate=typed.truncate is not False, dimensions=typed.dimensions,
                                     max_tokens=state.embeddings.options.max_total_tokens)
    except EmbeddingInputError as exc:
        raise bad_request(str(exc), exc.param) from None
    return web.json_response({"model": name, "embeddings": result.vectors.tolist(), "load_duration": 0,
                              "total_duration": time.perf_counter_ns() - started,
                              "prompt_eval_count": result.num_tokens})
