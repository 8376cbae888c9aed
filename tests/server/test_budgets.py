"""Hostile traffic (issue 43, rows 2, 3 and 9): budgets a request meets before any work is done for it (decoded
pixels over all its images, messages, sequences, grammar compile time, one token's mask time) and bounded
stores (conversations, stored responses). Each attack is refused fast while another client's small chat still
answers within 2 s."""

from __future__ import annotations

import io
import base64
import time

import pytest
from PIL import Image

from bystander import Bystander, PeakRss
from tiny import MODEL_NAME, slow_masks

from tfserve.server.media import MediaOptions
from tfserve.server.runtime.request_limits import RequestLimits

CHAT = "/v1/chat/completions"
MIB = 2**20


def black_png(width: int, height: int) -> str:
    """A data URL of a black greyscale PNG: a few KB that decode to width x height x 3 bytes."""
    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def vision(engine, monkeypatch):
    """The tiny engine taking images (a vision side; the render counts its calls): enough for gather_images."""
    calls = []

    def render_multimodal(messages, images, **kwargs):
        calls.append(images)
        return [1, 2, 3], None

    monkeypatch.setattr(engine, "vision", object())  # input_modalities: text and image
    monkeypatch.setattr(engine, "render_multimodal", render_multimodal, raising=False)
    return calls


def test_the_pixel_budget_is_per_request_and_read_from_the_headers(start_server, vision):
    """Row 2: 8 copies of a 5600x5600 PNG each pass the 32-megapixel per-image cap; together (251 megapixels)
    they are a 400 naming the image that went past --max-request-pixels, before any is decoded."""
    live = start_server()
    url = black_png(5600, 5600)
    body = {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, *[{"type": "image_url", "image_url": {"url": url}}] * 8]}]}
    with Bystander(live), PeakRss() as memory:
        started = time.perf_counter()
        status, _, data = live.request("POST", CHAT, body)
        elapsed = time.perf_counter() - started
    assert status == 400, data
    # the stated cap: decoding the 8 images would take 750 MB; read from their headers, the request costs its body
    assert memory.grown < 200 * MIB, memory.grown
    assert "--max-request-pixels" in data["error"]["message"] and "250.9 megapixels" in data["error"]["message"]
    assert data["error"]["param"] == "messages[0].content[3]"  # the third image passes 64 megapixels
    assert elapsed < 2 and not vision


def test_images_within_the_pixel_budget_are_decoded(start_server, vision):
    live = start_server(state_kwargs={"media": MediaOptions(max_request_pixels=2 * 40 * 30)})
    content = [{"type": "image_url", "image_url": {"url": black_png(40, 30)}}] * 2
    status, _, data = live.request("POST", CHAT, {"model": MODEL_NAME, "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": content}]})
    assert status == 200, data
    assert [image.image.size for image in vision[0]] == [(40, 30)] * 2
    status, _, data = live.request("POST", CHAT, {"model": MODEL_NAME, "max_tokens": 1, "messages": [
        {"role": "user", "content": content + [{"type": "image_url", "image_url": {"url": black_png(1, 1)}}]}]})
    assert status == 400 and data["error"]["param"] == "messages[0].content[2]"


def test_a_chat_of_400k_messages_is_refused_before_it_is_read(server):
    """Row 9: 400,000 tiny messages (13 MB, under the body limit) cost 35 s of a core before their 400."""
    body = {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}] * 400_000}
    with Bystander(server):
        started = time.perf_counter()
        status, _, data = server.request("POST", CHAT, body)
        elapsed = time.perf_counter() - started
    assert status == 400 and data["error"]["param"] == "messages"
    assert "--max-messages" in data["error"]["message"]
    assert elapsed < 10  # ~1.5 s on an idle core: reading and parsing 13 MB of JSON; the rest is never done


def test_responses_input_counts_against_max_messages(start_server):
    live = start_server(state_kwargs={"limits": RequestLimits(max_messages=3)})
    status, _, data = live.request("POST", "/v1/responses", {"model": MODEL_NAME, "max_output_tokens": 1,
                                                              "input": [{"role": "user", "content": "a"}] * 4})
    assert status == 400 and data["error"]["param"] == "input" and "--max-messages" in data["error"]["message"]


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 17}),
    ("/v1/completions", {"prompt": "hi", "n": 17}),
    ("/v1/completions", {"prompt": "hi", "n": 17, "best_of": 17}),
])
def test_n_counts_against_the_sequences_a_request_may_make(server, path, body):
    """Row 9: one n=128 request held another client's chat back by 30 s; n past --max-seqs-per-request is a 400."""
    status, _, data = server.request("POST", path, {"model": MODEL_NAME, "max_tokens": 1, **body})
    assert status == 400 and data["error"]["param"] == "n", data
    assert "--max-seqs-per-request" in data["error"]["message"]
    status, _, data = server.request("POST", path, {"model": MODEL_NAME, "max_tokens": 1, **body, "n": 16,
                                                    **({"best_of": 16} if "best_of" in body else {})})
    assert status == 200 and len(data["choices"]) == 16


