"""/v1/conversations' bodies, typed: OpenAI's `ConversationCreateParams` (`items`, `metadata`), an update's
`metadata`, and the `items` added to a conversation. Items are Responses input items, checked as a response's
input is (`response_items.parse_input`), at most MAX_ITEMS a request."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from tfserve.server.api.response_items import input_items, parse_input
from tfserve.server.errors import bad_request
from tfserve.server.protocol import check_metadata
from tfserve.server.requests.base import RequestModel
from tfserve.server.requests.input_items import InputItem, parse_items

MAX_ITEMS = 20  # OpenAI's limit on the items one request adds


class _ItemsRequest(RequestModel):
    items: list[Any] | None = None  # InputItem, parsed

    @field_validator("items")
    @classmethod
    def _check_items(cls, items: list[Any] | None) -> list[InputItem] | None:
        if items and len(items) > MAX_ITEMS:
            raise bad_request(f"items may hold at most {MAX_ITEMS} items at a time (got {len(items)})", "items")
        if not items:
            return items
        typed = parse_items(items, "items", references=False)
        parse_input(typed, name="items")  # a 400 naming the item, as for a response's input
        return typed

    @property
    def stored_items(self) -> list[dict[str, Any]]:
        """The items as a conversation keeps them, with ids given to those that have none."""
        return input_items(self.items) if self.items else []


class ConversationCreateRequest(_ItemsRequest):
    """POST /v1/conversations: `items` to start with (optional) and `metadata`."""

    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, metadata: dict[str, Any] | None) -> dict[str, Any] | None:
        check_metadata(metadata or {})
        return metadata


class ConversationUpdateRequest(ConversationCreateRequest):
    """POST /v1/conversations/{id}: the conversation's new `metadata` (required; null clears it)."""

    @model_validator(mode="before")
    @classmethod
    def _metadata_sent(cls, body: Any) -> Any:
        if isinstance(body, dict) and "metadata" not in body:
            raise bad_request("metadata is required", "metadata")
        return {"metadata": body.get("metadata")} if isinstance(body, dict) else body


class ConversationItemsRequest(_ItemsRequest):
    """POST /v1/conversations/{id}/items: the `items` to add (required)."""

    items: list[Any] | None = Field(None, validate_default=True)

    @model_validator(mode="after")
    def _items_sent(self) -> ConversationItemsRequest:
        if self.items is None:
            raise bad_request("items is required", "items")
        return self
