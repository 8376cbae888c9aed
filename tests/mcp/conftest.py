"""Real MCP servers for the tests, written with the official SDK: the toy server as a stdio script, and the
same server over streamable HTTP and SSE on free 127.0.0.1 ports in a background thread. No network."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

TOY_SERVER = Path(__file__).with_name("toy_server.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_in_thread(app) -> tuple[str, object]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test MCP server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", (server, thread)


def _stop(handle) -> None:
    server, thread = handle
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def stdio_config() -> dict:
    """An `mcpServers` entry that runs the toy server over stdio with this Python."""
    return {"command": sys.executable, "args": [str(TOY_SERVER)]}


@pytest.fixture
def errlog(tmp_path):
    """Where stdio servers' stderr goes (a real file: the subprocess needs a file descriptor)."""
    with open(tmp_path / "mcp-stderr.log", "w") as f:
        yield f


@pytest.fixture(scope="session")
def http_url() -> str:
    """The toy server over streamable HTTP: its endpoint URL."""
    sys.path.insert(0, str(TOY_SERVER.parent))
    from toy_server import build

    base, handle = _serve_in_thread(build().streamable_http_app())
    yield f"{base}/mcp"
    _stop(handle)


@pytest.fixture(scope="session")
def sse_url() -> str:
    """The toy server over the older SSE transport: its /sse URL."""
    sys.path.insert(0, str(TOY_SERVER.parent))
    from toy_server import build

    base, handle = _serve_in_thread(build().sse_app())
    yield f"{base}/sse"
    _stop(handle)
