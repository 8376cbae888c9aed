"""The one exception handlers raise to answer with an OpenAI error body."""

from __future__ import annotations

from typing import Any

from tfserve.errors import ParamError

# status -> the OpenAI error `type` clients switch on
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An HTTP error with an OpenAI body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}  # sent with the body (Retry-After on a 503 that will pass)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the offending field."""
    return ApiError(400, message, param=param, code=code)


def from_value_error(exc: ValueError, default_param: str | None = None,
                     names: dict[str, str] | None = None) -> ApiError:
    """A 400 from the engine's or SamplingParams' ValueError. A ParamError carries its field (and
    ContextLengthError its code): both named as `names` says the client sent them (max_tokens ->
    max_completion_tokens), in the message too. Any other ValueError names `default_param`."""
    if isinstance(exc, ParamError):
        return ApiError(400, exc.message(names), param=exc.param_for(names), code=exc.code)
    return ApiError(400, str(exc), param=default_param)


# TGI's routes (huggingface_hub's InferenceClient posts text generation to the bare URL, "/"); Ollama's are /api/*
TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})
_TGI_TYPES = {401: "authentication", 429: "overloaded", 503: "overloaded"}


def error_for(path: str, error: ApiError) -> tuple[dict[str, Any], int]:
    """The body and status of `error` in the protocol of the route at `path`: Ollama's `{"error"}`, TGI's
    `{"error", "error_type"}` (a client's mistake is TGI's 422 "validation"), else OpenAI's."""
    if path.startswith("/api/"):
        return {"error": error.message}, error.status
    if path in TGI_PATHS:
        kind = _TGI_TYPES.get(error.status, "generation" if error.status >= 500 else "validation")
        status = 422 if error.status == 400 else error.status
        return {"error": error.message, "error_type": kind}, status
    return error.body(), error.status


def model_not_found(name: str) -> ApiError:
    """The one 404 for a `model` this server does not serve or keep in its store: the same words whatever the name
    is on the server's disk (a file, a folder without config.json, nothing), so a client learns nothing of it."""
    shown = name if len(name) <= 80 else name[:77] + "..."
    return ApiError(404, f"The model {shown!r} does not exist or is not served here; see GET /v1/models",
                    param="model", code="model_not_found")
