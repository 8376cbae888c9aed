"""Typed requests: every API's body parsed once, at the edge, into a pydantic model (`Model.parse(body)`)."""

from tfserve.server.requests.base import RequestModel
from tfserve.server.requests.sampling import CommonFields, SamplingRequest, StreamOptions

__all__ = ["CommonFields", "RequestModel", "SamplingRequest", "StreamOptions"]
