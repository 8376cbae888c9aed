"""The `--mcp-allow-url` rule: off by default, globs over the whole URL, no host-glob escapes."""

from __future__ import annotations

import pytest

from tfserve.mcp.config import url_allowed


@pytest.mark.parametrize("url, patterns, allowed", [
    ("https://mcp.example.com/mcp", [], False),  # no patterns: refuse all
    ("https://mcp.example.com/mcp", ["https://mcp.example.com/mcp"], True),
    ("https://mcp.example.com/mcp", ["https://mcp.example.com/*"], True),
    ("https://MCP.Example.com/mcp", ["https://mcp.example.com/*"], True),  # hosts are case-insensitive
    ("https://mcp.example.com/mcp", ["http://mcp.example.com/*"], False),  # scheme is part of the match
    ("https://a.example.com/mcp", ["https://*.example.com/*"], True),
    ("https://evil.test/x.example.com/mcp", ["https://*.example.com/*"], False),  # `*` in the host stays there
    ("https://evil.test?.example.com/", ["https://*.example.com/*"], False),
    ("https://user@a.example.com/mcp", ["https://*.example.com/*"], False),  # credentials: always refused
    ("http://127.0.0.1:8123/mcp", ["http://127.0.0.1:*/*"], True),
    ("http://127.0.0.1:8123/mcp", ["http://localhost:*/*"], False),
    ("https://anything.test/mcp", ["*"], True),
    ("file:///etc/passwd", ["*"], False),  # never a non-http scheme
    ("https://a.example.com/mcp\n", ["*"], False),
])
def test_url_allowed(url, patterns, allowed):
    assert url_allowed(url, patterns) is allowed
