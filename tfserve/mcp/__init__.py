"""MCP client side of tfserve: the `mcpServers` config format and the `McpServers` manager (on the official
`mcp` SDK). The SDK is imported only by `tfserve.mcp.client`, so `tfserve.mcp.config` stays cheap to import."""

from tfserve.mcp.config import (
    HttpServerConfig,
    McpServerConfig,
    StdioServerConfig,
    load_mcp_config,
    parse_mcp_config,
    url_allowed,
)

__all__ = [
    "HttpServerConfig",
    "McpServerConfig",
    "StdioServerConfig",
    "load_mcp_config",
    "parse_mcp_config",
    "url_allowed",
]
