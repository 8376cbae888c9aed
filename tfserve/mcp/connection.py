"""One live connection to one MCP server, on the official SDK's `mcp.Client`.

The SDK's client is an anyio context manager whose task groups belong to the task that entered it, so each
connection gets an owner task that enters it, keeps it open until `close()`, and exits it; callers in other
tasks send requests through it freely."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TextIO

import anyio
import httpx2  # the SDK's HTTP client (a fork of httpx it depends on)
import mcp_types as types
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tfserve import __version__
from tfserve.mcp.config import HttpServerConfig, McpServerConfig, StdioServerConfig

logger = logging.getLogger(__name__)

CLIENT_INFO = types.Implementation(name="tfserve", version=__version__)
HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)  # the SDK's own defaults: a response stream may idle
CLOSE_TIMEOUT_S = 10.0  # the SDK's stdio shutdown waits 2 s for exit, then 2 s after SIGTERM


class McpConnectError(Exception):
    """A server could not be started or reached."""


class Connection:
    """An open `mcp.Client` for one server, held by an owner task; `dead` once the transport has gone."""

    def __init__(self, config: McpServerConfig, *, on_tools_changed: Callable[[], None],
                 errlog: TextIO | None = None) -> None:
        self.config = config
        self.client: Client | None = None
        self.dead = False
        self._on_tools_changed = on_tools_changed
        self._errlog = errlog
        self._ready: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        """How errors name the server: its label, or its URL for an ad-hoc `server_url`."""
        config = self.config
        return config.url if isinstance(config, HttpServerConfig) and config.label.startswith("url:") else config.label

    async def open(self, timeout_s: float) -> None:
        """Start the server (stdio) or connect (HTTP) and finish the MCP handshake, within `timeout_s`."""
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"mcp:{self.config.label}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            await self.close()
            raise McpConnectError(f"MCP server {self.name!r} did not answer within {timeout_s:g} s") from None
        except asyncio.CancelledError:  # the caller gave up: let the owner task wind down; the next use restarts
            self.dead = True
            self._stop.set()
            self._task.cancel()
            raise
        except Exception as e:
            await self.close()
            verb = "failed to start" if isinstance(self.config, StdioServerConfig) else "could not be reached"
            raise McpConnectError(f"MCP server {self.name!r} {verb}: {describe_error(e)}") from e

    async def close(self) -> None:
        """Close the session and stop the server process; bounded, never raises."""
        self._stop.set()
        if self._task is None or self._task.done():
            return
        if self._ready is not None and not self._ready.done():
            # Still in the handshake, where the stop event is not watched. The SDK's stdio shutdown is
            # shielded and bounded, so cancelling here still stops the process.
            self._task.cancel()
        done, _ = await asyncio.wait({self._task}, timeout=CLOSE_TIMEOUT_S)
        if not done:
            self._task.cancel()
            logger.warning("MCP server %r did not close in %g s; cancelled", self.name, CLOSE_TIMEOUT_S)

    async def _run(self) -> None:
        assert self._ready is not None
        try:
            client = Client(self._transport(), message_handler=self._on_message, client_info=CLIENT_INFO,
                            cache=None)  # tfserve caches tool lists itself, refreshed on list_changed
            async with client:
                self.client = client
                async with anyio.create_task_group() as tg:
                    if client.protocol_version in MODERN_PROTOCOL_VERSIONS:
                        tg.start_soon(self._listen, client)  # 2026+ servers announce changes only to listeners
                    self._ready.set_result(None)
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
        except Exception as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            elif not self._stop.is_set():
                logger.warning("MCP server %r: connection lost: %s", self.name, describe_error(e))
        finally:
            self.client = None
            self.dead = True
            if not self._ready.done():  # cancelled mid-handshake: open() has already given up
                self._ready.cancel()

    async def _listen(self, client: Client) -> None:
        try:
            async with client.listen(tools_list_changed=True) as subscription:
                async for _event in subscription:
                    self._on_tools_changed()
        except Exception as e:  # no listen support is fine: tool lists are then refreshed on demand only
            logger.debug("MCP server %r: no change subscription: %s", self.name, describe_error(e))
            self._on_tools_changed()

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            self._on_tools_changed()
        elif isinstance(message, Exception):
            logger.debug("MCP server %r: transport error: %s", self.name, describe_error(message))

    def _transport(self) -> Any:
        config = self.config
        if isinstance(config, StdioServerConfig):
            params = StdioServerParameters(command=config.command, args=list(config.args), env=dict(config.env),
                                           cwd=config.cwd)
            transport = stdio_client(params, errlog=self._errlog or sys.stderr)
        elif config.transport == "sse":
            transport = sse_client(config.url, headers=dict(config.headers))
        else:
            transport = _streamable_http(config.url, config.headers)
        return _watched(transport, self._on_transport_end)

    def _on_transport_end(self) -> None:
        # A stdio server that died while idle ends its stdout: mark it so the next call restarts it first.
        self.dead = True
        self._on_tools_changed()


@asynccontextmanager
async def _watched(transport: Any, on_end: Callable[[], None]) -> AsyncIterator[Any]:
    async with transport as (read_stream, write_stream):
        yield _WatchedReadStream(read_stream, on_end), write_stream


class _WatchedReadStream:
    """A transport's read stream that calls `on_end` when it ends; everything else is passed through."""

    def __init__(self, stream: Any, on_end: Callable[[], None]) -> None:
        self._stream = stream
        self._on_end = on_end

    def __getattr__(self, name: str) -> Any:  # e.g. `last_context`, which the SDK reads when present
        return getattr(self._stream, name)

    async def receive(self) -> Any:
        try:
            return await self._stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._on_end()
            raise

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _WatchedReadStream:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._stream.__aexit__(*exc_info)


@asynccontextmanager
async def _streamable_http(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport with our headers; it leaves a client it was given open, so close it."""
    async with httpx2.AsyncClient(headers=dict(headers), timeout=HTTP_TIMEOUT) as http_client:
        async with streamable_http_client(url, http_client=http_client) as streams:
            yield streams


def is_connection_closed(error: BaseException) -> bool:
    """Whether an SDK error means the transport is gone (the server died or hung up)."""
    return isinstance(error, MCPError) and error.code == types.CONNECTION_CLOSED


def describe_error(error: BaseException) -> str:
    """One line for an exception, unwrapping the single-member exception groups anyio raises."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
