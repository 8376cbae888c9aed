"""POST /v1/embeddings' body, typed: OpenAI's `EmbeddingCreateParams` and tfserve's `truncate`. Any other field is a
400: none is ignored silently. `input` is read by the handler, which knows how many inputs a request may hold."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from tfserve.server.errors import bad_request
from tfserve.server.protocol import one_of
from tfserve.server.requests.base import RequestModel

_FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "truncate"}


class EmbeddingRequest(RequestModel):
    """An embeddings request."""

    input: Any = None
    model: str | None = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    truncate: bool | None = None  # cut inputs longer than the model takes (else they are a 400)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        unknown = sorted(set(body) - _FIELDS) if isinstance(body, dict) else []
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}: /v1/embeddings takes {', '.join(sorted(_FIELDS))}",
                              unknown[0])
        return body

    @model_validator(mode="after")
    def _checks(self) -> EmbeddingRequest:
        one_of(self.encoding_format, ("float", "base64"), "encoding_format")
        if self.dimensions is not None and self.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1 (got {self.dimensions})", "dimensions")
        return self
