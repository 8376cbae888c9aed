"""Hostile traffic (issue 43): what a client may do to the server below and around a request - connections it
never finishes, stacked encodings, URLs that change meaning once normalised, forged log lines, probing for
files, private addresses behind IPv6 forms, and the admin routes."""

from __future__ import annotations

import asyncio
import errno
import gzip
import logging
import socket
import time

import pytest

from bystander import Bystander
from tiny import MODEL_NAME

from tfserve.server.runtime.connection_limits import ConnectionLimits
from tfserve.server.runtime.connections import quiet_accept_errors

CHAT = "/v1/chat/completions"


def _half_open(port: int, source: str) -> socket.socket:
    """A connection from `source` (another loopback address) that sends half a request's headers and stops."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic")
    return sock


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _health_seconds(live) -> float:
    started = time.monotonic()
    status, _, _ = live.request("GET", "/health")
    assert status == 200
    return time.monotonic() - started


def test_slowloris_connections_are_capped_and_timed_out(start_server):
    limits = ConnectionLimits(header_timeout_s=1.5, max_connections=12, max_connections_per_client=6)
    live = start_server(connection_limits=limits)
    held = []
    try:
        with Bystander(live):  # another client's chats answer within 2 s while one address holds its share
            held += [_half_open(live.port, "127.0.0.2") for _ in range(6)]
            for _ in range(20):  # the attacker keeps trying past its cap
                refused = socket.create_connection(("127.0.0.1", live.port), timeout=5,
                                                   source_address=("127.0.0.2", 0))
                answer = refused.recv(4096)  # past the per-address cap: a 503 and close
                refused.close()
                assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections-per-client" in answer
            assert _health_seconds(live) < 1.0  # another client still gets in
        more = [_half_open(live.port, "127.0.0.3") for _ in range(6)]  # now the server holds its 12
        held += more
        over = socket.create_connection(("127.0.0.1", live.port), timeout=5)
        assert over.recv(4096).startswith(b"HTTP/1.1 503")
        over.close()
        time.sleep(1.8)  # past the header timeout: every half-sent request is closed
        assert all(_closed(sock) for sock in held)
        assert _health_seconds(live) < 1.0
    finally:
        for sock in held:
            sock.close()


def test_a_slow_request_that_finishes_its_headers_is_served(start_server):
    live = start_server(connection_limits=ConnectionLimits(header_timeout_s=1.0))
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)
    sock.sendall(b"\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    time.sleep(0.7)  # a second request on the same connection gets its own deadline
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()


def test_running_out_of_open_files_is_one_log_line(caplog):
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.WARNING, logger="tfserve.server"):
            for _ in range(500):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage() and lines[0].exc_info is None


# -- Content-Encoding ------------------------------------------------------------------------------------------


def test_stacked_content_encodings_are_refused_before_any_inflating(server):
    body = json_bytes({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    for _ in range(200):  # the audit sent 1,600 layers: each one was undone on the event loop
        body = gzip.compress(body, compresslevel=1)
    started = time.monotonic()
    with Bystander(server):  # another client's chats answer within 2 s meanwhile
        status, _, answer = server.request("POST", "/v1/completions", body,
                                           headers={"Content-Encoding": ", ".join(["gzip"] * 200)})
    assert status == 415 and answer["error"]["code"] == "unsupported_content_encoding"
    assert "at most one" in answer["error"]["message"] and time.monotonic() - started < 2.0
    one = gzip.compress(json_bytes({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}))
    assert server.request("POST", "/v1/completions", one, headers={"Content-Encoding": "gzip"})[0] == 200


def json_bytes(value) -> bytes:
    import json

    return json.dumps(value).encode()


# -- --mcp-allow-url --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/mcp/../secret-admin", "/mcp/%2e%2e/secret-admin", "/mcp/./../secret-admin",
                                  "/mcp/%2E%2e/secret-admin", "/mcp%2f..%2fsecret-admin"])
def test_a_server_url_outside_the_allowed_path_never_leaves_the_server(path):
    from aiohttp import web

    from tfserve.mcp.client import McpServers, McpUrlRefused

    seen = []

    async def record(request):
        seen.append((request.path, request.headers.get("Authorization")))
        return web.Response(status=404)

    async def main():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        servers = McpServers(allow_url_patterns=(f"http://127.0.0.1:{port}/mcp/*",), connect_timeout_s=5)
        try:
            with pytest.raises(McpUrlRefused):
                await servers.connect_url(f"http://127.0.0.1:{port}{path}", {"Authorization": "Bearer s"})
        finally:
            await servers.close()
            await runner.cleanup()

    asyncio.run(main())
    assert seen == []


def test_allow_url_patterns_match_the_normalised_url():
    from tfserve.mcp.config import normalize_url, url_allowed

    assert normalize_url("HTTP://MCP.Example.com:80/a/./b/../%7Euser/%41?q=1#frag") == "http://mcp.example.com/a/~user/A?q=1"
    assert url_allowed("https://mcp.example.com:443/mcp/x", ["https://mcp.example.com/mcp/*"])
    assert url_allowed("https://mcp.example.com/mcp/x", ["https://mcp.example.com:443/mcp/*"])
    assert not url_allowed("https://mcp.example.com/mcp/../admin", ["https://mcp.example.com/mcp/*"])
    assert not url_allowed("https://mcp.example.com/mcp/a%2f..%2f..%2fadmin", ["https://mcp.example.com/mcp/*"])
    assert not url_allowed("https://mcp.example.com/mcp/%zz", ["*"])


# -- the access log ---------------------------------------------------------------------------------------------


def test_a_path_cannot_forge_an_access_log_line(server):
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    access = logging.getLogger("tfserve.access")
    handler, level = Collect(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        forged = "/x%0a05:10:00%20INFO%20tfserve.access:%20POST%20/admin/replicas%20200%20FORGED"
        server.request("GET", forged)
        server.request("GET", "/v1/models%0d%0aFORGED%1b[31m")
        deadline = time.monotonic() + 5
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    forged_lines = [line for line in lines if "FORGED" in line]
    assert len(forged_lines) == 2
    for line in forged_lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert "/x\\n05:10:00 INFO" in forged_lines[0]


# -- image URLs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["64:ff9b::7f00:1", "64:ff9b::808:808", "64:ff9b:1::a00:1", "::127.0.0.1",
                                     "::a00:1", "::ffff:127.0.0.1", "::ffff:0:a00:1", "2002:7f00:1::1",
                                     "2002:c0a8:101::", "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo: 192.0.2.45
                                     "2001:0:a00:1::f7f7:f7f7"])
def test_ipv6_forms_of_private_ipv4_addresses_are_refused(address):
    from tfserve.server.media_fetch import is_public

    assert not is_public(address)


def test_public_ipv6_addresses_still_pass():
    from tfserve.server.media_fetch import is_public

    assert is_public("2606:4700:4700::1111") and is_public("2002:808:808::1") and is_public("8.8.8.8")


def test_image_url_errors_never_print_resolved_addresses():
    from tfserve.images import ImageError
    from tfserve.server.media_fetch import Fetcher

    async def main():
        async with Fetcher((), 1 << 20, 5.0) as fetcher:
            for url in ["http://[64:ff9b::7f00:1]/x.png", "http://[::127.0.0.1]/x.png", "http://localhost:9/x.png"]:
                with pytest.raises(ImageError) as info:
                    await fetcher.fetch(url)
                assert "127.0.0.1" not in str(info.value).replace(url, "") and "::1" not in str(info.value)
                assert "private or reserved" in str(info.value)

    asyncio.run(main())
