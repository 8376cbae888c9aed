"""MCP tools in a request: OpenAI's `{"type": "mcp", "server_label", "server_url", "allowed_tools",
"require_approval", "headers"}` entries of `tools`, resolved against the operator's servers (--mcp-config) or an
allowed `server_url` (--mcp-allow-url), listed, offered to the model as functions, and called on its behalf.

A request body never starts a process: a label names a configured server, and a URL must match an allow pattern.
Every MCP failure is an OpenAI error body (a server that cannot be listed: 424, as OpenAI answers) or an
`mcp_call` item's error, never an exception that reaches the batch."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import field as body_field

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
DEFAULT_MAX_TOOL_CALLS = 16  # per response, when the request sets no max_tool_calls: a model cannot loop forever


@dataclass(slots=True)
class McpOptions:
    """The server's MCP settings (`tfserve serve --mcp-config/--mcp-allow-url/--mcp-timeout`)."""

    configs: dict[str, Any] = field(default_factory=dict)  # label -> tfserve.mcp config, from --mcp-config
    allow_url_patterns: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES


@dataclass(frozen=True, slots=True)
class ToolFilter:
    """OpenAI's tool filter: a list of names and/or `read_only` (a tool's readOnlyHint annotation)."""

    tool_names: frozenset[str] | None = None
    read_only: bool | None = None

    def matches(self, tool: Any) -> bool:
        if self.tool_names is not None and tool.name not in self.tool_names:
            return False
        if self.read_only is not None:
            return bool((tool.annotations or {}).get("readOnlyHint")) == self.read_only
        return self.tool_names is not None


@dataclass(frozen=True, slots=True)
class McpToolSpec:
    """One `{"type": "mcp"}` entry of a request's `tools`, checked."""

    where: str  # "tools[2]", for errors
    server_label: str
    server_url: str | None
    headers: dict[str, str]
    allowed: ToolFilter | None  # None: every tool of the server
    approval: str | tuple[ToolFilter | None, ToolFilter | None]  # "always" | "never" | (always, never) filters

    def needs_approval(self, tool: Any) -> bool:
        """OpenAI's rule: approval unless "never", or the tool matches the `never` filter (and not `always`)."""
        if isinstance(self.approval, str):
            return self.approval == "always"
        always, never = self.approval
        if always is not None and always.matches(tool):
            return True
        return not (never is not None and never.matches(tool))


def split_tools(tools: list[Any], where: str = "tools", default_approval: str = "always"
                ) -> tuple[list[Any], list[McpToolSpec]]:
    """A request's `tools` -> (the others, as they were; the MCP entries, checked). OpenAI asks for approval
    unless told otherwise (`default_approval`)."""
    others, specs = [], []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            specs.append(_spec(tool, f"{where}[{i}]", default_approval))
        else:
            others.append(tool)
    labels = [spec.server_label for spec in specs]
    for spec in specs:
        if labels.count(spec.server_label) > 1:
            raise bad_request(f"{spec.where}.server_label {spec.server_label!r} is given twice", f"{spec.where}.server_label")
    return others, specs


def _spec(tool: dict[str, Any], where: str, default_approval: str) -> McpToolSpec:
    label = body_field(tool, "server_label", str, required=True, param=f"{where}.server_label")
    url = body_field(tool, "server_url", str, param=f"{where}.server_url")
    for unsupported in ("connector_id", "tunnel_id"):
        if tool.get(unsupported) is not None:
            raise bad_request(f"{where}.{unsupported} is not supported here: name a server of --mcp-config by its "
                              "server_label, or give a server_url", f"{where}.{unsupported}")
    headers = body_field(tool, "headers", dict, {}, param=f"{where}.headers")
    if not all(isinstance(v, str) for v in headers.values()):
        raise bad_request(f"{where}.headers must map names to strings", f"{where}.headers")
    authorization = body_field(tool, "authorization", str, param=f"{where}.authorization")
    if authorization:
        headers = {**headers, "Authorization": f"Bearer {authorization}"}
    allowed = body_field(tool, "allowed_tools", (list, dict), param=f"{where}.allowed_tools")
    approval = body_field(tool, "require_approval", (str, dict), default_approval, param=f"{where}.require_approval")
    if isinstance(approval, str) and approval not in ("always", "never"):
        raise bad_request(f"{where}.require_approval must be always, never or a filter object (got {approval!r})",
                          f"{where}.require_approval")
    if isinstance(approval, dict):
        approval = (_filter(approval.get("always"), f"{where}.require_approval.always"),
                    _filter(approval.get("never"), f"{where}.require_approval.never"))
    return McpToolSpec(where=where, server_label=label, server_url=url, headers=headers,
                       allowed=_filter(allowed, f"{where}.allowed_tools"), approval=approval)


def _filter(value: Any, where: str) -> ToolFilter | None:
    if value is None:
        return None
    if isinstance(value, list):
        value = {"tool_names": value}
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be a list of tool names or a filter object", where)
    names = body_field(value, "tool_names", list, param=f"{where}.tool_names")
    if names is not None and not all(isinstance(n, str) for n in names):
        raise bad_request(f"{where}.tool_names must be strings", f"{where}.tool_names")
    read_only = body_field(value, "read_only", bool, param=f"{where}.read_only")
    return ToolFilter(frozenset(names) if names is not None else None, read_only)


@dataclass(frozen=True, slots=True)
class OfferedTool:
    """One MCP tool the model may call: where it lives and whether a call waits for approval."""

    label: str  # the McpServers label (a configured name, or url:... for a server_url)
    server_label: str  # as the request named the server
    tool: Any  # tfserve.mcp.client.McpTool
    needs_approval: bool


