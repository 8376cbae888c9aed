"""The operators' bodies, typed: POST /admin/replicas {"num_replicas": N}. Only its own fields: another is a 400
naming it (an operator's typo must not pass as a no-op)."""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from tfserve.server.errors import bad_request
from tfserve.server.requests.base import RequestModel
from tfserve.serving.autoscale import MAX_REPLICAS


class ReplicasRequest(RequestModel):
    """POST /admin/replicas: `num_replicas`, the replicas to run (1 to MAX_REPLICAS), required."""

    num_replicas: int

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        unknown = sorted(set(body) - {"num_replicas"}) if isinstance(body, dict) else []
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}: only num_replicas", unknown[0])
        return body

    @model_validator(mode="after")
    def _check_count(self) -> ReplicasRequest:
        if not 1 <= self.num_replicas <= MAX_REPLICAS:
            raise bad_request(f"num_replicas must be an integer from 1 to {MAX_REPLICAS} (got {self.num_replicas})",
                              "num_replicas")
        return self
