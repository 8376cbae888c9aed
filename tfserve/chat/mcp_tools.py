"""MCP tools for the chat: `McpToolbox` runs an `McpServers` manager on a private event loop in a daemon
thread (the chat itself is synchronous) and offers the servers' tools as OpenAI function tools, under names
that are unique across servers."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from tfserve.mcp.config import McpServerConfig

if TYPE_CHECKING:  # the SDK behind tfserve.mcp.client is imported only once a chat has MCP servers
    from tfserve.mcp.client import McpCallResult, McpTool

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 64  # OpenAI's limit on a function name, which also takes only [A-Za-z0-9_-]
CLOSE_TIMEOUT_S = 15.0  # every server's close is bounded (10 s) by the manager; a little on top


@dataclass(frozen=True, slots=True)
class ChatTool:
    """One MCP tool as the model sees it: `name` is unique across the servers (`label__tool` on a clash)."""

    name: str
    label: str  # the server's label in the config
    tool: McpTool

    def to_openai(self) -> dict[str, Any]:
        schema = self.tool.input_schema or {}
        parameters = schema if schema.get("type") == "object" else {"type": "object", "properties": {}}
        return {"type": "function", "function": {"name": self.name, "description": self.tool.description or "",
                                                 "parameters": parameters}}


def function_names(tools_by_label: dict[str, tuple[McpTool, ...]]) -> dict[str, ChatTool]:
    """{OpenAI function name: ChatTool}: a tool keeps its own name unless another server has one alike, then it is
    `label__name`; characters OpenAI refuses become `_`, and a name still taken gets a `_2`, `_3`... suffix."""
    counts = Counter(tool.name for tools in tools_by_label.values() for tool in tools)
    named: dict[str, ChatTool] = {}
    for label, tools in tools_by_label.items():
        for tool in tools:
            wanted = tool.name if counts[tool.name] == 1 else f"{label}__{tool.name}"
            base = re.sub(r"[^A-Za-z0-9_-]", "_", wanted)[:MAX_NAME_CHARS] or "tool"
            name, n = base, 2
            while name in named:
                suffix = f"_{n}"
                name, n = base[:MAX_NAME_CHARS - len(suffix)] + suffix, n + 1
            named[name] = ChatTool(name, label, tool)
    return named


class McpToolbox:
    """The chat's MCP servers. `start()` once, then `openai_tools()` for each request and `call()` for each call
    the model makes; `close()` stops every stdio server (the CLI calls it on every way out)."""

    def __init__(self, configs: dict[str, McpServerConfig], *, timeout_s: float = 60.0,
                 max_output_bytes: int = 64 * 1024, errlog: TextIO | None = None) -> None:
        from tfserve.mcp.client import McpServers

        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.servers = McpServers(configs, errlog=errlog)
        self.errors: dict[str, str] = {}  # label -> why it failed to start or list its tools, for /tools
        self.tools: dict[str, ChatTool] = {}
        self._listed: dict[str, tuple[McpTool, ...]] = {}  # label -> its last tool list
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="tfserve-mcp", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run `coro` on the MCP loop and wait; Ctrl-C cancels it there and is raised here."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except KeyboardInterrupt:
            future.cancel()
            raise

    def start(self) -> dict[str, str]:
        """Start every server and list its tools; {label: error} for those that failed (the others work)."""
        self.errors = dict(self._run(self.servers.start()))
        self.refresh()
        return dict(self.errors)

    def refresh(self, *, retry: bool = False) -> None:
        """Re-list the tools of the running servers (cached by the manager until a server says they changed). A
        server that is down keeps its last list (a call restarts it); `retry` starts it again now (/tools)."""
        from tfserve.mcp.client import McpError

        status = self.servers.status()
        for label in self.servers.labels:
            if status[label] != "running" and not retry:
                continue
            try:
                self._listed[label] = self._run(self.servers.list_tools(label))
                self.errors.pop(label, None)
            except McpError as exc:
                self.errors[label] = str(exc)
                if not retry:  # /tools, which retries, shows it in its table
                    logger.warning("%s", exc)
        self.tools = function_names({label: self._listed[label] for label in self.servers.labels
                                     if label in self._listed})

    def openai_tools(self) -> list[dict[str, Any]]:
        """Every tool, fresh, as an OpenAI function tool: what each chat request offers."""
        self.refresh()
        return [tool.to_openai() for tool in self.tools.values()]

    def status(self) -> dict[str, str]:
        """Each server's state: "running", "stopped" (a call restarts it) or "not started"."""
        return self.servers.status()

    def call(self, tool: ChatTool, arguments: dict[str, Any]) -> McpCallResult:
        """Run one call; an McpCallResult whatever happens (never raises, except Ctrl-C, which cancels it)."""
        return self._run(self.servers.call_tool(tool.label, tool.tool.name, arguments, timeout_s=self.timeout_s,
                                                max_output_bytes=self.max_output_bytes))

    def close(self) -> None:
        """Close every connection, stop every stdio server, then the loop; safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            self._run(self.servers.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.warning("MCP servers did not close within %g s", CLOSE_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_TIMEOUT_S)