@dataclass(slots=True)
class McpOffer:
    """The MCP tools of one request, by name, and the `mcp_list_tools` items that listed them."""

    tools: dict[str, OfferedTool] = field(default_factory=dict)
    listings: list[dict[str, Any]] = field(default_factory=list)

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools as flat Responses function tools, for the chat template and the tool-call grammar."""
        return [{"type": "function", "name": name, "description": offered.tool.description,
                 "parameters": offered.tool.input_schema or {"type": "object", "properties": {}}}
                for name, offered in self.tools.items()]

    def for_label(self, server_label: str) -> list[str]:
        return [name for name, offered in self.tools.items() if offered.server_label == server_label]


async def resolve(state: Any, specs: list[McpToolSpec], taken_names: set[str]) -> McpOffer:
    """Connect to (or find) each spec's server and list its tools: 400 for a label not configured or a URL not
    allowed, 424 for a server that cannot be reached or listed. `taken_names` are the request's other tools."""
    from tfserve.mcp.client import McpError, McpUrlRefused

    offer = McpOffer()
    if not specs:
        return offer
    servers = state.mcp_servers
    for spec in specs:
        if spec.server_url is not None:
            try:
                label = await servers.connect_url(spec.server_url, spec.headers)
            except McpUrlRefused as exc:
                raise ApiError(400, str(exc), param=f"{spec.where}.server_url", code="mcp_server_url_not_allowed",
                               type="invalid_request_error") from None
            except McpError as exc:
                raise _failed_dependency(spec, exc) from None
        elif spec.server_label in servers.labels:
            label = spec.server_label
        else:
            known = ", ".join(repr(k) for k in servers.labels) or "none: start the server with --mcp-config FILE"
            raise bad_request(f"{spec.where}: no MCP server labelled {spec.server_label!r} is configured on this "
                              f"server (configured: {known}); or give a server_url", f"{spec.where}.server_label",
                              code="mcp_server_not_found")
        try:
            tools = await servers.list_tools(label)
        except McpError as exc:
            raise _failed_dependency(spec, exc) from None
        listed = [t for t in tools if spec.allowed is None or spec.allowed.matches(t)]
        for tool in listed:
            if tool.name in offer.tools or tool.name in taken_names:
                raise bad_request(f"{spec.where}: the tool {tool.name!r} of MCP server {spec.server_label!r} has the "
                                  "name of another tool of this request; narrow it with allowed_tools",
                                  f"{spec.where}.allowed_tools")
            offer.tools[tool.name] = OfferedTool(label, spec.server_label, tool, spec.needs_approval(tool))
        offer.listings.append({
            "id": f"mcpl_{uuid.uuid4().hex}", "type": "mcp_list_tools", "server_label": spec.server_label,
            "tools": [_listed(t) for t in listed], "error": None})
    return offer


def _failed_dependency(spec: McpToolSpec, exc: Exception) -> ApiError:
    # OpenAI answers 424 when it cannot list an MCP server's tools
    return ApiError(424, f"Error retrieving tool list from MCP server {spec.server_label!r}: {exc}",
                    param=spec.where, code="mcp_list_tools_failed", type="external_connector_error")


def _listed(tool: Any) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema,
            "annotations": tool.annotations}


async def call(state: Any, offered: OfferedTool, name: str, arguments: str) -> dict[str, Any]:
    """Run one call; returns the `mcp_call` item's `output`, `error` (OpenAI's error object) and `status`."""
    try:
        parsed = json.loads(arguments or "{}")
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        error = {"type": "mcp_protocol_error", "code": -32602,
                 "message": f"the model's arguments for {name!r} are not a JSON object: {arguments[:200]!r}"}
        return {"output": None, "error": error, "status": "failed"}
    options = state.mcp_options
    result = await state.mcp_servers.call_tool(offered.label, name, parsed, timeout_s=options.timeout_s,
                                               max_output_bytes=options.max_output_bytes)
    if not result.is_error:
        return {"output": result.output, "error": None, "status": "completed"}
    if result.error_code is None:  # the tool's own error result: its content, as OpenAI reports it
        error = {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": result.error}]}
    else:
        error = {"type": "mcp_protocol_error", "code": result.error_code, "message": result.error}
    return {"output": None, "error": error, "status": "failed"}


def error_text(error: dict[str, Any] | None) -> str:
    """An `mcp_call` error as the line the model reads in the tool message."""
    if error is None:
        return ""
    if error.get("type") == "mcp_tool_execution_error":
        return "Error: " + " ".join(part.get("text", "") for part in error.get("content") or [])
    return f"Error: {error.get('message', 'the tool call failed')}"


def mcp_choice(tool_choice: dict[str, Any], offer: McpOffer) -> list[str]:
    """OpenAI's `{"type": "mcp", "server_label", "name"?}` tool_choice: the names of the tools a reply must call
    one of (the named tool, or any tool of that server)."""
    label = body_field(tool_choice, "server_label", str, required=True, param="tool_choice.server_label")
    names = offer.for_label(label)
    if not names:
        raise bad_request(f"tool_choice names the MCP server {label!r}, which is not among the request's mcp tools "
                          "(or has no allowed tools)", "tool_choice.server_label")
    name = body_field(tool_choice, "name", str, param="tool_choice.name")
    if name is None:
        return names
    if name not in names:
        raise bad_request(f"tool_choice names the tool {name!r}, which MCP server {label!r} does not offer "
                          f"(tools: {', '.join(names)})", "tool_choice.name")
    return [name]
