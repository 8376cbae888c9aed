"""The Responses API's own shapes: `input` items (typed in requests/input_items.py: messages, their `input_image`
parts, `function_call`, `function_call_output`) -> chat messages for the template, its flat function `tools`,
`text.format`, and item references resolved against the stores (stores.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from tfserve.server.errors import bad_request
from tfserve.server.media import ImageRef, content_of
from tfserve.server.chat_prompt import (check_function, check_function_names, refuse_tool_choice_without_tools,
                                         template_arguments)
from tfserve.server.protocol import check_name, check_schema, field, one_of, shorten, text_of
from tfserve.server.requests.input_items import (FunctionCallItem, FunctionCallOutputItem, InputItem, ItemReference,
                                                 McpCallItem, MessageItem, parse_item)
from tfserve.server.runtime.stores import ConversationStore, ResponseStore

def parse_input(items: str | list[InputItem], earlier: list[dict[str, Any]] = (), name: str = "input"
                ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Typed `input` items (or a string; the field `name`, where a body names its items otherwise), their
    references resolved -> chat messages, and the refs of their `input_image` parts in order. A `function_call`
    item becomes an assistant message's tool call (consecutive calls share one message); a
    `function_call_output`, a tool message, which must answer a call made before it here or in the `earlier`
    messages (those of previous_response_id)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], []
    messages: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    calls = {call["id"] for message in earlier for call in message.get("tool_calls") or ()}
    ids: set[str] = set()
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        check_item_id(item.id, where, ids)
        if isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": content_of(item.content, f"{where}.content", images)})
        elif isinstance(item, FunctionCallItem):
            call = _template_call(item.call_id, item.name, item.arguments, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:  # OpenAI's words
                raise bad_request(f"No tool call found for function call output with call_id {item.call_id}.",
                                  f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": text_of(item.output, f"{where}.output")})
        elif isinstance(item, McpCallItem):  # an earlier response's output sent back: the call and what it returned
            messages += mcp_call_messages(item, where)
        elif isinstance(item, ItemReference):  # resolve_references replaces each before
            raise TypeError(f"{where}: an item_reference read before it was resolved")
        # reasoning (chat templates leave earlier turns' thinking out of the prompt) and the MCP approval flow's
        # items (read by mcp_tools) are read past
    return messages, images


def check_item_id(item_id: str | None, where: str, ids: set[str]) -> None:
    """400 for an item id that `ids` (those taken so far) already holds; adds it."""
    if item_id is None:
        return
    if item_id in ids:
        raise bad_request(f"{where}.id {shorten(item_id)} is already the id of another item", f"{where}.id")
    ids.add(item_id)


def mcp_call_messages(item: McpCallItem, where: str) -> list[dict[str, Any]]:
    """An `mcp_call` item -> the assistant's call and the tool message with its output (or error)."""
    call = _template_call(item.id, item.name, item.arguments, where)
    output, error = item.output, item.error
    if output is None and error is not None:
        output = f"Error: {error.get('message') or json.dumps(error)}" if isinstance(error, dict) else f"Error: {error}"
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": output or ""}]


def _template_call(call_id: str, name: str, arguments: str, where: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": template_arguments(arguments, f"{where}.arguments")}}


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools (`{"type": "function", "name", "parameters", ...}`), checked, and
    its `mcp` tools as they are (mcp_tools.split_tools checks them)."""
    tools = field(body, "tools", list, [])
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", where)
        if tool.get("type") == "mcp":
            continue
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type {tool.get('type')!r} is not supported; this server runs function "
                              "and mcp tools", f"{where}.type")
        names.append(check_function(tool, where))
    check_function_names(names)
    if not [tool for tool in tools if tool.get("type") == "function"]:
        refuse_tool_choice_without_tools(body, mcp=any(tool.get("type") == "mcp" for tool in tools))
    return tools


def echo_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the Response object reports them (OpenAI fills in `strict`, true by default, and
    `parameters`)."""
    return [_echo_mcp(tool) if tool.get("type") == "mcp" else
            {"type": "function", "name": tool["name"], "description": tool.get("description"),
             "parameters": tool.get("parameters"), "strict": tool.get("strict", True)} for tool in tools]


def _echo_mcp(tool: dict[str, Any]) -> dict[str, Any]:
    # credentials stay out of the echo (and of the store): OpenAI reports headers as null
    return {**{k: v for k, v in tool.items() if k != "authorization"}, "headers": None}


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat Responses tools -> the chat shape chat templates read (`{"type": "function", "function": {...}}`)."""
    keys = ("name", "description", "parameters")
    return [{"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}} for tool in tools]


def text_format(body: dict[str, Any]) -> dict[str, Any]:
    """`text.format` ({"type": "text"} when absent) and the same as a chat `response_format`, for the grammar."""
    text = field(body, "text", dict, {})
    for key in text:
        if key not in ("format", "verbosity"):
            raise bad_request(f"text.{key} is not a field of text", f"text.{key}")
    one_of(field(text, "verbosity", str, param="text.verbosity"), ("low", "medium", "high"), "text.verbosity")
    fmt = field(text, "format", dict, {"type": "text"}, param="text.format")
    kind = field(fmt, "type", str, required=True, param="text.format.type")
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f"text.format.type must be text, json_object or json_schema (got {kind!r})",
                          "text.format.type")
    if fmt.get("type") == "json_schema":  # flat here; nested under json_schema on chat
        check_name(field(fmt, "name", str, required=True, param="text.format.name"), "text.format.name")
        check_schema(field(fmt, "schema", dict, required=True, param="text.format.schema"), "text.format.schema")
        field(fmt, "strict", bool, param="text.format.strict")  # here, before chat's check names its own field
    return fmt


def as_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def resolve_references(items: str | list[InputItem], *stores: ResponseStore | ConversationStore
                       ) -> str | list[InputItem]:
    """`items` (a request's `input`) with each `item_reference` replaced by the stored item it names (an input or
    output item of a stored response, or an item of a conversation, as OpenAI resolves them), read as the item
    it is in its place; an id none of the `stores` has is a 400."""
    if isinstance(items, str) or not any(isinstance(item, ItemReference) for item in items):
        return items
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            found = next((found for store in stores if (found := store.item(item.id)) is not None), None)
            if found is None:  # OpenAI's words
                raise bad_request(f"Item with id '{item.id}' not found.", f"input[{i}].id")
            item = parse_item(found, f"input[{i}]")
        resolved.append(item)
    return resolved


def page(items: list[dict[str, Any]], query) -> dict[str, Any]:
    """A page of `items` (oldest first) as OpenAI lists them: `limit` (1-100, default 20), `order` (desc, the
    default, or asc) and `after` (the id the page starts after), from a request's `query`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("limit must be an integer in [1, 100]", "limit")
    items = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after names no item here ({after!r})", "after")
        items = items[ids.index(after) + 1:]
    return listing(items[:limit], has_more=len(items) > limit)


def listing(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    """`items` as OpenAI's list objects carry them: with the first and last ids."""
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def input_items(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """A request's `input` (typed, its references resolved) as the Responses API lists it back: each item as
    sent, with an id, message text as parts."""
    if isinstance(items, str):
        items = [parse_item({"type": "message", "role": "user", "content": items}, "input")]
    listed = []
    for typed in items:
        item = {"type": "message", **typed.sent}
        if item["type"] == "message":
            content = item["content"]
            item["content"] = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
            item.setdefault("status", "completed")
        item.setdefault("id", f"{'msg' if item['type'] == 'message' else 'item'}_{uuid.uuid4().hex}")
        listed.append(item)
    return listed
