"""/v1/conversations: OpenAI's Conversations API over an in-memory store, and the `conversation` a response
takes. A conversation is a list of Responses items (messages, calls, their outputs); a response made with
`conversation` reads them before its own input, and its input and output items are added to it when it ends.

    POST   /v1/conversations                          {items?, metadata?} -> the conversation
    GET    /v1/conversations/{id}                     the conversation
    POST   /v1/conversations/{id}                     {metadata} -> the conversation, updated
    DELETE /v1/conversations/{id}                     {"id", "object": "conversation.deleted", "deleted": true}
    GET    /v1/conversations/{id}/items               a page of its items (limit, order, after)
    POST   /v1/conversations/{id}/items               {items} -> the items added, as a list
    GET    /v1/conversations/{id}/items/{item_id}     one item
    DELETE /v1/conversations/{id}/items/{item_id}     the conversation, without the item
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tfserve.server.api.response_items import check_item_id, listing, page
from tfserve.server.errors import ApiError, bad_request
from tfserve.server.protocol import field as body_field
from tfserve.server.protocol import read_json
from tfserve.server.requests.conversations import (ConversationCreateRequest, ConversationItemsRequest,
                                                   ConversationUpdateRequest)
from tfserve.server.runtime.state import STATE
from tfserve.server.runtime.stores import ConversationStore, StoredConversation

def conversation_id(value: Any) -> str | None:
    """The id a Responses body's `conversation` names (an id, or `{"id": ...}`), or None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return body_field(value, "id", str, required=True, param="conversation.id")
    if not isinstance(value, str):
        raise bad_request("conversation must be a conversation id or an object with its id", "conversation")
    return value


def requested(conversation: str | None, store: ConversationStore) -> StoredConversation | None:
    """The stored conversation of the id a Responses request names (`ResponseRequest.conversation`), or None."""
    return None if conversation is None else store.find(conversation, param="conversation")


def _store(request: web.Request) -> ConversationStore:
    return request.app[STATE].conversations


async def create(request: web.Request) -> web.Response:
    typed = ConversationCreateRequest.parse(await read_json(request))
    stored = _store(request).create(typed.stored_items, typed.metadata or {})
    return web.json_response(stored.object())


async def retrieve(request: web.Request) -> web.Response:
    return web.json_response(_store(request).find(request.match_info["conversation_id"]).object())


async def update(request: web.Request) -> web.Response:
    stored = _store(request).find(request.match_info["conversation_id"])
    stored.metadata = ConversationUpdateRequest.parse(await read_json(request)).metadata or {}
    return web.json_response(stored.object())


async def delete(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    _store(request).delete(conversation_id)
    return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def list_items(request: web.Request) -> web.Response:
    stored = _store(request).find(request.match_info["conversation_id"])
    return web.json_response(page(stored.items, request.query))


async def add_items(request: web.Request) -> web.Response:
    stored = _store(request).find(request.match_info["conversation_id"])
    items = ConversationItemsRequest.parse(await read_json(request)).stored_items
    taken = {item["id"] for item in stored.items}
    for i, item in enumerate(items):
        check_item_id(item["id"], f"items[{i}]", taken)
    _store(request).add_items(stored, items)
    return web.json_response(listing(items))


def _item(stored: StoredConversation, item_id: str) -> int:
    for index, item in enumerate(stored.items):
        if item.get("id") == item_id:
            return index
    raise ApiError(404, f"Item with id '{item_id}' not found.", code="not_found")


async def retrieve_item(request: web.Request) -> web.Response:
    stored = _store(request).find(request.match_info["conversation_id"])
    return web.json_response(stored.items[_item(stored, request.match_info["item_id"])])


async def delete_item(request: web.Request) -> web.Response:
    stored = _store(request).find(request.match_info["conversation_id"])
    _store(request).remove_item(stored, _item(stored, request.match_info["item_id"]))
    return web.json_response(stored.object())


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/conversations", create)
    app.router.add_get("/v1/conversations/{conversation_id}", retrieve)
    app.router.add_post("/v1/conversations/{conversation_id}", update)
    app.router.add_delete("/v1/conversations/{conversation_id}", delete)
    app.router.add_get("/v1/conversations/{conversation_id}/items", list_items)
    app.router.add_post("/v1/conversations/{conversation_id}/items", add_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item)
    app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item)
