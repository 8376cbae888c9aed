"""The `mcpServers` format: what parses, and that every mistake names its JSON path."""

from __future__ import annotations

import json

import pytest

from tfserve.mcp.config import HttpServerConfig, StdioServerConfig, load_mcp_config, parse_mcp_config


def test_claude_desktop_style_config_parses():
    configs = parse_mcp_config({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}},
        "weather": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": "Bearer x"}},
        "legacy": {"url": "https://old.example.com/sse"},
        "typed": {"type": "sse", "url": "https://old.example.com/events"},
        "off": {"command": "nothing", "disabled": True},
    }})
    assert list(configs) == ["files", "weather", "legacy", "typed"]
    assert configs["files"] == StdioServerConfig(
        label="files", command="npx", args=("-y", "@modelcontextprotocol/server-filesystem", "/tmp"),
        env={"DEBUG": "1"})
    assert configs["weather"] == HttpServerConfig(label="weather", url="https://mcp.example.com/mcp",
                                                  headers={"Authorization": "Bearer x"})
    assert configs["legacy"].transport == "sse"
    assert configs["typed"].transport == "sse"


@pytest.mark.parametrize("data, message", [
    ({"servers": {}}, '"mcpServers" key'),
    ({"mcpServers": []}, "mcpServers: expected an object"),
    ({"mcpServers": {"bad name": {"command": "x"}}}, "mcpServers.bad name: a server name"),
    ({"mcpServers": {"weather": "npx"}}, "mcpServers.weather: expected an object"),
    ({"mcpServers": {"weather": {}}}, 'mcpServers.weather: needs a "command"'),
    ({"mcpServers": {"weather": {"command": "x", "args": ["ok", 3]}}}, "mcpServers.weather.args[1]: expected a string"),
    ({"mcpServers": {"weather": {"command": "x", "args": "--flag"}}}, "mcpServers.weather.args: expected a list"),
    ({"mcpServers": {"weather": {"command": ""}}}, "mcpServers.weather.command: must not be empty"),
    ({"mcpServers": {"weather": {"command": "x", "env": {"PORT": 8080}}}},
     "mcpServers.weather.env.PORT: expected a string"),
    ({"mcpServers": {"weather": {"url": "ftp://x/mcp"}}}, "mcpServers.weather.url: 'ftp://x/mcp' is not an http"),
    ({"mcpServers": {"weather": {"url": "https://x/mcp", "headers": {"A": None}}}}, "mcpServers.weather.headers.A"),
    ({"mcpServers": {"weather": {"url": "https://x/mcp", "command": "x"}}}, "not both"),
    ({"mcpServers": {"weather": {"type": "websocket", "url": "wss://x"}}}, "mcpServers.weather.type: 'websocket'"),
    ({"mcpServers": {"weather": {"type": "sse", "command": "x"}}}, "mcpServers.weather.type: 'sse' needs a url"),
])
def test_mistakes_name_their_json_path(data, message):
    with pytest.raises(ValueError) as info:
        parse_mcp_config(data)
    assert message in str(info.value)


def test_load_names_the_file_and_line(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {\n  "a": {"command": "x",}\n}}')
    with pytest.raises(ValueError, match=r"mcp\.json:2:\d+: not valid JSON"):
        load_mcp_config(path)
    path.write_text(json.dumps({"mcpServers": {"a": {"command": 1}}}))
    with pytest.raises(ValueError, match=r"mcp\.json: mcpServers\.a\.command: expected a string"):
        load_mcp_config(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_mcp_config(tmp_path / "missing.json")
