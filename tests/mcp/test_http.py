"""`McpServers` over HTTP: a configured streamable-HTTP server, the older SSE transport, headers sent, and
ad-hoc `server_url`s refused unless an allow pattern matches."""

from __future__ import annotations

import asyncio

import pytest

from tfserve.mcp.client import McpServers, McpUrlRefused
from tfserve.mcp.config import parse_mcp_config


def run(body, servers: McpServers):
    async def main():
        try:
            return await body(servers)
        finally:
            await servers.close()

    return asyncio.run(main())


@pytest.mark.parametrize("transport", ["streamable_http", "sse"])
def test_configured_http_server(transport, request):
    url = request.getfixturevalue("http_url" if transport == "streamable_http" else "sse_url")
    configs = parse_mcp_config({"mcpServers": {"web": {"url": url, "headers": {"X-Team": "blue"}}}})
    assert configs["web"].transport == transport

    async def body(servers):
        assert await servers.start() == {}
        assert "add" in [t.name for t in await servers.list_tools("web")]
        assert (await servers.call_tool("web", "add", {"a": 20, "b": 22})).output == "42"
        assert (await servers.call_tool("web", "header", {"name": "X-Team"})).output == "blue"
        failed = await servers.call_tool("web", "fail", {"message": "nope"})
        assert failed.is_error and "nope" in failed.error
        slow = await servers.call_tool("web", "slow", {"seconds": 30}, timeout_s=0.5)
        assert slow.is_error and "timed out" in slow.error

    run(body, McpServers(configs))


def test_server_url_refused_by_default(http_url):
    async def body(servers):
        with pytest.raises(McpUrlRefused, match="not allowed"):
            await servers.connect_url(http_url)

    run(body, McpServers())


def test_server_url_allowed_by_pattern_with_headers(http_url):
    async def body(servers):
        label = await servers.connect_url(http_url, headers={"Authorization": "Bearer t0ken"})
        assert await servers.connect_url(http_url, headers={"Authorization": "Bearer t0ken"}) == label  # reused
        assert servers.labels == []  # ad-hoc connections are not configured servers
        assert "echo" in [t.name for t in await servers.list_tools(label)]
        got = await servers.call_tool(label, "header", {"name": "authorization"})
        assert got.output == "Bearer t0ken"
        other = await servers.connect_url(http_url, headers={"Authorization": "Bearer other"})
        assert other != label
        assert (await servers.call_tool(other, "header", {"name": "authorization"})).output == "Bearer other"

    run(body, McpServers(allow_url_patterns=("http://127.0.0.1:*/*",)))


def test_unreachable_server_url_is_an_error(http_url):
    from tfserve.mcp.client import McpError

    dead = http_url.rsplit(":", 1)[0] + ":9/mcp"  # the discard port: nothing listens there

    async def body(servers):
        with pytest.raises(McpError, match="could not be reached"):
            await servers.connect_url(dead)

    run(body, McpServers(allow_url_patterns=("*",), connect_timeout_s=5))
