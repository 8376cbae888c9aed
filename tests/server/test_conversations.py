"""/v1/conversations through the openai SDK, and responses that go on a conversation (`conversation`)."""

from __future__ import annotations

import openai
import pytest

from tiny import MODEL_NAME


def _prompt_tokens(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_responses_go_on_a_conversation(server, tokenizer):
    client = server.client()
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}],
                                               metadata={"topic": "greeting"})
    assert conversation.object == "conversation" and conversation.metadata == {"topic": "greeting"}
    first = client.responses.create(model=MODEL_NAME, conversation=conversation.id, input="what did I say?",
                                    max_output_tokens=3, temperature=0)
    assert first.conversation.id == conversation.id
    history = [{"role": "user", "content": "hi"}, {"role": "user", "content": "what did I say?"}]
    assert first.usage.input_tokens == _prompt_tokens(tokenizer, history)
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].id == first.output[0].id
    assert items[1].id == client.responses.input_items.list(first.id).data[0].id  # one input, one id

    second = client.responses.create(model=MODEL_NAME, conversation={"id": conversation.id}, input="again",
                                     max_output_tokens=2, temperature=0)
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "again"}]
    assert second.usage.input_tokens == _prompt_tokens(tokenizer, history)
    counted = client.responses.input_tokens.count(model=MODEL_NAME, conversation=conversation.id, input="more")
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "more"}]
    assert counted.input_tokens == _prompt_tokens(tokenizer, history)


def test_conversation_objects_and_items_are_kept_and_dropped(server):
    client = server.client()
    conversation = client.conversations.create()
    assert client.conversations.retrieve(conversation.id).id == conversation.id
    added = client.conversations.items.create(conversation.id, items=[
        {"type": "message", "role": "user", "content": "one"}, {"type": "message", "role": "user", "content": "two"}])
    assert [i.content[0].text for i in added.data] == ["one", "two"]
    one, two = (i.id for i in added.data)
    assert client.conversations.items.retrieve(two, conversation_id=conversation.id).content[0].text == "two"
    page = client.conversations.items.list(conversation.id, limit=1)
    assert [i.id for i in page.data] == [two] and page.has_more  # newest first, as OpenAI lists them
    client.conversations.items.delete(one, conversation_id=conversation.id)
    assert [i.id for i in client.conversations.items.list(conversation.id).data] == [two]
    assert client.conversations.update(conversation.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


@pytest.mark.parametrize("body,status,param", [
    ({"conversation": "conv_nowhere"}, 404, "conversation"),
    ({"conversation": 5}, 400, "conversation"),
    ({"conversation": {"id": "conv_x"}, "previous_response_id": "resp_x"}, 400, "conversation"),
])
def test_a_bad_conversation_is_an_error_naming_it(server, body, status, param):
    code, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": "hi", **body})
    assert code == status and error["error"]["param"] == param


def test_bad_conversation_requests_are_400s(server):
    status, _, error = server.request("POST", "/v1/conversations", {"items": [{"type": "message"}]})
    assert status == 400 and error["error"]["param"] == "items[0].role" and "items[0]" in error["error"]["message"]
    assert server.request("POST", "/v1/conversations", {"metadata": {"k": 5}})[0] == 400
    status, _, conversation = server.request("POST", "/v1/conversations", {})
    assert status == 200
    assert server.request("POST", f"/v1/conversations/{conversation['id']}/items", {})[0] == 400
    assert server.request("GET", f"/v1/conversations/{conversation['id']}/items/nope")[0] == 404


def test_item_ids_are_strings_and_unique(server):
    """An id the client gives is a string, once per conversation (as OpenAI's "Duplicate item found"); an
    item_reference is for a response's input, and the 400 here does not offer it."""
    status, _, error = server.request("POST", "/v1/conversations", {"items": [
        {"type": "message", "role": "user", "content": "a", "id": 5}]})
    assert status == 400 and error["error"]["param"] == "items[0].id"
    note = {"type": "message", "role": "user", "content": "a", "id": "note"}
    status, _, error = server.request("POST", "/v1/conversations", {"items": [note, note]})
    assert status == 400 and error["error"]["param"] == "items[1].id"
    status, _, conversation = server.request("POST", "/v1/conversations", {"items": [note]})
    path = f"/v1/conversations/{conversation['id']}/items"
    status, _, error = server.request("POST", path, {"items": [{**note, "content": "again"}]})
    assert status == 400 and error["error"]["param"] == "items[0].id"
    assert server.request("GET", f"{path}/note")[2]["content"] == [{"type": "input_text", "text": "a"}]
    status, _, error = server.request("POST", path, {"items": [{"type": "item_reference", "id": "note"}]})
    assert status == 400 and "item_reference" not in error["error"]["message"].split("send")[1]
    status, _, error = server.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": [note, note]})
    assert status == 400 and error["error"]["param"] == "input[1].id"


def test_a_request_adds_at_most_20_items(server):
    """OpenAI's cap, on creating a conversation and on adding to one."""
    items = [{"type": "message", "role": "user", "content": f"note {i}"} for i in range(21)]
    status, _, error = server.request("POST", "/v1/conversations", {"items": items})
    assert status == 400 and error["error"]["param"] == "items" and "20" in error["error"]["message"]
    status, _, conversation = server.request("POST", "/v1/conversations", {"items": items[:20]})
    assert status == 200
    path = f"/v1/conversations/{conversation['id']}/items"
    assert server.request("POST", path, {"items": items})[0] == 400
    assert server.request("POST", path, {"items": items[20:]})[0] == 200
    assert len(server.request("GET", f"{path}?limit=100")[2]["data"]) == 21


def test_an_item_reference_may_name_a_conversation_item(server, tokenizer):
    client = server.client()
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "remember"}])
    (item,) = client.conversations.items.list(conversation.id).data
    counted = client.responses.input_tokens.count(model=MODEL_NAME, input=[
        {"type": "item_reference", "id": item.id}, {"role": "user", "content": "ok"}])
    assert counted.input_tokens == _prompt_tokens(tokenizer, [{"role": "user", "content": "remember"},
                                                              {"role": "user", "content": "ok"}])


def test_a_turn_that_references_a_conversation_item_keeps_its_ids_unique(server):
    client = server.client()
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    (item,) = client.conversations.items.list(conversation.id).data
    client.responses.create(model=MODEL_NAME, conversation=conversation.id, max_output_tokens=3,
                            input=[{"type": "item_reference", "id": item.id}])
    ids = [i.id for i in client.conversations.items.list(conversation.id, order="asc").data]
    assert ids[0] == item.id and len(ids) == len(set(ids)) == 2  # the item once, then the reply
    client.conversations.items.delete(item.id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete(item.id, conversation_id=conversation.id)
