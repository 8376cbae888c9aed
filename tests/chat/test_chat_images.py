"""Images in the terminal chat: `/image PATH` and a path dropped into the prompt (quoted, escaped or bare) become
an `image_url` data-URL part of the next message, as a fake OpenAI-compatible server receives it; in-process, a
text model refuses in one line and a vision model answers."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler

import pytest
from PIL import Image

from tiny import FakeHandler, FakeHTTPServer, run_keys

from tfserve.chat.client import RemoteBackend
from tfserve.chat.conversation import Conversation, Settings
from tfserve.chat.images import dropped_images, path_of
from tfserve.chat.session import ChatSession


class FakeServer(FakeHTTPServer):
    """An OpenAI-compatible server that records each chat request's body and streams "ok" back."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        bodies = self.bodies

        class Handler(FakeHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_json(200, {"object": "list", "data": [
                    {"id": "fake-vlm", "object": "model", "created": 0, "owned_by": "test"}]})

            def do_POST(self) -> None:
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake-vlm"}
                events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                                 "finish_reason": None}]},
                          {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
                sse = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
                self.send(200, "text/event-stream", sse.encode())

        super().__init__(Handler)

    def images(self, index: int = -1) -> list[bytes]:
        """The image bytes of the last user message of request `index`, in order."""
        content = [m for m in self.bodies[index]["messages"] if m["role"] == "user"][-1]["content"]
        urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
        assert all(url.startswith("data:image/png;base64,") for url in urls)
        return [base64.b64decode(url.partition(",")[2]) for url in urls]

@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture
def session(fake, console):
    return ChatSession(RemoteBackend(fake.url).connect(), console, settings=Settings(temperature=0))


def png(path, size=(4, 3)) -> bytes:
    Image.new("RGB", size, (10, 200, 30)).save(path, format="PNG")
    return path.read_bytes()


def test_slash_image_attaches_to_the_next_message_only(session, fake, tmp_path):
    raw = png(tmp_path / "cat.png")
    out = run_keys(session, f"/image {tmp_path / 'cat.png'}\r/image\rWhat is it?\rAnd now?\r/exit\r")
    flat = "".join(line.rstrip() for line in out.splitlines())  # a long path folds at the console's width
    assert "Attached cat.png" in out and str(tmp_path / "cat.png") in flat
    first, second = fake.bodies
    assert first["messages"][-1]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
        {"type": "text", "text": "What is it?"}]
    assert fake.images(0) == [raw]
    assert second["messages"][-1] == {"role": "user", "content": "And now?"}
    assert second["messages"][0] == first["messages"][-1]  # the conversation keeps the image
    assert session.pending_images == []


@pytest.mark.parametrize("typed", ["'{path}' what is this?", '"{path}" what is this?', "{escaped} what is this?",
                                   "what is this? {escaped}", "what is {url} this?"])
def test_a_dropped_path_attaches_the_image(session, fake, tmp_path, typed):
    folder = tmp_path / "my pics"
    folder.mkdir()
    raw = png(folder / "Dog photo.PNG")
    path = folder / "Dog photo.PNG"
    line = typed.format(path=path, escaped=str(path).replace(" ", "\\ "), url=path.as_uri())
    run_keys(session, f"{line}\r/exit\r")
    assert fake.images() == [raw]
    assert fake.bodies[0]["messages"][-1]["content"][-1] == {"type": "text", "text": "what is this?"}


def test_a_message_of_paths_only_waits_for_the_text(session, fake, tmp_path):
    first, second = png(tmp_path / "a.png"), png(tmp_path / "b.png", (2, 2))
    out = run_keys(session, f"{tmp_path / 'a.png'} {tmp_path / 'b.png'}\rcompare them\r/exit\r")
    assert "Unknown command" not in out and "unknown command" not in out
    assert len(fake.bodies) == 1 and fake.images() == [first, second]
    assert fake.bodies[0]["messages"][-1]["content"][-1] == {"type": "text", "text": "compare them"}


def test_bad_attachments_are_one_line_and_nothing_is_sent(session, fake, tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    png(tmp_path / "ok.png")
    out = run_keys(session, f"/image {tmp_path / 'missing.png'}\r/image {tmp_path / 'notes.png'}\r"
                            f"/image {tmp_path / 'ok.png'}\r/image clear\rhello\r/exit\r")
    assert "Error: cannot read" in out and "is not a PNG, JPEG, WebP or GIF image" in out
    assert "Dropped 1 image." in out
    assert fake.bodies[0]["messages"][-1] == {"role": "user", "content": "hello"}
    out = run_keys(session, f"look at {tmp_path / 'notes.png'}\r/exit\r")
    assert "is not a PNG" in out and len(fake.bodies) == 1  # the message was meant with its image


def test_dropped_paths_leave_other_words_alone(tmp_path):
    png(tmp_path / "x.png")
    assert dropped_images("what is 3.png? or cat.png") == ("what is 3.png? or cat.png", [])
    assert dropped_images(f"see {tmp_path / 'x.png'}, please") == (f"see {tmp_path / 'x.png'}, please", [])
    assert dropped_images(f"see {tmp_path / 'x.png'} please") == ("see please", [tmp_path / "x.png"])
    assert path_of("'~/a b.png'").name == "a b.png" and path_of("~/a\\ b.png").name == "a b.png"


def test_a_conversation_with_images_saves_and_loads(session, fake, tmp_path):
    png(tmp_path / "cat.png")
    run_keys(session, f"/image {tmp_path / 'cat.png'}\rhi\r/save {tmp_path / 'chat.json'}\r/exit\r")
    conversation, _ = Conversation.load(tmp_path / "chat.json")
    assert conversation.turns == session.conversation.turns
    assert conversation.turns[0]["content"][0]["type"] == "image_url"


def test_in_process_text_model_refuses_images_in_one_line(async_engine, console, tmp_path):
    from tiny import MODEL_NAME

    from tfserve.chat.local import LocalBackend

    png(tmp_path / "cat.png")
    session = ChatSession(LocalBackend(async_engine.manager, MODEL_NAME), console)
    out = run_keys(session, f"/image {tmp_path / 'cat.png'}\rwhat is it?\r/exit\r")
    assert f"Error: {MODEL_NAME} does not take images" in out
    assert session.conversation.turns == [] and session.unanswered[0]["type"] == "image_url"


def test_in_process_vision_model_answers(console, tmp_path):
    from tiny_vlm import build_llava, build_llava_processor, image_message

    from tfserve.chat.local import LocalBackend
    from tfserve.engine.engine import Engine
    from tfserve.engine.manager import BatchingManager
    from tfserve.images import decode_image

    processor = build_llava_processor()
    engine = Engine(build_llava(processor), processor.tokenizer, processor=processor, num_blocks=64, block_size=8)
    calls = []
    real = engine.render_multimodal

    def render(messages, images, **kwargs):
        calls.append((messages, images))
        return real(messages, images, **kwargs)

    engine.render_multimodal = render
    raw = png(tmp_path / "cat.png", (40, 48))
    session = ChatSession(LocalBackend(BatchingManager(engine), "tiny-llava"), console,
                          settings=Settings(temperature=0, max_tokens=4))
    try:
        out = run_keys(session, f"/image {tmp_path / 'cat.png'}\rwhat is it?\r/exit\r")
    finally:
        session.backend.close()
    assert "Error" not in out and "4 tokens" in out
    ((messages, images),) = calls
    assert messages == image_message("what is it?")
    assert images[0].sha256 == decode_image(raw).sha256 and images[0].image.size == (40, 48)
