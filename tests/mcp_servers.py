"""Real MCP servers for the tests, written with the official SDK (tests/mcp/toy_server.py): as a stdio script, or
served over streamable HTTP / SSE on a free 127.0.0.1 port in a background thread. No network."""

from __future__ import annotations

import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

TOY_SERVER = Path(__file__).parent / "mcp" / "toy_server.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_in_thread(app) -> tuple[str, object]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test MCP server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", (server, thread)


def stop_server(handle) -> None:
    server, thread = handle
    server.should_exit = True
    thread.join(timeout=10)


def toy_stdio_config() -> dict:
    """An `mcpServers` entry that runs the toy server over stdio with this Python."""
    return {"command": sys.executable, "args": [str(TOY_SERVER)]}


@contextmanager
def toy_http_server(transport: str = "streamable_http"):
    """The toy server over streamable HTTP (yields its /mcp URL) or SSE (its /sse URL)."""
    sys.path.insert(0, str(TOY_SERVER.parent))
    from toy_server import build

    server = build()
    app, path = (server.sse_app(), "/sse") if transport == "sse" else (server.streamable_http_app(), "/mcp")
    base, handle = serve_in_thread(app)
    try:
        yield f"{base}{path}"
    finally:
        stop_server(handle)