def test_a_grammar_slow_to_compile_is_a_400_not_a_stall(server, monkeypatch):
    """Row 9: an alternation of 20,000 words takes about a second to compile (llguidance's fuel does not bound
    validation); past the budget it is a 400 while the compile finishes on its own thread."""
    import random

    from tfserve.server.tools import response_format

    monkeypatch.setattr(response_format, "MAX_COMPILE_S", 0.05)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(12)) for _ in range(20_000)]
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "regex", "regex": "|".join(words)}}
    with Bystander(server):
        status, _, data = server.request("POST", CHAT, body)
    assert status == 400 and data["error"]["code"] == "invalid_grammar", data
    assert "to compile" in data["error"]["message"] and data["error"]["param"] == "response_format"


def test_a_grammar_whose_masks_are_slow_fails_alone(server, monkeypatch):
    """Row 9: a constraint whose mask overruns the step's budget (`(.*a){30}` on a large vocabulary; slowed by
    hand here, the tiny vocabulary masks it in microseconds) is a 400, and the other chats go on."""
    from tfserve.engine import structured

    slow_masks(monkeypatch, 0.2)
    monkeypatch.setattr(structured, "MAX_MASK_S", 0.1)
    body = {"model": MODEL_NAME, "max_tokens": 60, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "regex", "regex": "(.*a){30}"}}
    with Bystander(server):
        status, _, data = server.request("POST", CHAT, body)
    assert status == 400 and data["error"]["code"] == "invalid_grammar", data
    assert "mask took" in data["error"]["message"]


def test_conversations_have_a_byte_budget_and_a_size_cap(start_server):
    """Row 3: 40 posts of 15.6 MB to one conversation were all 200 (624 MB). Now one conversation is capped
    (--max-stored-item-mib) and all of them are held within --max-store-mib, the oldest dropped first."""
    live = start_server(state_kwargs={"limits": RequestLimits(max_store_bytes=2 * MIB,
                                                              max_stored_item_bytes=MIB)})
    big = [{"type": "message", "role": "user", "content": "x" * (300 * 1024)}]
    status, _, first = live.request("POST", "/v1/conversations", {"items": big})
    assert status == 200
    with Bystander(live):  # another client's chats answer within 2 s while the big items come in
        statuses = [live.request("POST", f"/v1/conversations/{first['id']}/items", {"items": big})[0]
                    for _ in range(3)]
    assert statuses == [200, 200, 400]  # a fourth 300 KiB item would take it past 1 MiB
    status, _, data = live.request("POST", f"/v1/conversations/{first['id']}/items", {"items": big})
    assert data["error"]["code"] == "stored_item_too_large" and "--max-stored-item-mib" in data["error"]["message"]
    others = [live.request("POST", "/v1/conversations", {"items": big * 3})[2]["id"] for _ in range(2)]
    assert live.request("GET", f"/v1/conversations/{first['id']}")[0] == 404  # the oldest made room
    assert all(live.request("GET", f"/v1/conversations/{cid}")[0] == 200 for cid in others)
    assert live.state.conversations.num_bytes <= 2 * MIB
    assert metric(live, "tfserve_conversations_bytes") == live.state.conversations.num_bytes
    assert metric(live, "tfserve_conversations") == 2


def test_stored_responses_have_a_byte_budget(start_server):
    live = start_server(state_kwargs={"limits": RequestLimits(max_store_bytes=32 * 1024,
                                                              max_stored_item_bytes=8 * 1024)})
    text = "hello world " * 80  # ~1 KB, 240 tokens: a stored response of a few KB
    ids = [live.request("POST", "/v1/responses", {"model": MODEL_NAME, "input": text, "max_output_tokens": 1})[2]["id"]
           for _ in range(12)]
    assert live.request("GET", f"/v1/responses/{ids[0]}")[0] == 404  # dropped for the newer ones
    assert live.request("GET", f"/v1/responses/{ids[-1]}")[0] == 200
    assert 0 < live.state.responses.num_bytes <= 32 * 1024
    assert metric(live, "tfserve_stored_responses_bytes") == live.state.responses.num_bytes
    # one that could not be kept is refused before it runs (9 KB of input; store false runs it, and the tiny
    # model's context refuses it instead)
    body = {"model": MODEL_NAME, "input": "hello world " * 750, "max_output_tokens": 1}
    status, _, data = live.request("POST", "/v1/responses", body)
    assert status == 400 and data["error"]["code"] == "stored_item_too_large", data
    status, _, data = live.request("POST", "/v1/responses", {**body, "store": False})
    assert data["error"]["code"] == "context_length_exceeded", data


def metric(live, name: str) -> float:
    """A gauge's value as /metrics shows it."""
    text = live.request("GET", "/metrics")[2]
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))
