"""Real MCP servers for the tests (tests/mcp_servers.py): the toy server as a stdio script, and the same server
over streamable HTTP and SSE on free 127.0.0.1 ports in a background thread. No network."""

from __future__ import annotations

import pytest
from mcp_servers import toy_http_server, toy_stdio_config


@pytest.fixture
def stdio_config() -> dict:
    """An `mcpServers` entry that runs the toy server over stdio with this Python."""
    return toy_stdio_config()


@pytest.fixture
def errlog(tmp_path):
    """Where stdio servers' stderr goes (a real file: the subprocess needs a file descriptor)."""
    with open(tmp_path / "mcp-stderr.log", "w") as f:
        yield f


@pytest.fixture(scope="session")
def http_url() -> str:
    """The toy server over streamable HTTP: its endpoint URL."""
    with toy_http_server() as url:
        yield url


@pytest.fixture(scope="session")
def sse_url() -> str:
    """The toy server over the older SSE transport: its /sse URL."""
    with toy_http_server("sse") as url:
        yield url
