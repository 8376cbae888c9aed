"""The `mcpServers` JSON format (Claude Desktop, Cursor, huggingface_hub tiny-agents) and the
`--mcp-allow-url` rule. Pure parsing: nothing here starts a process or opens a socket."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

# Labels travel in requests as `server_label`; keep them to what a URL path or a log line takes as is.
LABEL_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HTTP_TYPES = {"http": "streamable_http", "streamable-http": "streamable_http", "streamableHttp": "streamable_http",
              "streamable_http": "streamable_http", "sse": "sse"}


@dataclass(frozen=True, slots=True)
class StdioServerConfig:
    """A server tfserve starts as a subprocess and talks to over stdin/stdout."""

    label: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # merged over the SDK's safe default environment
    cwd: str | None = None


@dataclass(frozen=True, slots=True)
class HttpServerConfig:
    """A server already running somewhere, reached over streamable HTTP or the older SSE transport."""

    label: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    transport: Literal["streamable_http", "sse"] = "streamable_http"


McpServerConfig = StdioServerConfig | HttpServerConfig


def load_mcp_config(path: str | Path) -> dict[str, McpServerConfig]:
    """Read an `mcpServers` JSON file; a `ValueError` names the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read the MCP config: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from e
    try:
        return parse_mcp_config(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def parse_mcp_config(data: Any) -> dict[str, McpServerConfig]:
    """Parse `{"mcpServers": {label: {...}}}` into configs keyed by label, in file order.

    A server with `"disabled": true` is skipped (Cline's key); other unknown keys are ignored, since each
    client adds its own. Every mistake is a `ValueError` naming its JSON path, e.g. `mcpServers.weather.args[1]`.
    """
    if not isinstance(data, dict) or "mcpServers" not in data:
        raise ValueError('expected a JSON object with an "mcpServers" key: {"mcpServers": {"name": {...}}}')
    servers = _expect(data["mcpServers"], dict, "mcpServers", "an object of servers by name")
    configs: dict[str, McpServerConfig] = {}
    for label, entry in servers.items():
        where = f"mcpServers.{label}"
        if not LABEL_PATTERN.match(label):
            raise ValueError(f"{where}: a server name takes 1-64 letters, digits, '_', '-' or '.'")
        entry = _expect(entry, dict, where, "an object with a command or a url")
        if entry.get("disabled") is True:
            continue
        configs[label] = _parse_server(label, entry, where)
    return configs


def _parse_server(label: str, entry: dict, where: str) -> McpServerConfig:
    kind = entry.get("type", entry.get("transport"))
    if kind is not None and kind != "stdio" and kind not in HTTP_TYPES:
        raise ValueError(f"{where}.type: {kind!r} is not one of 'stdio', 'http', 'streamable-http', 'sse'")
    if "command" in entry and "url" in entry:
        raise ValueError(f"{where}: give either a command (stdio) or a url (HTTP), not both")
    if "command" in entry:
        if kind is not None and kind != "stdio":
            raise ValueError(f"{where}.type: {kind!r} needs a url, not a command")
        command = _expect(entry["command"], str, f"{where}.command", "a string")
        if not command.strip():
            raise ValueError(f"{where}.command: must not be empty")
        cwd = entry.get("cwd")
        if cwd is not None:
            _expect(cwd, str, f"{where}.cwd", "a string")
        return StdioServerConfig(label=label, command=command, args=_parse_args(entry.get("args", []), where),
                                 env=_parse_str_map(entry.get("env", {}), f"{where}.env"), cwd=cwd)
    if "url" in entry:
        url = _expect(entry["url"], str, f"{where}.url", "a string")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{where}.url: {url!r} is not an http:// or https:// URL")
        if kind == "stdio":
            raise ValueError(f"{where}.type: 'stdio' needs a command, not a url")
        transport = HTTP_TYPES[kind] if kind else transport_for_url(url)
        headers = _parse_str_map(entry.get("headers", {}), f"{where}.headers")
        return HttpServerConfig(label=label, url=url, headers=headers, transport=transport)
    raise ValueError(f"{where}: needs a \"command\" (a stdio server) or a \"url\" (an HTTP server)")


def transport_for_url(url: str) -> Literal["streamable_http", "sse"]:
    """The transport a URL implies when none is named: SSE for a path ending in `/sse`, as clients guess it."""
    return "sse" if urlsplit(url).path.rstrip("/").endswith("/sse") else "streamable_http"


def _parse_args(value: Any, where: str) -> tuple[str, ...]:
    args = _expect(value, list, f"{where}.args", "a list of strings")
    for i, arg in enumerate(args):
        _expect(arg, str, f"{where}.args[{i}]", "a string")
    return tuple(args)


def _parse_str_map(value: Any, where: str) -> dict[str, str]:
    mapping = _expect(value, dict, where, "an object of strings")
    for key, item in mapping.items():
        _expect(item, str, f"{where}.{key}", 'a string (quote numbers: "8080")')
    return dict(mapping)


def _expect(value: Any, kind: type, where: str, what: str) -> Any:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {what}, got {json.dumps(value)[:60]}")
    return value


def url_allowed(url: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """Whether a request may connect to `url` under `--mcp-allow-url` glob patterns; no patterns refuse all.

    A pattern is matched against the whole URL, but in two parts so a `*` in the host cannot reach into the
    path: `https://*.example.com/*` allows `https://a.example.com/mcp`, never
    `https://evil.test/x.example.com/mcp`. The pattern `*` alone allows every http(s) URL. URLs with
    credentials (`user@host`), other schemes or control characters are always refused.
    """
    url = normalize_url(url)  # what is matched is what is sent: `/mcp/../admin` is `/admin`
    if url is None:
        return False
    origin, rest = _split_url(url)
    for pattern in patterns:
        if pattern == "*":
            return True
        pattern_origin, pattern_rest = _split_url(pattern)
        if pattern_origin is None:
            continue
        pattern_origin = _without_default_port(pattern_origin.lower())
        if fnmatch.fnmatchcase(origin, pattern_origin) and fnmatch.fnmatchcase(rest, pattern_rest):
            return True
    return False


_UNRESERVED = re.compile(r"%(2[dDeE]|3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]|5[fF]|7[eE])")  # - . 0-9 A-Z _ a-z ~
_ENCODED = re.compile(r"%([0-9a-fA-F]{2})")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str | None:
    """`url` the way an HTTP client sends it (RFC 3986 normalisation): lowercase scheme and host, no default port,
    unreserved characters percent-decoded, dot segments resolved, no fragment. None for a URL a request may not
    name: not http(s), with credentials, control characters or spaces, a bad escape, or an encoded `/` or `\\` in
    the path (which servers disagree about)."""
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        return None
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a bad port, a bad IPv6 literal
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not host or "@" in parts.netloc or "%" in host or "\\" in url:
        return None
    try:
        host = host.rstrip(".").encode("idna").decode("ascii") if not host.isascii() else host.rstrip(".")
    except UnicodeError:
        return None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    path, query = parts.path, parts.query
    if "%" in path + query and (len(_ENCODED.findall(path + query)) != (path + query).count("%")
                                or re.search(r"%(2f|5c)", path, re.IGNORECASE)):
        return None
    path = _remove_dot_segments(_UNRESERVED.sub(lambda m: chr(int(m.group(1), 16)), path)) or "/"
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _without_default_port(origin: str) -> str:
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if origin.startswith(scheme) and origin.endswith(port):
            return origin[:-len(port)]
    return origin


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4: `/a/./b/../c` -> `/a/c`; a `..` above the root stays at the root."""
    out: list[str] = []
    segments = path.split("/")
    for i, segment in enumerate(segments):
        if segment == "..":
            if len(out) > 1:
                out.pop()
            if i == len(segments) - 1:
                out.append("")
        elif segment == ".":
            if i == len(segments) - 1:
                out.append("")
        else:
            out.append(segment)
    return "/".join(out)


def _split_url(url: str) -> tuple[str | None, str]:
    """`https://host:port/path?q` -> (`https://host:port`, `/path?q`); (None, "") without a scheme."""
    scheme_end = url.find("://")
    if scheme_end <= 0:
        return None, ""
    cut = len(url)
    for delimiter in "/?#":
        found = url.find(delimiter, scheme_end + 3)
        if found != -1:
            cut = min(cut, found)
    return url[:cut], url[cut:]
