"""The Responses API's input items, typed: each item of a request's `input` (or of a conversation's `items`)
parsed once into the model of its `type` (`parse_items`), each mistake a 400 naming the item's field
(`input[2].call_id`). An item read back from a store (an `item_reference`'s, a conversation's, a response's
pending approval) goes through the same parse when it is read (`parse_item`), so what reads items reads these
models only. A null field is an absent one, as everywhere in OpenAI's bodies."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import PrivateAttr, field_validator, model_validator

from tfserve.errors import ParamError
from tfserve.server.errors import bad_request
from tfserve.server.protocol import field, json_type
from tfserve.server.requests.base import RequestModel

ROLES = ("system", "developer", "user", "assistant")


def text_or_parts(value: Any, name: str) -> str | list[Any]:
    """`value` of the field `name`, a string or a list of content parts (the parts are read where they are used:
    `media.content_of`, `protocol.text_of`)."""
    if not isinstance(value, (str, list)):
        raise ParamError(name, f"{{{name}}} must be a string or an array, not {json_type(value)}")
    return value


class InputItem(RequestModel):
    """One input item, its fields typed. `sent`: the item as it was sent (or stored), which is what the API lists
    back as the response's input and keeps in a conversation."""

    TYPE: ClassVar[str] = ""

    id: str | None = None

    _sent: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, item: Any) -> Any:
        return {key: value for key, value in item.items() if value is not None} if isinstance(item, dict) else item

    @property
    def sent(self) -> dict[str, Any]:
        """The item as sent: its JSON object, unchanged."""
        return self._sent


class MessageItem(InputItem):
    """A message: `role` (developer is system) and `content`, a string or content parts (read by `content_of`)."""

    TYPE: ClassVar[str] = "message"

    role: str
    content: Any  # a string or content parts

    @field_validator("content")
    @classmethod
    def _check_content(cls, content: Any) -> str | list[Any]:
        return text_or_parts(content, "content")

    @field_validator("role")
    @classmethod
    def _check_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ParamError("role", f"{{role}} must be one of {', '.join(ROLES)} (got {role!r})")
        return role


class FunctionCallItem(InputItem):
    """A call of a client's function the model made, sent back: its `arguments` a JSON string."""

    TYPE: ClassVar[str] = "function_call"

    name: str
    call_id: str
    arguments: str = "{}"


class FunctionCallOutputItem(InputItem):
    """What a client's function returned, answering the call `call_id`."""

    TYPE: ClassVar[str] = "function_call_output"

    call_id: str
    output: Any  # a string or content parts

    @field_validator("output")
    @classmethod
    def _check_output(cls, output: Any) -> str | list[Any]:
        return text_or_parts(output, "output")


class McpCallItem(InputItem):
    """An earlier response's MCP call sent back: the call, and its `output` or `error`."""

    TYPE: ClassVar[str] = "mcp_call"

    id: str
    name: str
    arguments: str = "{}"
    output: str | None = None
    error: Any = None


class ReasoningItem(InputItem):
    """An earlier reply's thinking sent back: read past (chat templates leave earlier turns' thinking out)."""

    TYPE: ClassVar[str] = "reasoning"


class McpListToolsItem(InputItem):
    """An MCP server's tool listing sent back: read past (the server lists its tools itself)."""

    TYPE: ClassVar[str] = "mcp_list_tools"


class McpApprovalRequestItem(InputItem):
    """A call of an MCP tool waiting for the client's approval (an earlier output, sent back or stored)."""

    TYPE: ClassVar[str] = "mcp_approval_request"

    id: str
    server_label: str
    name: str
    arguments: str


class McpApprovalResponseItem(InputItem):
    """The client's answer to an approval request: `approve`, and a `reason` for a declined call."""

    TYPE: ClassVar[str] = "mcp_approval_response"

    approval_request_id: str
    approve: bool
    reason: str | None = None


class ItemReference(InputItem):
    """`{"type": "item_reference", "id"}`: a stored item in its place, resolved against the stores."""

    TYPE: ClassVar[str] = "item_reference"

    id: str


ITEM_TYPES: dict[str, type[InputItem]] = {cls.TYPE: cls for cls in (
    MessageItem, FunctionCallItem, FunctionCallOutputItem, McpCallItem, ReasoningItem, McpListToolsItem,
    McpApprovalRequestItem, McpApprovalResponseItem, ItemReference)}


def parse_items(items: Any, name: str = "input", references: bool = True) -> str | list[InputItem]:
    """`items` (the field `name`: a string, or a list of items) -> the string, or the typed items. `references`:
    whether an `item_reference` may stand among them (a response's input; not a conversation's items)."""
    items = field({name: items}, name, (str, list), required=True)
    if isinstance(items, str):
        return items
    if not items:
        raise bad_request(f"{name} must not be empty", name)
    return [parse_item(item, f"{name}[{i}]", references) for i, item in enumerate(items)]


def parse_item(item: Any, where: str, references: bool = True) -> InputItem:
    """One item (a JSON object, at field `where`) -> the model of its `type` (a message when it has none)."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type")
    kind = "message" if kind is None else kind
    cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or (cls is ItemReference and not references):
        kinds = ["message", "function_call", "function_call_output", "reasoning", "mcp"]
        kinds += ["item_reference"] if references else []
        raise bad_request(f"{where}.type {kind!r} is not supported; send {', '.join(kinds[:-1])} or {kinds[-1]} "
                          "items", f"{where}.type")
    typed = cls.parse(item, where)
    typed._sent = item
    return typed


def sent_items(items: str | list[InputItem]) -> str | list[dict[str, Any]]:
    """The items as they were sent (a string stays one): what a store's size is counted on."""
    return items if isinstance(items, str) else [item.sent for item in items]
