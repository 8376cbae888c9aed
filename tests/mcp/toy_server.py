"""A toy MCP server for the tests, written with the official SDK: `python toy_server.py` serves it over
stdio; `build()` returns it for the streamable-HTTP fixture. Tools cover each path the client handles."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def build() -> MCPServer:
    """The toy server: echo, add, fail, slow, big, crash, grow, header, pick."""
    server = MCPServer("toy", log_level="CRITICAL")  # failing tools on purpose: keep test output quiet

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def fail(message: str) -> str:
        """Fail with this message."""
        raise ToolError(message)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "done"

    @server.tool()
    def big(num_bytes: int) -> str:
        """Return num_bytes of text."""
        return "x" * num_bytes

    @server.tool()
    def crash() -> str:
        """Kill this server process mid-call."""
        os._exit(3)

    @server.tool()
    async def grow(name: str, ctx: Context) -> str:
        """Add a tool called `name` and tell the client the list changed."""
        server.add_tool(lambda: name, name=name, description="added at run time")
        await ctx.notify_tools_changed()
        if ctx.protocol_version and ctx.protocol_version < "2026":  # handshake-era client: a notification
            await ctx.session.send_tool_list_changed()
        return "grown"

    @server.tool()
    def header(name: str, ctx: Context) -> str:
        """The value of one HTTP request header ("" over stdio or when absent)."""
        return (ctx.headers or {}).get(name.lower(), "")

    @server.tool()
    def pick(color: Literal["red", "blue"]) -> str:
        """Pick a colour (a finite choice: even a random-weight model's forced call finishes)."""
        return f"picked {color}"

    return server


if __name__ == "__main__":
    if "--pid-file" in sys.argv:  # lets a test see that a restart started a new process
        with open(sys.argv[sys.argv.index("--pid-file") + 1], "a") as f:
            f.write(f"{os.getpid()}\n")
    build().run("stdio")
