"""Which of a server's models `tfserve chat` chats with: speech-to-text models are never offered, and a
`--model` the server does not serve is refused at start in one line that names the ones it does."""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote

import pytest
from typer.testing import CliRunner

from tiny import FakeHandler, FakeHTTPServer, run_keys

from tfserve.chat.backend import ChatError
from tfserve.chat.client import RemoteBackend
from tfserve.chat.session import ChatSession
from tfserve.cli import app

MODELS = [  # a speech model first, as a server that lists what it loaded may
    {"id": "whisper-tiny.en", "object": "model", "input_modalities": ["audio"]},  # tfserve marks its speech models
    {"id": "chat-one", "object": "model", "input_modalities": ["text"]},
    {"id": "vlm-two", "object": "model", "input_modalities": ["text", "image"]},
    {"id": "whisper-1", "object": "model"},  # OpenAI's: no modalities, known by its name
]
ALIASES = {"/srv/models/chat-one": "chat-one"}  # served under another name too: GET /v1/models/{id} knows it


class ModelsServer(FakeHTTPServer):
    """Answers GET /v1/models and GET /v1/models/{id} (404 for a name it does not serve)."""

    def __init__(self) -> None:
        class Handler(FakeHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    return self.send_json(200, {"object": "list", "data": MODELS})
                name = unquote(self.path.removeprefix("/v1/models/"))  # the SDK quotes a name's slashes
                name = ALIASES.get(name, name)
                model = next((m for m in MODELS if m["id"] == name), None)
                if model is None:
                    return self.send_json(404, {"error": {"message": f"The model {name!r} does not exist",
                                                          "type": "invalid_request_error", "code": "model_not_found"}})
                return self.send_json(200, model)

        super().__init__(Handler)


@pytest.fixture
def models_server():
    server = ModelsServer()
    yield server
    server.close()


def test_speech_models_are_not_offered_for_chat(models_server, console):
    backend = RemoteBackend(models_server.url).connect()
    assert backend.model == "chat-one"  # the first chat model, not the first listed
    assert backend.list_models() == ["chat-one", "vlm-two"]
    session = ChatSession(backend, console)
    out = run_keys(session, "/models\r/exit\r")
    assert "* chat-one" in out and "  vlm-two" in out and "whisper" not in out
    out = run_keys(session, "/model whisper-1\r/exit\r")
    assert "no model 'whisper-1' here" in out and backend.model == "chat-one"


@pytest.mark.parametrize("name", ["chat-one", "vlm-two", "/srv/models/chat-one"])
def test_a_model_the_server_serves_is_taken(models_server, name):
    assert RemoteBackend(models_server.url, model=name).connect().model == name


@pytest.mark.parametrize("name, fragments", [
    ("nope", ["does not serve 'nope'", "its chat models: chat-one, vlm-two"]),
    ("whisper-tiny.en", ["'whisper-tiny.en' is a speech-to-text model", "chat models: chat-one, vlm-two"]),
    ("whisper-1", ["'whisper-1' is a speech-to-text model", "tfserve transcribe"]),
])
def test_a_model_the_server_does_not_chat_with_is_refused_at_start(models_server, name, fragments):
    with pytest.raises(ChatError) as caught:
        RemoteBackend(models_server.url, model=name).connect()
    for fragment in fragments:
        assert fragment in str(caught.value)
    result = CliRunner().invoke(app, ["chat", models_server.url, "-m", name], input="hello\n",
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and fragments[0] in lines[0], result.output


@pytest.mark.parametrize("body, chats_with", [
    ({"data": [{"id": 5}, {"id": "chat-one"}]}, "chat-one"),  # an id that is no string: that entry is skipped
    ({"data": [{"object": "model"}, {"id": None}, {"id": "chat-one"}]}, "chat-one"),  # no id at all: skipped
    ({"data": [{"id": 5}]}, None),  # nothing left: no chat models
    ({"data": [{"object": "model"}]}, None),
])
def test_model_list_entries_without_a_string_id_are_skipped(plain_web_server, tmp_path, body, chats_with):
    """`python -m http.server` serving a file v1/models: a listing that is slightly off."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text(json.dumps(body))
    url = f"http://{plain_web_server}"
    if chats_with is not None:
        assert RemoteBackend(url).connect().model == chats_with
        return
    with pytest.raises(ChatError, match=re.escape(f"{url} lists no chat models; name one with --model")):
        RemoteBackend(url).connect()


@pytest.mark.parametrize("body", [
    {"data": ["a", "b"]}, {"data": {"id": "x"}}, {"data": [{"id": "ok"}, None]}, {"object": "list"}, [1, 2], "models",
])
@pytest.mark.parametrize("command", [["chat", "URL"], ["bench", "serve", "--url", "URL", "-n", "1"]])
def test_a_listing_that_is_no_list_of_models_is_one_line(plain_web_server, tmp_path, body, command):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text(json.dumps(body))
    url = f"http://{plain_web_server}"
    result = CliRunner().invoke(app, [url if arg == "URL" else arg for arg in command], input="hello\n",
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"Error: {url}'s /v1/models is not an OpenAI model list: is it an OpenAI-compatible server?"]


def test_an_unknown_local_model_is_offered_the_stores_chat_models_only(tfserve_home):
    """In-process chat: a name that names nothing lists the store's chat models, not its speech-to-text ones
    (chat refuses those)."""
    for name, model_type in [("chat-one", "llama"), ("whisper-tiny.en", "whisper")]:
        folder = tfserve_home / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        (folder / "model.safetensors").write_bytes(b"")
    result = CliRunner().invoke(app, ["chat", "-m", "nonexistent"], input="hello\n", env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown model 'nonexistent'" in lines[0], result.output
    assert "chat models in the store: chat-one" in lines[0] and "whisper" not in lines[0]
