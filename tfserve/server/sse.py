"""Server-sent events: `data: {json}\\n\\n` chunks (with `event:` lines for the Responses API) and the
closing `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tfserve.server.errors import ApiError

# request[EVENT_STREAM]: the request's event stream, once its handler made one
EVENT_STREAM = web.RequestKey("tfserve_event_stream", object)


class EventStream:
    """One SSE response. `open()` sends the headers; a write to a client that left raises
    ConnectionResetError, which ends the handler (and so aborts its generation); the app's error middleware
    then ends this response quietly (`request[EVENT_STREAM]`)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # nginx would otherwise buffer the whole stream
        })
        request[EVENT_STREAM] = self

    @property
    def is_open(self) -> bool:
        return self.response.prepared

    async def open(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def send(self, data: dict[str, Any], event: str | None = None) -> None:
        await self.open()
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        head = f"event: {event}\n" if event else ""
        await self.response.write(f"{head}data: {payload}\n\n".encode())

    async def send_error(self, error: ApiError) -> None:
        """An error after the stream began: the status is already 200, so the body says it."""
        await self.send(error.body())

    async def done(self) -> web.StreamResponse:
        await self.open()
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def close(self) -> web.StreamResponse:
        await self.open()
        await self.response.write_eof()
        return self.response
