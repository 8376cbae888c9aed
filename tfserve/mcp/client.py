"""`McpServers`: the MCP servers tfserve talks to as a client, by label. Tool lists are cached and refreshed on
change; a tool call always ends in a small `McpCallResult` (a timeout, a crash or a huge output included),
never in a hang or an exception."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TextIO

import mcp_types as types

from tfserve.mcp.config import HttpServerConfig, McpServerConfig, normalize_url, transport_for_url, url_allowed
from tfserve.mcp.connection import Connection, McpConnectError, describe_error, is_connection_closed

logger = logging.getLogger(__name__)

MAX_TOOL_PAGES = 100  # a server that paginates forever cannot hang a listing
# McpCallResult.error_code: JSON-RPC codes for what went wrong around a tool (MCP's own request-timeout code first)
TIMED_OUT, UNREACHABLE, CALL_FAILED = -32001, -32000, -32603


class McpError(Exception):
    """An MCP server is unknown, refused, or could not be reached: one readable line."""


class McpUrlRefused(McpError):
    """A request named a `server_url` that no `--mcp-allow-url` pattern allows."""


@dataclass(frozen=True, slots=True)
class McpTool:
    """One tool as a server lists it, in the shape of an OpenAI `mcp_list_tools` entry."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class McpCallResult:
    """What one tool call produced: `output` text, or `is_error` with a one-line `error`."""

    output: str
    is_error: bool = False
    error: str | None = None  # set when is_error: the tool's own message, or what went wrong around it
    truncated: bool = False  # output was cut to max_output_bytes
    # a failure around the tool (JSON-RPC style: -32001 timed out, -32000 server unreachable or crashed, -32603
    # the call failed) rather than the tool's own error result; None for a tool's own error or a success
    error_code: int | None = None


