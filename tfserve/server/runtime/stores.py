"""The server's in-memory stores: stored responses (for `previous_response_id` and GET /v1/responses/{id}) and
conversations (/v1/conversations). Each keeps its newest records within a count and a byte budget (their JSON
size, `--max-store-mib`), dropping the oldest first, and no record past `--max-stored-item-mib`: 40 posts
of 15.6 MB to one conversation grew the server by 624 MB before these budgets."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from tfserve.images import size_text
from tfserve.server.errors import ApiError
from tfserve.server.media import ImageRef
from tfserve.server.runtime.request_limits import DEFAULT_STORE_BYTES, DEFAULT_STORED_ITEM_BYTES


def json_size(value: Any) -> int:
    """Bytes of `value` as JSON, about what it holds in memory (image refs count their URL)."""
    return len(json.dumps(value, default=repr, ensure_ascii=False).encode())


@dataclass(slots=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # the conversation so far, the response's own output included
    model: str
    # MCP calls waiting for an mcp_approval_response: approval request id -> its item (server_label, name, arguments)
    pending_approvals: dict[str, dict[str, Any]] = dataclass_field(default_factory=dict)
    listed: frozenset[str] = frozenset()  # MCP server labels whose tools an mcp_list_tools item already gave
    # the conversation's images as sent (URLs, not pixels), fetched and decoded again by the next turn
    images: list[ImageRef] = dataclass_field(default_factory=list)
    response: dict[str, Any] | None = None  # the Response object as returned, for GET /v1/responses/{id}
    input_items: list[dict[str, Any]] = dataclass_field(default_factory=list)  # this turn's input, with ids

    def num_bytes(self) -> int:
        return json_size([self.messages, self.pending_approvals, [ref.url for ref in self.images], self.response,
                          self.input_items])


class _BoundedStore:
    """The newest records by id, in memory, within `max_records` and `max_bytes`: the oldest (by last write)
    dropped first. `_items_of(record)` names the Responses items a record holds, which `item` looks up by id."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES, max_record_bytes: int = DEFAULT_STORED_ITEM_BYTES,
                 max_records: int = 1000) -> None:
        self.max_bytes = max_bytes
        self.max_record_bytes = max_record_bytes  # one record, at most (`check_fits`)
        self.max_size = max_records
        self.num_bytes = 0  # of every record held
        self._records: OrderedDict[str, Any] = OrderedDict()
        self._sizes: dict[str, int] = {}

    def _put(self, key: str, record: Any, num_bytes: int) -> None:
        self.num_bytes -= self._sizes.get(key, 0)
        self._records[key], self._sizes[key] = record, num_bytes
        self.num_bytes += num_bytes
        self._records.move_to_end(key)
        self._evict()

    def _grow(self, key: str, num_bytes: int) -> None:
        """Record `key` got `num_bytes` bigger (or smaller, below 0): it becomes the newest."""
        self._sizes[key] += num_bytes
        self.num_bytes += num_bytes
        self._records.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while len(self._records) > 1 and (len(self._records) > self.max_size or self.num_bytes > self.max_bytes):
            key, _ = self._records.popitem(last=False)
            self.num_bytes -= self._sizes.pop(key)

    def size_of(self, key: str) -> int:
        """Bytes of record `key` (0 for none)."""
        return self._sizes.get(key, 0)

    def check_fits(self, num_bytes: int, what: str, param: str | None) -> None:
        """A 400 when a record would hold more than `max_record_bytes` (`what` names it, `param` the field)."""
        if num_bytes > self.max_record_bytes:
            raise ApiError(400, f"{what} would hold {size_text(num_bytes)}; this server stores at most "
                                f"{size_text(self.max_record_bytes)} of one (--max-stored-item-mib)", param=param,
                           code="stored_item_too_large")

    def _items_of(self, record: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An item of a record by its id (the newest record first), or None."""
        for record in reversed(self._records.values()):
            for item in self._items_of(record):
                if item.get("id") == item_id:
                    return item
        return None

    def find(self, key: str) -> Any:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        self.find(key)
        del self._records[key]
        self.num_bytes -= self._sizes.pop(key)

    def __len__(self) -> int:
        return len(self._records)


class ResponseStore(_BoundedStore):
    """The newest stored responses (`store` true, OpenAI's default), in memory, for `previous_response_id`:
    oldest dropped first. One past `max_record_bytes` is not kept (`check_fits` refuses it before it runs)."""

    def put(self, response_id: str, stored: StoredResponse) -> None:
        num_bytes = stored.num_bytes()
        if num_bytes <= self.max_record_bytes:
            self._put(response_id, stored, num_bytes)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._records.get(response_id)
        if stored is None:
            raise ApiError(400, f"Previous response with id {response_id!r} not found (this server keeps the last "
                                f"{self.max_size} stored responses, in memory)", param="previous_response_id",
                           code="previous_response_not_found")
        return stored

    def _items_of(self, stored: StoredResponse) -> list[dict[str, Any]]:
        """Its input and output items."""
        return [*stored.input_items, *((stored.response or {}).get("output") or ())]

    def find(self, response_id: str) -> StoredResponse:
        """The stored response `response_id` for its own routes (retrieve, delete, input items); 404 if none."""
        stored = self._records.get(response_id)
        if stored is None:
            raise ApiError(404, f"No response found with id {response_id!r} (this server keeps the last "
                                f"{self.max_size} stored responses, in memory)", code="not_found")
        return stored


@dataclass
class StoredConversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict[str, Any]] = dataclass_field(default_factory=list)  # Responses items with ids, oldest first

    def object(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore(_BoundedStore):
    """The newest conversations (/v1/conversations), in memory: the oldest dropped first. Items are added and
    removed through `add_items` and `remove_item`, which keep the byte count."""

    def create(self, items: list[dict[str, Any]], metadata: dict[str, str]) -> StoredConversation:
        num_bytes = sum(map(json_size, items)) + json_size(metadata)
        self.check_fits(num_bytes, "the conversation", "items")
        stored = StoredConversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata, items)
        self._put(stored.id, stored, num_bytes)
        return stored

    def add_items(self, stored: StoredConversation, items: list[dict[str, Any]], param: str | None = "items",
                  check: bool = True) -> None:
        """Append `items`: a 400 naming `param` past `max_record_bytes` unless not `check` (a response's own
        output, whose input was checked before it ran)."""
        num_bytes = sum(map(json_size, items))
        if check:
            self.check_fits(self.size_of(stored.id) + num_bytes, "the conversation", param)
        stored.items += items
        if stored.id in self._records:  # (dropped meanwhile: nothing to count)
            self._grow(stored.id, num_bytes)

    def remove_item(self, stored: StoredConversation, index: int) -> None:
        item = stored.items.pop(index)
        if stored.id in self._records:
            self._grow(stored.id, -json_size(item))

    def _items_of(self, stored: StoredConversation) -> list[dict[str, Any]]:
        return stored.items

    def find(self, conversation_id: str, param: str | None = None) -> StoredConversation:
        stored = self._records.get(conversation_id)
        if stored is None:  # OpenAI's words
            raise ApiError(404, f"Conversation with id '{conversation_id}' not found.", param=param, code="not_found")
        return stored
