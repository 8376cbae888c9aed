"""POST /v1/embeddings, as OpenAI defines it: `input` a string, a list of strings, a list of token ids or a list
of such lists; `encoding_format` float or base64 (little-endian float32, as OpenAI sends it); `dimensions` where
the model was trained for shorter vectors (Matryoshka); `usage`. tfserve's own `truncate: true` cuts inputs
longer than the model takes (else they are a 400). Any other field is a 400: none is ignored silently.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from tfserve.embeddings.encoder import EmbeddingInputError
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import PLACEHOLDER_MODELS, read_json
from tfserve.server.requests.embeddings import EmbeddingRequest
from tfserve.server.runtime.state import STATE

_MAX_TOKEN_ID = 2**31  # larger ids would overflow before the vocabulary check


async def create_embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_available()
    typed = EmbeddingRequest.parse(await read_json(request))
    name = typed.model
    if name in state.model_aliases and not state.embeddings.serves(name):
        raise bad_request(f"{name!r} is a chat model, not an embedding model; this server embeds with "
                          f"{', '.join(map(repr, state.embeddings.loaded)) or 'none (see --embedding-model)'}",
                          "model", code="model_not_supported")
    batcher = state.embeddings.get(None if name in PLACEHOLDER_MODELS else name)
    inputs = parse_input(typed.input, state.embeddings.options.max_inputs)
    encoding, dimensions, truncate = typed.encoding_format or "float", typed.dimensions, bool(typed.truncate)
    max_tokens = state.embeddings.options.max_total_tokens
    if not isinstance(inputs[0], str) and sum(map(len, inputs)) > max_tokens:
        raise _too_many_tokens(sum(map(len, inputs)), max_tokens)
    if isinstance(inputs[0], str) and sum(map(len, inputs)) > max_tokens * 64:  # before tokenizing a huge body
        raise _too_many_tokens(None, max_tokens)
    try:
        result = await batcher.embed(inputs, truncate=truncate, dimensions=dimensions, max_tokens=max_tokens)
    except EmbeddingInputError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None
    return web.json_response({
        "object": "list",
        "model": batcher.name,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(row, encoding)}
                 for i, row in enumerate(result.vectors)],
        "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
    })


def parse_input(value: Any, max_inputs: int) -> list[str] | list[list[int]]:
    """A request's `input` as a list of texts or a list of token id lists; 400 naming what is wrong."""
    if value is None:
        raise bad_request("input is required: a string, a list of strings, or token ids", "input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string, a non-empty list of strings, a list of token ids or a list of "
                          "lists of token ids", "input")
    if _is_ids(value):
        value = [value]
    if len(value) > max_inputs:
        raise bad_request(f"input holds {len(value)} inputs, more than the {max_inputs} one request may hold",
                          "input", code="too_many_inputs")
    if all(isinstance(item, str) for item in value):
        for i, text in enumerate(value):
            if not text:
                raise bad_request(f"input[{i}] is an empty string", "input")
        return value
    for i, item in enumerate(value):
        if not isinstance(item, list) or not item or not _is_ids(item):
            raise bad_request(f"input[{i}] must be a non-empty list of token ids: a list of inputs holds strings "
                              "only, or lists of token ids only", "input")
    return value


def _is_ids(value: list) -> bool:
    return all(type(item) is int and 0 <= item < _MAX_TOKEN_ID for item in value) and bool(value)


def _encode(row, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


def _too_many_tokens(num_tokens: int | None, max_tokens: int) -> ApiError:
    said = f"{num_tokens} tokens" if num_tokens is not None else "too much text"
    return bad_request(f"input holds {said}, more than the {max_tokens} one request may hold; send fewer inputs "
                       "per request", "input", code="too_many_tokens")