class McpServers:
    """The configured servers plus ad-hoc `server_url` ones, each reached through one cached connection.

    `start()` launches stdio servers and connects HTTP ones; a server that fails then, or dies later, is
    (re)started once by the next call that needs it. `close()` stops every stdio process.
    """

    def __init__(self, configs: dict[str, McpServerConfig] | None = None, *, allow_url_patterns: tuple[str, ...] = (),
                 connect_timeout_s: float = 30.0, max_url_connections: int = 16, errlog: TextIO | None = None) -> None:
        self.configs: dict[str, McpServerConfig] = dict(configs or {})
        self.allow_url_patterns = tuple(allow_url_patterns)
        self.connect_timeout_s = connect_timeout_s
        self.max_url_connections = max_url_connections
        self._errlog = errlog  # where stdio servers' stderr goes; None: ours
        self._connections: dict[str, Connection] = {}
        self._tools: dict[str, tuple[McpTool, ...]] = {}
        self._tools_generation: dict[str, int] = {}  # bumped on each change notice: a stale fetch is not cached
        self._locks: dict[str, asyncio.Lock] = {}
        self._url_labels: OrderedDict[str, None] = OrderedDict()  # ad-hoc labels, least recently used first

    @property
    def labels(self) -> list[str]:
        """The configured servers' labels, in config order."""
        return [label for label in self.configs if not label.startswith("url:")]

    def status(self) -> dict[str, str]:
        """Each configured server's state: "running", "stopped" (died or failed; the next use restarts it),
        or "not started"."""
        states = {}
        for label in self.labels:
            connection = self._connections.get(label)
            states[label] = "not started" if connection is None else "stopped" if connection.dead else "running"
        return states

    async def start(self) -> dict[str, str]:
        """Start or connect every configured server concurrently; returns {label: error} for those that failed."""
        labels = self.labels
        outcomes = await asyncio.gather(*(self._live(label) for label in labels), return_exceptions=True)
        errors = {label: str(o) for label, o in zip(labels, outcomes) if isinstance(o, Exception)}
        for label, error in errors.items():
            logger.warning("%s (retried on first use)", error)
        return errors

    async def connect_url(self, url: str, headers: dict[str, str] | None = None) -> str:
        """Connect to a `server_url` named by a request, if `allow_url_patterns` allow it; returns its label.

        The same URL and headers share one connection; past `max_url_connections` the least recently used closes.
        """
        normalized = normalize_url(url)
        if normalized is None or not url_allowed(normalized, self.allow_url_patterns):
            raise McpUrlRefused(f"server_url {url!r} is not allowed on this server (see --mcp-allow-url)")
        url = normalized  # connected to as matched: what the client sends cannot differ from what was allowed
        headers = dict(headers or {})
        key = hashlib.sha256(json.dumps([url, sorted(headers.items())]).encode()).hexdigest()[:16]
        label = f"url:{key}"
        if label not in self.configs:
            self.configs[label] = HttpServerConfig(label=label, url=url, headers=headers,
                                                   transport=transport_for_url(url))
        self._url_labels[label] = None
        self._url_labels.move_to_end(label)
        while len(self._url_labels) > self.max_url_connections:
            oldest, _ = self._url_labels.popitem(last=False)
            await self._forget(oldest)
        try:
            await self._live(label)
        except McpError:
            await self._forget(label)
            raise
        return label

    async def list_tools(self, label: str, *, refresh: bool = False) -> tuple[McpTool, ...]:
        """The server's tools, cached until it announces a change or `refresh=True`; raises `McpError`.

        The listing gets `connect_timeout_s`, like the handshake."""
        if not refresh and label in self._tools:
            return self._tools[label]
        connection = await self._live(label)
        generation = self._tools_generation.get(label, 0)
        try:
            tools = await asyncio.wait_for(self._fetch_tools(connection), self.connect_timeout_s)
        except Exception as e:
            if is_connection_closed(e):
                connection.dead = True
            raise McpError(f"MCP server {connection.name!r}: listing tools failed: {describe_error(e)}") from e
        if self._tools_generation.get(label, 0) == generation:
            self._tools[label] = tools
        return tools

    async def call_tool(self, label: str, name: str, arguments: dict[str, Any] | None = None, *,
                        timeout_s: float = 60.0, max_output_bytes: int = 64 * 1024) -> McpCallResult:
        """Call one tool; every failure (unknown server, timeout, crash, tool error) is an error result."""
        try:
            connection = await self._live(label)
        except McpError as e:
            return McpCallResult(output="", is_error=True, error=str(e), error_code=UNREACHABLE)
        client = connection.client
        if client is None:
            return McpCallResult(output="", is_error=True, error=f"MCP server {connection.name!r} is not connected",
                                 error_code=UNREACHABLE)
        try:
            async with asyncio.timeout(timeout_s):
                result = await client.call_tool(name, arguments or {})
        except TimeoutError:
            return McpCallResult(output="", is_error=True, error=f"tool {name!r} timed out after {timeout_s:g} s",
                                 error_code=TIMED_OUT)
        except Exception as e:
            if is_connection_closed(e):
                connection.dead = True  # the next call restarts it
                error = f"MCP server {connection.name!r} closed the connection during {name!r} (crashed?)"
                return McpCallResult(output="", is_error=True, error=error, error_code=UNREACHABLE)
            return McpCallResult(output="", is_error=True, error=f"tool {name!r} failed: {describe_error(e)}",
                                 error_code=CALL_FAILED)
        text, truncated = cap_output(result_text(result), max_output_bytes)
        if result.is_error:
            return McpCallResult(output=text, is_error=True, error=text or f"tool {name!r} reported an error",
                                 truncated=truncated)
        return McpCallResult(output=text, truncated=truncated)

    async def close(self) -> None:
        """Close every connection and stop every stdio server."""
        connections, self._connections = list(self._connections.values()), {}
        self._tools.clear()
        await asyncio.gather(*(c.close() for c in connections))

    async def _live(self, label: str) -> Connection:
        """The label's open connection, starting it (once per call) if it never started or has died."""
        if label not in self.configs:
            known = ", ".join(repr(k) for k in self.labels) or "none configured"
            raise McpError(f"no MCP server named {label!r} (known: {known})")
        lock = self._locks.setdefault(label, asyncio.Lock())
        async with lock:  # concurrent calls to a dead server restart it once, not once each
            connection = self._connections.get(label)
            if connection is not None and not connection.dead:
                return connection
            if connection is not None:
                logger.warning("MCP server %r is not running; starting it again", connection.name)
                await connection.close()
            self._tools_changed(label)
            connection = Connection(self.configs[label], errlog=self._errlog,
                                    on_tools_changed=lambda: self._tools_changed(label))
            self._connections[label] = connection
            try:
                await connection.open(self.connect_timeout_s)
            except McpConnectError as e:
                raise McpError(str(e)) from e
            return connection

    def _tools_changed(self, label: str) -> None:
        self._tools.pop(label, None)
        self._tools_generation[label] = self._tools_generation.get(label, 0) + 1

    async def _forget(self, label: str) -> None:
        self._url_labels.pop(label, None)
        self.configs.pop(label, None)
        self._tools.pop(label, None)
        self._locks.pop(label, None)
        connection = self._connections.pop(label, None)
        if connection is not None:
            await connection.close()

    @staticmethod
    async def _fetch_tools(connection: Connection) -> tuple[McpTool, ...]:
        assert connection.client is not None
        tools: list[McpTool] = []
        cursor = None
        for _ in range(MAX_TOOL_PAGES):
            page = await connection.client.list_tools(cursor=cursor)
            tools += [_tool(t) for t in page.tools]
            cursor = page.next_cursor
            if cursor is None:
                break
        return tuple(tools)


def _tool(tool: types.Tool) -> McpTool:
    annotations = tool.annotations.model_dump(exclude_none=True) if tool.annotations else None
    return McpTool(name=tool.name, description=tool.description, input_schema=dict(tool.input_schema),
                   annotations=annotations or None)


def result_text(result: types.CallToolResult) -> str:
    """A tool result as text for the model: text parts as is, other media named, structured content as JSON."""
    parts: list[str] = []
    for item in result.content:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
        elif isinstance(item, types.ImageContent | types.AudioContent):
            parts.append(f"[{item.type}: {item.mime_type}]")
        elif isinstance(item, types.EmbeddedResource):
            resource = item.resource
            text = getattr(resource, "text", None)
            parts.append(text if text is not None else f"[resource: {resource.uri}]")
        elif isinstance(item, types.ResourceLink):
            parts.append(f"[resource link: {item.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def cap_output(text: str, max_output_bytes: int) -> tuple[str, bool]:
    """Cut `text` to `max_output_bytes` of UTF-8 (never mid-character) and say so at the end."""
    data = text.encode("utf-8")
    if len(data) <= max_output_bytes:
        return text, False
    kept = data[:max_output_bytes].decode("utf-8", errors="ignore")
    return f"{kept}\n[output truncated: {len(kept.encode())} of {len(data)} bytes shown]", True
